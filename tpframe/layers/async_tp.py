"""Async TP: a sequence-parallel GEMM and its collective micro-pipelined, so the transfer runs under the GEMM.

With sequence parallelism a column layer all-gathers its input's sequence before its GEMM, and a row layer
reduce-scatters its GEMM's output. Both can be cut into the TP group's blocks of the sequence and pipelined
around the ring (Megatron-LM's TP communication overlap; Wang et al., "Overlap communication with dependent
computation via decomposition", ASPLOS 2023):

    ring all-gather + GEMM   step j: send the block held to the previous rank and receive the next one from the
                             next rank, while multiplying the block held (own block first: no wait at step 0)
    GEMM + ring reduce-scatter
                             step j: multiply the block whose sum ends on rank r+j+1 ... own block last; add the
                             partial sum received from the previous rank; send the sum on to the next rank

Every block's GEMM but the first (all-gather) or last (reduce-scatter) overlaps one transfer. The transfers are
NCCL send/receive pairs on NCCL's stream (`Communicator.exchange_async`): no staging copy. NCCL's kernels hold SMs
for the whole transfer, so the GEMMs beside them leave `comm.overlap_sm_margin` SMs free (tpframe/comm/margin.py).
Two modes:
    "ring"         these functions (any NCCL or gloo group; the CPU tests run them);
    "copy_engine"  tpframe/layers/async_tp_ce.py: blocks pushed straight into the peers' memory by the copy
                   engines, read where they land; no SM held by the transfers, no margin (CUDA, one host).
"copy_engine" is custom ops (async_tp_ce.py), eager and compiled alike. The ring also runs inside compiled blocks,
as the custom ops below (opaque to Inductor, which fuses what is around them; their autograd formulas call each
other); under CUDA-graph capture "copy_engine" is captured (its flags return to where they started after every
exchange), the eager ring layers take the plain path, and the ring's custom ops take one collective and one GEMM.

    torch.ops.tpframe.ring_column_linear(x, w, bias, comm)  -> (all_gather(x), all_gather(x) w^T + bias)
    torch.ops.tpframe.ring_row_linear(x, w, comm)           -> reduce_scatter(x w^T)

The eager layers (this module's autograd Functions):
    column    forward  y = all_gather(x) W^T + b (ring)
              backward dX = dy W, reduce-scatter(dX) started (NCCL's stream), dW = dy^T all_gather(x) and db beside it
    row       forward  y = reduce_scatter(x W^T) (ring)
              backward dY = all_gather(dy), dX = dY W (ring), dW = dY^T x
"""

from __future__ import annotations

import torch

from tpframe.comm import Communicator
from tpframe.comm import ops as comm_ops
from tpframe.errors import ConfigError

MODES = ("ring", "copy_engine")  # parallel.async_tp's choices besides true (= ring) and false


def async_tp_available(comm: Communicator, x: torch.Tensor, mode: str) -> bool:
    """Whether `mode`'s micro-pipelined GEMM+collective runs for `x` on `comm`'s group: eagerly (not traced by
    torch.compile, not captured in a CUDA graph) at tp > 1; "copy_engine" needs CUDA with the group's copy-engine
    transport (`Communicator.peer_exchange`), and its custom ops also run in compiled blocks (the transport is set
    up when the layers are built, before tracing) and under CUDA-graph capture."""
    if comm.size == 1:
        return False
    if mode == "copy_engine":
        if not x.is_cuda:
            return False
        return comm.has_peer_exchange if torch.compiler.is_compiling() else comm.peer_exchange() is not None
    return not (torch.compiler.is_compiling() or (x.is_cuda and torch.cuda.is_current_stream_capturing()))


def normalize_mode(value) -> str | None:
    """A config value (parallel.async_tp) as a mode: False/None -> None (off), True -> "ring"."""
    if value is None or value is False:
        return None
    if value is True:
        return "ring"
    if value not in MODES:
        raise ValueError(f"async_tp={value!r}: choose false, true (= ring), {' or '.join(map(repr, MODES))}")
    return value


def check_async_tp(p) -> None:
    """parallel.async_tp (`p`: the run's ParallelConfig) overlaps the sequence-parallel collectives."""
    if p.async_tp and not p.sequence_parallel:
        raise ConfigError(
            "parallel.async_tp overlaps the sequence-parallel collectives; set parallel.sequence_parallel=true"
        )


