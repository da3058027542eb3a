"""The torch.distributed backend: NCCL on GPUs, gloo on CPUs. Out-of-place, dim-0 collectives.

The hot path skips torch.distributed's Python wrappers (argument checks, coalescing-manager lookups,
option objects built per call) and calls the process group's C++ methods with options built once:
a few microseconds less per eager call than `dist.all_reduce` itself. All-gather and reduce-scatter
write straight into a fresh output; the all-reduce, which NCCL runs in place, copies its input first
unless the caller donates it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_C10D = torch._C._distributed_c10d
REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _options(cls, *, blocking: bool = True, **fields):
    opts = cls()
    for name, value in fields.items():
        setattr(opts, name, value)
    if hasattr(opts, "asyncOp"):  # torch >= 2.8: a blocking call may run NCCL on the current stream
        opts.asyncOp = not blocking
    return opts


def _wait(work) -> None:
    if work is not None:  # None: the backend already ordered the call on the current stream (blocking NCCL)
        work.wait()


class NcclBackend:
    """Collectives through torch.distributed on one group. Inputs are never modified unless donated."""

    name = "nccl"

    def __init__(self, group: dist.ProcessGroup, size: int):
        self.group = group
        self.size = size
        self._ar_opts = {op: _options(_C10D.AllreduceOptions, reduceOp=red) for op, red in REDUCE_OPS.items()}
        self._ag_opts = _options(_C10D.AllgatherOptions)
        self._rs_opts = _options(_C10D.ReduceScatterOptions, reduceOp=dist.ReduceOp.SUM)
        # started collectives (`*_start`): NCCL runs them on its own stream, beside what the caller launches next
        self._ag_start = _options(_C10D.AllgatherOptions, blocking=False)
        self._rs_start = _options(_C10D.ReduceScatterOptions, blocking=False, reduceOp=dist.ReduceOp.SUM)
        # torch 2.13 names the single-tensor collectives all_gather_single / reduce_scatter_single; 2.11 has
        # only the underscored names.
        self._ag = getattr(group, "all_gather_single", None) or group._allgather_base
        self._rs = getattr(group, "reduce_scatter_single", None) or group._reduce_scatter_base

    def all_reduce(self, x: torch.Tensor, op: str = "sum", donate: bool = False) -> torch.Tensor:
        """Out of place; with `donate` (the caller gives `x` up) a contiguous `x` is reduced in place."""
        out = x if donate and x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)
        _wait(self.group.allreduce([out], self._ar_opts[op]))
        return out

    def all_reduce_(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        _wait(self.group.allreduce([x], self._ar_opts[op]))
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[n, ...] -> [size * n, ...], rank r's rows at r*n."""
        out = x.new_empty((self.size * x.shape[0],) + x.shape[1:])
        _wait(self._ag(out, x if x.is_contiguous() else x.contiguous(), self._ag_opts))
        return out

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """[size * n, ...] -> [n, ...]: the sum over ranks of rank r's rows."""
        out = x.new_empty((x.shape[0] // self.size,) + x.shape[1:])
        _wait(self._rs(out, x if x.is_contiguous() else x.contiguous(), self._rs_opts))
        return out

    def all_gather_start(self, x: torch.Tensor) -> tuple[torch.Tensor, object]:
        """`all_gather`, started: (the output, its work); read the output after `work.wait()`."""
        out = x.new_empty((self.size * x.shape[0],) + x.shape[1:])
        return out, self._ag(out, x.contiguous(), self._ag_start)

    def reduce_scatter_start(self, x: torch.Tensor) -> tuple[torch.Tensor, object]:
        """`reduce_scatter`, started: (the output, its work); read the output after `work.wait()`."""
        out = x.new_empty((x.shape[0] // self.size,) + x.shape[1:])
        return out, self._rs(out, x.contiguous(), self._rs_start)

    def all_to_all(self, x: torch.Tensor, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
        out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=self.group)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def close(self) -> None:
        pass
