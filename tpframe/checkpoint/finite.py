"""Is a strategy's state finite on every rank? Checked before a checkpoint is published (a checkpoint
holding NaN or inf is never written: it would poison every run resumed from it)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tpframe.parallel.sharding import LogicalChunks


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
