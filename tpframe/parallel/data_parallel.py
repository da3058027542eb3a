"""Gradient buffers and synchronization: fp32 accumulation, sequence-parallel and data-parallel sums.

`GradBuffer` gives every parameter a `main_grad`: an fp32 view into one flat buffer. A hook adds
each backward's `param.grad` into it (so micro-batches accumulate in fp32 even for bf16 params)
and frees `param.grad`. After the last micro-batch:
  - `sync_sequence_parallel(tp_comm)` sums the partial grads of replicated params over TP;
  - `allreduce_data_parallel(dp_comm)` averages the whole buffer over DP in one collective.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from tpframe.comm import Communicator


def _allreduce_views(views: list[torch.Tensor], comm: Communicator) -> None:
    """Sum a list of same-dtype tensors over `comm` as one flat collective, in place."""
    flat = comm.all_reduce(torch.cat([v.reshape(-1) for v in views]))
    offset = 0
    for v in views:
        v.copy_(flat[offset : offset + v.numel()].view_as(v))
        offset += v.numel()


def allreduce_sequence_parallel_grads(params: Iterable[nn.Parameter], tp_comm: Communicator, attr: str = "grad") -> None:
    """Sum over TP the partial gradients of replicated params under sequence parallelism.

    Norm weights and row-parallel biases see only this rank's [s/tp] slice of the sequence.
    `attr` names the gradient field ("grad", or "main_grad" with a GradBuffer).
    """
    if tp_comm.size == 1:
        return
    views = [getattr(p, attr) for p in params if getattr(p, "sequence_parallel", False) and getattr(p, attr, None) is not None]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for v in views:
        by_dtype.setdefault(v.dtype, []).append(v)
    for same in by_dtype.values():
        _allreduce_views(same, tp_comm)


class GradBuffer:
    """One flat fp32 gradient buffer for `params`; `param.main_grad` is each param's view."""

    def __init__(self, params: Iterable[nn.Parameter]):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("GradBuffer needs at least one parameter that requires grad")
        device = self.params[0].device
        total = sum(p.numel() for p in self.params)
        self.buffer = torch.zeros(total, dtype=torch.float32, device=device)
        self._hooks = []
        offset = 0
        for p in self.params:
            p.main_grad = self.buffer[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            self._hooks.append(p.register_post_accumulate_grad_hook(self._accumulate))

    @staticmethod
    def _accumulate(p: nn.Parameter) -> None:
        p.main_grad.add_(p.grad)
        p.grad = None

    def zero(self) -> None:
        self.buffer.zero_()

    def sync_sequence_parallel(self, tp_comm: Communicator) -> None:
        allreduce_sequence_parallel_grads(self.params, tp_comm, attr="main_grad")

    def allreduce_data_parallel(self, dp_comm: Communicator) -> None:
        """Average the gradients over the DP replicas (one all-reduce of the whole buffer)."""
        if dp_comm.size > 1:
            dp_comm.all_reduce_(self.buffer)
            self.buffer.div_(dp_comm.size)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
