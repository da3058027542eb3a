"""The autograd communication mappings of tensor and sequence parallelism.

Each is an autograd function whose forward and backward collectives go through the
`Communicator` it is given (Megatron-LM paper, Shoeybi et al. 2019, section 3):

    mapping                forward                         backward
    copy_to_tp       (f)   identity                        all-reduce
    reduce_from_tp   (g)   all-reduce                      identity
    scatter_to_tp          keep my slice of the last dim   all-gather last dim
    gather_from_tp         all-gather last dim             keep my slice of the last dim
    gather_from_sp   (g)   all-gather dim 0                reduce-scatter dim 0 (or slice)
    reduce_scatter_to_sp   reduce-scatter dim 0            all-gather dim 0     (g-bar)
    all_to_all             rows sent to the ranks          the gradients' rows sent back (EP; CP's all_to_all)

Sequence-parallel activations are sequence-first, [s/tp, b, h], so the split is dim 0.

The all-reduces take `donate` flags: a layer that knows the tensor is a fresh GEMM output nobody else
reads lets NCCL reduce it in place (no copy). Under torch.compile every collective is a traced custom op.
"""

from __future__ import annotations

import torch

from tpframe.comm import Communicator


def _slice(x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
    if comm.size == 1:
        return x
    if x.shape[dim] % comm.size:
        raise ValueError(f"cannot split dim {dim} of shape {tuple(x.shape)} over {comm.size} tensor-parallel ranks")
    return x.chunk(comm.size, dim=dim)[comm.rank].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, donate_grad):
        ctx.comm, ctx.donate_grad = comm, donate_grad
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_reduce(grad, donate=ctx.donate_grad), None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, donate):
        if comm.size == 1:
            return x.view_as(x)
        out = comm.all_reduce(x, donate=donate)
        if out is x:
            ctx.mark_dirty(x)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _slice(x, comm, -1)

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_gather(grad, dim=-1), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return comm.all_gather(x, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return _slice(grad, ctx.comm, -1), None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, reduce_grad):
        ctx.comm, ctx.reduce_grad = comm, reduce_grad
        return comm.all_gather(x, dim=0)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grad:
            return ctx.comm.reduce_scatter(grad, dim=0), None, None
        return _slice(grad, ctx.comm, 0), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return comm.reduce_scatter(x, dim=0)

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_gather(grad, dim=0), None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, output_splits, input_splits):
        ctx.comm, ctx.splits = comm, (output_splits, input_splits)
        return comm.all_to_all(x, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return ctx.comm.all_to_all(grad.contiguous(), input_splits, output_splits), None, None, None


def _apply(mapping: type[torch.autograd.Function], x: torch.Tensor, comm: Communicator, *args) -> torch.Tensor:
    """`mapping` applied to `x` over `comm`; over one rank every mapping is the identity."""
    if comm.size == 1:
        return x
    return mapping.apply(x, comm, *args)


def copy_to_tp(x: torch.Tensor, comm: Communicator, donate_grad: bool = False) -> torch.Tensor:
    """Enter a TP region with a replicated input: identity forward, all-reduce the gradient.

    `donate_grad`: the output feeds exactly one GEMM, so its incoming gradient is a fresh tensor that
    may be reduced in place."""
    return _apply(_CopyToTP, x, comm, donate_grad)


def reduce_from_tp(x: torch.Tensor, comm: Communicator, donate: bool = False) -> torch.Tensor:
    """Leave a TP region by summing partial results: all-reduce forward, identity backward.

    `donate`: `x` is a fresh tensor nobody else reads (not saved for backward): reduce it in place."""
    return _apply(_ReduceFromTP, x, comm, donate)


def scatter_to_tp(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """[..., h] -> [..., h/tp]: this rank's slice of the last dim; all-gather the gradient."""
    return _apply(_ScatterToTP, x, comm)


def gather_from_tp(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """[..., h/tp] -> [..., h]: all-gather the last dim; slice the gradient."""
    return _apply(_GatherFromTP, x, comm)


def gather_from_sp(x: torch.Tensor, comm: Communicator, reduce_grad: bool = True) -> torch.Tensor:
    """[s/tp, ...] -> [s, ...]: all-gather the sequence.

    Backward reduce-scatters when the gathered tensor fed TP-split work (each rank holds a
    partial gradient of the full sequence); with `reduce_grad=False` it only slices.
    """
    return _apply(_GatherFromSP, x, comm, reduce_grad)


def reduce_scatter_to_sp(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """[s, ...] partial sums -> [s/tp, ...] summed: reduce-scatter; all-gather the gradient."""
    return _apply(_ReduceScatterToSP, x, comm)


def all_to_all(x: torch.Tensor, comm: Communicator, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
    """Rows of `x` (dim 0) split by `input_splits` sent to the ranks in rank order; returns the rows received,
    `output_splits[j]` from rank j. Backward sends the gradients back the way the rows came."""
    return _AllToAll.apply(x, comm, output_splits, input_splits)
