"""Gradient synchronization: sequence-parallel partial grads over TP, and data-parallel all-reduce."""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from tpframe.comm import Communicator


def _flat_allreduce(grads: list[torch.Tensor], comm: Communicator, scale: float = 1.0) -> None:
    """All-reduce a list of gradients as one flat buffer per dtype and write the results back."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same])
        reduced = comm.all_reduce(flat)
        if scale != 1.0:
            reduced.mul_(scale)
        offset = 0
        for g in same:
            g.copy_(reduced[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def allreduce_sequence_parallel_grads(params: Iterable[nn.Parameter], tp_comm: Communicator) -> None:
    """Sum over TP the partial gradients of replicated params under sequence parallelism.

    Norm weights and row-parallel biases see only this rank's [s/tp] slice of the sequence.
    """
    if tp_comm.size == 1:
        return
    grads = [p.grad for p in params if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if grads:
        _flat_allreduce(grads, tp_comm)
