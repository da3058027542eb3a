"""The torch.distributed backend: NCCL on GPUs, gloo on CPUs. Out-of-place, dim-0 collectives."""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch 2.13 renamed the tensor collectives; 2.11 only has the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class NcclBackend:
    """Collectives through torch.distributed on one group. Inputs are never modified."""

    name = "nccl"

    def __init__(self, group: dist.ProcessGroup, size: int):
        self.group = group
        self.size = size

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, op=REDUCE_OPS[op], group=self.group)
        return out

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[n, ...] -> [size * n, ...], rank r's rows at r*n."""
        out = x.new_empty((self.size * x.shape[0],) + tuple(x.shape[1:]))
        _all_gather_single(out, x.contiguous(), group=self.group)
        return out

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """[size * n, ...] -> [n, ...]: the sum over ranks of rank r's rows."""
        out = x.new_empty((x.shape[0] // self.size,) + tuple(x.shape[1:]))
        _reduce_scatter_single(out, x.contiguous(), group=self.group)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def close(self) -> None:
        pass
