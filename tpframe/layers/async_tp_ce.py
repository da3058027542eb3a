"""Async TP by copy engines (`parallel.async_tp=copy_engine`): the sequence-parallel GEMMs split into the TP
group's sequence blocks, each block's transfer pushed into the peer's memory by DMA while the GEMMs keep every SM.

The ring of tpframe/layers/async_tp.py moves blocks with NCCL send/receive kernels, which hold SMs; beside
cuBLAS's persistent GEMMs that works only with `comm.overlap_sm_margin` SMs left idle. Here the bytes move by
`PeerExchange` (tpframe/comm/peer_exchange.py: copy engines, stream-memory-operation flags) and the consumer reads
the peer's block where it landed, so nothing is staged. With n = tp ranks, rank r, blocks t of the sequence:

    column  forward   push x_r to every peer; y_r = x_r W^T + b; then per peer p: y_p = x_p W^T + b on arrival
            backward  push x_r again (the input is re-gathered, not saved whole: 1/n of the activation memory)
                      and, per peer p, the partial dX_p = dY_p W as soon as it is computed; dX_r = dY_r W,
                      dW = sum_t dY_t^T x_t (x_p read on arrival), db = sum dY; dX_r += the peers' partials
    row     forward   per peer p: push the partial y_p = x_p W^T; y_r = x_r W^T; y_r += the peers' partials
            backward  push dy_r; dX_r = dy_r W, dW = dy_r^T x_r; per peer p on arrival: dX_p = dy_p W, dW += dy_p^T x_p

Eager only: under torch.compile or CUDA-graph capture the layers take the plain path (`async_tp_available`).
"""

from __future__ import annotations

import torch

from tpframe.comm import Communicator


def _rows(x: torch.Tensor, blocks: int) -> torch.Tensor:
    """x [blocks * m, ..., k] as [blocks, m * ..., k] (a view of the contiguous tensor)."""
    return x.reshape(blocks, -1, x.shape[-1])


def _mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None) -> None:
    if bias is None:
        torch.mm(a, b, out=out)
    else:
        torch.addmm(bias, a, b, out=out)


def all_gather_matmul(x: torch.Tensor, w_t: torch.Tensor, comm: Communicator, bias: torch.Tensor | None = None):
    """all_gather(x) @ w_t + bias over dim 0: x [m, ..., k] this rank's block, w_t [k, o] -> [n * m, ..., o]."""
    ex, n, r = comm.peer_exchange(), comm.size, comm.rank
    x = x.contiguous()
    own = x.reshape(-1, x.shape[-1])
    incoming = ex.push({p: own for p in ex.peers})
    y = x.new_empty((n * x.shape[0],) + x.shape[1:-1] + (w_t.shape[1],))
    out = _rows(y, n)
    _mm(own, w_t, out[r], bias)
    for p in ex.peers:
        _mm(incoming[p].wait(), w_t, out[p], bias)
        incoming[p].release()
    return y


def matmul_reduce_scatter(x: torch.Tensor, w_t: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """reduce_scatter(x @ w_t) over dim 0: x [n * m, ..., k], w_t [k, o] -> [m, ..., o], this rank's block summed."""
    ex, n, r = comm.peer_exchange(), comm.size, comm.rank
    x = x.contiguous()
    if x.shape[0] % n:
        raise ValueError(f"async TP needs dim 0 of {tuple(x.shape)} divisible by tp={n} (the sequence under SP)")
    blocks = _rows(x, n)
    incoming = {}
    for p in ex.peers:
        incoming.update(ex.push({p: blocks[p] @ w_t}))
    y = blocks[r] @ w_t
    for p in ex.peers:
        y += incoming[p].wait()
        incoming[p].release()
    return y.view((x.shape[0] // n,) + x.shape[1:-1] + (w_t.shape[1],))


class ColumnLinear(torch.autograd.Function):
    """y = all_gather_sp(x) W^T + b; saves x's own block only."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm):
        y = all_gather_matmul(x, weight.t(), comm, bias)
        ctx.save_for_backward(x, weight)
        ctx.comm, ctx.has_bias = comm, bias is not None
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        comm = ctx.comm
        ex, n, r = comm.peer_exchange(), comm.size, comm.rank
        own = x.contiguous().reshape(-1, x.shape[-1])
        dy = _rows(grad.contiguous(), n)
        gathered = ex.push({p: own for p in ex.peers})  # the input again, for dW
        partials = {}
        for p in ex.peers:
            partials.update(ex.push({p: dy[p] @ weight}))
        gx = dy[r] @ weight
        gw = dy[r].t() @ own
        for p in ex.peers:
            gw.addmm_(dy[p].t(), gathered[p].wait())
            gathered[p].release()
        gb = dy.sum((0, 1)) if ctx.has_bias else None
        for p in ex.peers:
            gx += partials[p].wait()
            partials[p].release()
        return gx.view(x.shape), gw, gb, None


class RowLinear(torch.autograd.Function):
    """y = reduce_scatter_sp(x W^T)."""

    @staticmethod
    def forward(ctx, x, weight, comm):
        ctx.save_for_backward(x, weight)
        ctx.comm = comm
        return matmul_reduce_scatter(x, weight.t(), comm)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        comm = ctx.comm
        ex, n, r = comm.peer_exchange(), comm.size, comm.rank
        own = grad.contiguous().reshape(-1, grad.shape[-1])
        xs = _rows(x.contiguous(), n)
        incoming = ex.push({p: own for p in ex.peers})
        gx = x.new_empty(x.shape)
        out = _rows(gx, n)
        torch.mm(own, weight, out=out[r])
        gw = own.t() @ xs[r]
        for p in ex.peers:
            dy = incoming[p].wait()
            torch.mm(dy, weight, out=out[p])
            gw.addmm_(dy.t(), xs[p])
            incoming[p].release()
        return gx, gw, None
