"""Is a strategy's state finite on every rank? Checked before a checkpoint is published (a checkpoint
holding NaN or inf is never written: it would poison every run resumed from it). Weights read from elsewhere
(checkpoint.init_from, generate.py's) are checked as they are read: `check_finite_weights`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from tpframe.errors import ConfigError
from tpframe.parallel.sharding import LogicalChunks


@torch.no_grad()
def check_finite_weights(tensors: Iterable[tuple[str, torch.Tensor]], where: str) -> None:
    """ConfigError naming the first floating-point tensor of (name, tensor) pairs that holds NaN or inf: one
    max-abs pass, a tensor at a time (a run initialized from it skips every step; generation yields nothing)."""
    for name, t in tensors:
        if not t.is_floating_point() or not t.numel() or torch.isfinite(torch.linalg.vector_norm(t, float("inf"))):
            continue
        counts = [
            f"{n:,} {what}" for what, n in (("NaN", int(torch.isnan(t).sum())), ("inf", int(torch.isinf(t).sum()))) if n
        ]
        raise ConfigError(
            f"{where}: tensor {name} holds {' and '.join(counts)} (of {t.numel():,} values): weights "
            "that are not finite cannot be trained or generated from; use weights saved before they "
            "diverged"
        )


def safetensors_items(paths: Iterable[Path], names: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the tensors in safetensors files (those in `names`; None: all), read one at a time."""
    from safetensors import safe_open

    for path in paths:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if names is None or name in names:
                    yield name, f.get_tensor(name)


@torch.no_grad()
def all_finite(state: dict, group=None) -> bool:
    """Whether every tensor of a strategy's state (LogicalChunks pieces and plain tensors) is finite, on
    every rank: one fused max-abs reduction per device and dtype, then one all-reduce over `group`."""
    tensors = []
    for value in state.values():
        if isinstance(value, LogicalChunks):
            tensors.extend(t for _, t in value.pieces)
        elif isinstance(value, torch.Tensor):
            tensors.append(value)
    tensors = [t for t in tensors if t.is_floating_point() and t.numel()]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    finite = True
    for group_tensors in by_device.values():
        norms = torch._foreach_norm(group_tensors, float("inf"))  # max |x| per tensor; NaN and inf propagate
        finite = finite and bool(torch.isfinite(torch.stack([n.float() for n in norms])).all())
    flag = torch.tensor([0.0 if finite else 1.0])
    if group is not None and dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return flag.item() == 0.0
