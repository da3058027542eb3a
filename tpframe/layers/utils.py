"""Small helpers shared by the parallel layers: divisibility checks, shard init, param tags."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

InitMethod = Callable[[torch.Tensor], object]


def divide(numerator: int, denominator: int, what: str) -> int:
    """numerator / denominator, or a ValueError naming `what` when it does not divide."""
    if numerator % denominator:
        raise ValueError(f"{what} = {numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator


def normal_init(std: float = 0.02) -> InitMethod:
    return lambda w: torch.nn.init.normal_(w, mean=0.0, std=std)


def scaled_normal_init(std: float, num_layers: int) -> InitMethod:
    """GPT-2's init for the projections that write into the residual stream."""
    return normal_init(std / math.sqrt(2.0 * num_layers))


def init_shard(
    full_shape: tuple[int, ...],
    tp_dim: int | None,
    rank: int,
    size: int,
    init_method: InitMethod,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Initialize the full master tensor in fp32 on CPU and return this rank's contiguous shard.

    Every TP size draws the same master from the same generator state, so a TP=1 and a TP=4
    model built with the same seed are the same model.
    """
    master = torch.empty(full_shape, dtype=torch.float32)
    init_method(master)
    if tp_dim is not None and size > 1:
        master = master.chunk(size, dim=tp_dim)[rank]
    return master.to(device=device, dtype=dtype).contiguous()


def tag_param(param: torch.nn.Parameter, tp_dim: int | None, sequence_parallel: bool = False) -> torch.nn.Parameter:
    """Record what checkpoints and grad sync need to know about a parameter.

    tp_dim: the dim split across TP ranks (None: replicated on every TP rank).
    sequence_parallel: replicated, but each TP rank sees only its sequence slice under
    sequence parallelism, so its gradient is partial and must be all-reduced over TP.
    """
    param.tp_dim = tp_dim
    param.sequence_parallel = bool(sequence_parallel and tp_dim is None)
    return param