def _rows(x: torch.Tensor, blocks: int) -> torch.Tensor:
    """x [blocks * m, ..., k] as [blocks, m * ..., k] (a view of the contiguous tensor)."""
    return x.reshape(blocks, -1, x.shape[-1])


def ring_all_gather_matmul(
    x: torch.Tensor, b: torch.Tensor, comm: Communicator, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(all_gather(x), all_gather(x) @ b + bias) with the gather pipelined under the GEMM blocks.

    x [m, ..., k] this rank's block of dim 0; b [k, o]. Step j multiplies block (rank + j) % n while that
    block goes on to the previous rank and block (rank + j + 1) % n arrives from the next one."""
    n, r = comm.size, comm.rank
    x = x.contiguous()
    full = x.new_empty((n * x.shape[0],) + x.shape[1:])
    y = x.new_empty(full.shape[:-1] + (b.shape[1],))
    blocks, out, own = _rows(full, n), _rows(y, n), x.reshape(-1, x.shape[-1])
    for j in range(n):
        t = (r + j) % n
        held = own if j == 0 else blocks[t]
        pending = None
        if j < n - 1:
            pending = comm.exchange_async(held, to=(r - 1) % n, recv=blocks[(t + 1) % n], source=(r + 1) % n)
        with comm.beside(pending):
            if bias is None:
                torch.mm(held, b, out=out[t])
            else:
                torch.addmm(bias, held, b, out=out[t])
        if j == 0:
            blocks[r].copy_(own)  # the gathered input is saved for the weight gradient
        if pending is not None:
            pending.wait()
    return full, y


def ring_matmul_reduce_scatter(x: torch.Tensor, b: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """reduce_scatter(x @ b) over dim 0 with the reduction pipelined under the GEMM blocks.

    x [n * m, ..., k]; b [k, o]; returns [m, ..., o], this rank's block summed over the group. Step j
    multiplies block (rank - j - 1) % n, adds the partial sum of it received from the previous rank and
    sends the sum on to the next; the last step's block is this rank's own."""
    n, r = comm.size, comm.rank
    x = x.contiguous()
    if x.shape[0] % n:
        raise ValueError(f"async TP needs dim 0 of {tuple(x.shape)} divisible by tp={n} (the sequence under SP)")
    blocks = _rows(x, n)
    pending = None
    for j in range(n):
        with comm.beside(pending):  # launched before the wait: it overlaps the previous transfer
            part = blocks[(r - j - 1) % n] @ b
        if pending is not None:
            part += pending.wait()
        if j < n - 1:
            pending = comm.exchange_async(part, to=(r + 1) % n, recv=torch.empty_like(part), source=(r - 1) % n)
    return part.view((x.shape[0] // n,) + x.shape[1:-1] + (b.shape[1],))


def ring_traced(comm: Communicator, mode: str | None) -> bool:
    """Whether the ring runs as the compile-visible custom ops: mode "ring" at tp > 1 while torch.compile traces."""
    return mode == "ring" and comm.size > 1 and torch.compiler.is_compiling()


@torch.library.custom_op("tpframe::ring_column_linear", mutates_args=())
def ring_column_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, comm_name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(all_gather(x), all_gather(x) weight^T + bias): `ring_all_gather_matmul`, or, inside a CUDA-graph capture
    (no NCCL send/receive there), the all-gather and one GEMM."""
    comm = comm_ops.lookup(comm_name)
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        full = comm.all_gather(x.contiguous())
        return full, torch.nn.functional.linear(full, weight, bias)
    return ring_all_gather_matmul(x, weight.t(), comm, bias)


@ring_column_linear.register_fake
def _(x, weight, bias, comm_name):
    full = x.new_empty((comm_ops.lookup(comm_name).size * x.shape[0],) + tuple(x.shape[1:]))
    return full, x.new_empty(tuple(full.shape[:-1]) + (weight.shape[0],))


@torch.library.custom_op("tpframe::ring_row_linear", mutates_args=())
def ring_row_linear(x: torch.Tensor, weight: torch.Tensor, comm_name: str) -> torch.Tensor:
    """reduce_scatter(x weight^T) over dim 0: `ring_matmul_reduce_scatter`, or the GEMM and the reduce-scatter
    inside a CUDA-graph capture."""
    comm = comm_ops.lookup(comm_name)
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return comm.reduce_scatter(torch.nn.functional.linear(x, weight))
    return ring_matmul_reduce_scatter(x, weight.t(), comm)


@ring_row_linear.register_fake
def _(x, weight, comm_name):
    return x.new_empty((x.shape[0] // comm_ops.lookup(comm_name).size,) + tuple(x.shape[1:-1]) + (weight.shape[0],))


def _column_setup(ctx, inputs, output):
    x, weight, bias, comm_name = inputs
    ctx.save_for_backward(output[0], weight)
    ctx.comm_name, ctx.has_bias = comm_name, bias is not None


def _column_backward(ctx, grad_full, grad):
    """dX = reduce_scatter(dY W) by the row ring, dW = dY^T all_gather(x), db = sum(dY)."""
    full, weight = ctx.saved_tensors
    gx = torch.ops.tpframe.ring_row_linear(grad, weight.t(), ctx.comm_name)
    gw, gb = _mm_grads(grad, full, ctx.has_bias)
    return gx, gw, gb, None


def _row_setup(ctx, inputs, output):
    x, weight, comm_name = inputs
    ctx.save_for_backward(x, weight)
    ctx.comm_name = comm_name


def _row_backward(ctx, grad):
    """dY = all_gather(dy) under dX = dY W by the column ring, dW = dY^T x."""
    x, weight = ctx.saved_tensors
    grad_full, gx = torch.ops.tpframe.ring_column_linear(grad, weight.t(), None, ctx.comm_name)
    gw, _ = _mm_grads(grad_full, x, False)
    return gx, gw, None


ring_column_linear.register_autograd(_column_backward, setup_context=_column_setup)
ring_row_linear.register_autograd(_row_backward, setup_context=_row_setup)


def _mm_grads(grad: torch.Tensor, x: torch.Tensor, has_bias: bool):
    """dW = grad^T x and db = sum(grad) over all leading dims; grad [..., out], x [..., in]."""
    g2 = grad.reshape(-1, grad.shape[-1])
    return g2.t() @ x.reshape(-1, x.shape[-1]), (g2.sum(0) if has_bias else None)


class RingAllGatherLinear(torch.autograd.Function):
    """y = all_gather_sp(x) W^T + b by `ring_all_gather_matmul`. Backward hides dX's reduce-scatter behind the weight
    gradient: dX = dy W, start reduce-scatter(dX) (NCCL's stream), dW = dy^T all_gather(x) and db while it runs
    (leaving `comm.overlap_sm_margin` SMs to it), then wait."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm):
        x_full, y = ring_all_gather_matmul(x, weight.t(), comm, bias)
        ctx.save_for_backward(x_full, weight)
        ctx.comm = comm
        return y

    @staticmethod
    def backward(ctx, grad):
        x_full, weight = ctx.saved_tensors
        pending = ctx.comm.reduce_scatter_async(grad.matmul(weight)) if ctx.needs_input_grad[0] else None
        g2 = grad.reshape(-1, grad.shape[-1])
        with ctx.comm.beside(pending):
            gw = g2.t().mm(x_full.reshape(-1, x_full.shape[-1])) if ctx.needs_input_grad[1] else None
        gb = g2.sum(0) if ctx.needs_input_grad[2] else None
        return (pending.wait() if pending is not None else None), gw, gb, None


class RingLinearReduceScatter(torch.autograd.Function):
    """y = reduce_scatter_sp(x W^T) by `ring_matmul_reduce_scatter`; backward gathers dy by
    `ring_all_gather_matmul` (dX's GEMM blocks hide it), then dW = dY^T x."""

    @staticmethod
    def forward(ctx, x, weight, comm):
        ctx.save_for_backward(x, weight)
        ctx.comm = comm
        return ring_matmul_reduce_scatter(x, weight.t(), comm)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_full, gx = ring_all_gather_matmul(grad, weight, ctx.comm)
        gw, _ = _mm_grads(grad_full, x, False)
        return gx, gw, None
