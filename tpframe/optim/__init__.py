"""Gradient-and-optimizer strategies (one per `parallel.dp_strategy`), AdamW and the learning-rate schedule.

    strategy = build_strategy("zero1", model, cfg.optim, parallel, bucket_mb=40, overlap_grad_sync=True)

`ddp` (tpframe/optim/ddp.py): replicated optimizer, bucketed all-reduce overlapped with backward.
`zero1` (zero1.py): masters and moments sharded over DP, reduce-scatter + all-gather.
`fsdp` (fsdp.py): PyTorch's FSDP2 over the DP mesh dimension, composed with tpframe's TP layers.
The interface they share is in strategy.py.
"""

from __future__ import annotations

import torch
from torch import nn

from tpframe.errors import ConfigError
from tpframe.optim.config import OptimConfig
from tpframe.optim.lr import lr_at
from tpframe.optim.strategy import GradStrategy

STRATEGIES = ("ddp", "zero1", "fsdp")  # parallel.dp_strategy's choices (tpframe/training/config.py)


def build_strategy(
    name: str,
    model: nn.Module,
    cfg: OptimConfig,
    parallel,
    *,
    bucket_mb: float = 40.0,
    overlap_grad_sync: bool = True,
    compute_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
) -> GradStrategy:
    """The strategy `name` over `model` (built already; fsdp shards it in place)."""
    bucket_bytes = max(1, int(bucket_mb * 2**20))
    if name in ("ddp", "zero1"):
        from tpframe.optim.ddp import DDPStrategy
        from tpframe.optim.zero1 import Zero1Strategy

        strategy = DDPStrategy if name == "ddp" else Zero1Strategy
        return strategy(
            model,
            cfg,
            parallel,
            bucket_bytes=bucket_bytes,
            overlap=overlap_grad_sync,
            reduce_dtype=reduce_dtype,
        )
    if name == "fsdp":
        from tpframe.optim.fsdp import FSDPStrategy

        return FSDPStrategy(model, cfg, parallel, compute_dtype=compute_dtype, reduce_dtype=reduce_dtype)
    raise ValueError(f"parallel.dp_strategy={name!r} is not a strategy; choose one of {', '.join(STRATEGIES)}")


def check_data_parallel(p) -> None:
    """The `parallel:` keys the strategies read (`p` is the run's ParallelConfig)."""
    if not p.grad_bucket_mb > 0:
        raise ConfigError(f"parallel.grad_bucket_mb={p.grad_bucket_mb} must be a positive number of MiB")


__all__ = ["STRATEGIES", "GradStrategy", "OptimConfig", "build_strategy", "check_data_parallel", "lr_at"]
