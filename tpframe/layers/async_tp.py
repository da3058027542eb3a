"""Async TP (`parallel.async_tp`): the sequence-parallel GEMMs split into the TP group's sequence blocks, each
block's transfer pushed into the peer's memory by the copy engines (DMA) while the GEMMs keep every SM.

With sequence parallelism a column layer all-gathers its input's sequence before its GEMM and a row layer
reduce-scatters its GEMM's output (Megatron-LM's TP communication overlap; Wang et al., "Overlap communication with
dependent computation via decomposition", ASPLOS 2023). The bytes move by `PeerExchange`
(tpframe/comm/peer_exchange.py: copy engines, stream-memory-operation flags) and the consumer reads the peer's block
where it landed, so nothing is staged and no SM is held by a transfer (an NCCL ring of send/receive pairs held SMs
and lost to this everywhere it was measured: benchmarks/RESULTS.md, 'Async TP: one implementation'). With n = tp
ranks, rank r, blocks t of the sequence:

    column  forward   push x_r to every peer; y_r = x_r W^T + b; then per peer p: y_p = x_p W^T + b on arrival
            backward  gather x again (the input is re-gathered, not saved whole: 1/n of the activation memory)
                      and, per peer p, the partial dX_p = dY_p W as soon as it is computed; dX_r = dY_r W,
                      db = sum dY, dW = dY^T x_all (x gathered where it lands); dX_r += the peers' partials
    row     forward   per peer p: push the partial y_p = x_p W^T; y_r = x_r W^T; y_r += the peers' partials
            backward  gather dy; dX_r = dy_r W; per peer p on arrival: dX_p = dy_p W; then dW = dY_all^T x

The gathers (`PeerExchange.gather`) land the peers' blocks beside a copy-engine copy of this rank's own block, so
each weight gradient is one GEMM over the whole sequence, read in place and rounded once.

The layers call `ce_column` / `ce_row`: inside compiled blocks the two custom ops below (opaque to Inductor, which
fuses what is around them; their backward formulas are custom ops too), eagerly two autograd Functions over the same
bodies (the custom ops' dispatch costs host time a small layer cannot spare). CUDA graphs capture either (the
exchange's flag handshake leaves its flags as it found them, so a replay is right), which takes the host's cost of
their many small calls out of a captured step. CUDA on one host only; elsewhere (tp = 1, no SP, no copy-engine
transport) the layers take the plain path.

    torch.ops.tpframe.ce_column_linear(x, w, bias, comm)  -> all_gather(x) w^T + bias
    torch.ops.tpframe.ce_row_linear(x, w, comm)           -> reduce_scatter(x w^T)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tpframe.comm import Communicator
from tpframe.comm import ops as comm_ops
from tpframe.errors import ConfigError

MODES = ("copy_engine",)  # parallel.async_tp's implementations (true = "copy_engine")
CHOICES = (*MODES, "auto")  # "auto": on where AUTO_TABLE measured it faster than off
# what benchmarks/gpt.py --compare measured: async TP's forward+backward speed over the plain path's, per GPU model,
# TP size and hidden size, at a number of tokens per micro-batch
AUTO_TABLE = Path(__file__).with_name("async_tp_auto.json")


def normalize_mode(value) -> str | None:
    """A config value (parallel.async_tp, "auto" resolved) as a mode: False/None -> None, True -> "copy_engine"."""
    if value is None or value is False:
        return None
    if value is True:
        return "copy_engine"
    if value not in MODES:
        raise ValueError(f"async_tp={value!r}: choose false, true or {' or '.join(map(repr, MODES))}")
    return value


def asked(value) -> bool:
    """Whether parallel.async_tp asks for async TP outright (true, "copy_engine"), not "auto" and not off."""
    return value is True or value in MODES


def _key(row: dict) -> tuple:
    """What an AUTO_TABLE row was measured on: (GPU model, TP size, hidden size)."""
    return row["gpu"], row["tp"], row["hidden"]


def measured(gpu: str, tp: int, hidden: int) -> dict | None:
    """AUTO_TABLE's row for this GPU model, TP size and hidden size, or None."""
    rows = json.loads(AUTO_TABLE.read_text())
    return next((r for r in rows if _key(r) == (gpu, tp, hidden)), None)


def resolve_auto(p, *, hidden: int, tokens: int, device: torch.device, fp8: bool) -> str | None:
    """parallel.async_tp as the mode the layers run (`p`: the ParallelConfig; `tokens`: per micro-batch). "auto" is
    on only where AUTO_TABLE holds a measurement of this GPU model, TP and hidden size at no more tokens per
    micro-batch that was faster than off, and where nothing else rules it out (tp = 1, no SP, no CUDA, fp8,
    selective recompute); off everywhere else, so never slower than off where it was measured."""
    if p.async_tp != "auto":
        return normalize_mode(p.async_tp)
    if p.tp == 1 or not p.sequence_parallel or device.type != "cuda" or fp8 or p.recompute == "selective":
        return None
    row = measured(torch.cuda.get_device_name(device), p.tp, hidden)
    return "copy_engine" if row and row["speedup"] > 1.0 and tokens >= row["tokens"] else None


def record(row: dict) -> None:
    """Put a measurement into AUTO_TABLE (benchmarks/gpt.py --compare), replacing the same GPU, TP and hidden."""
    rows = [r for r in json.loads(AUTO_TABLE.read_text()) if _key(r) != _key(row)]
    rows = sorted([*rows, row], key=_key)
    AUTO_TABLE.write_text("[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]\n")


def check_async_tp(p) -> None:
    """parallel.async_tp (`p`: the run's ParallelConfig) overlaps the sequence-parallel collectives."""
    if asked(p.async_tp) and not p.sequence_parallel:
        raise ConfigError(
            "parallel.async_tp overlaps the sequence-parallel collectives; set parallel.sequence_parallel=true"
        )


def async_tp_available(comm: Communicator, x: torch.Tensor) -> bool:
    """Whether the copy-engine GEMM+collective runs for `x` on `comm`'s group: CUDA, tp > 1, and the group's
    copy-engine transport (`Communicator.peer_exchange`; set up when the layers are built, before any tracing)."""
    if comm.size == 1 or not x.is_cuda:
        return False
    return comm.has_peer_exchange if torch.compiler.is_compiling() else comm.peer_exchange() is not None


def _rows(x: torch.Tensor, blocks: int) -> torch.Tensor:
    """x [blocks * m, ..., k] as [blocks, m * ..., k] (a view of the contiguous tensor)."""
    return x.reshape(blocks, -1, x.shape[-1])


def _row_setup(ctx, inputs, output):
    x, weight, comm_name = inputs
    ctx.save_for_backward(x, weight)
    ctx.comm_name = comm_name


def _mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None) -> None:
    if bias is None:
        torch.mm(a, b, out=out)
    else:
        torch.addmm(bias, a, b, out=out)


def all_gather_matmul(x: torch.Tensor, w_t: torch.Tensor, comm: Communicator, bias: torch.Tensor | None = None):
    """all_gather(x) @ w_t + bias over dim 0: x [m, ..., k] this rank's block, w_t [k, o] -> [n * m, ..., o]."""
    ex, n, r = comm.peer_exchange(), comm.size, comm.rank
    own = x.contiguous().view(-1, x.shape[-1])
    incoming = ex.push({p: own for p in ex.peers})
    y = x.new_empty((n * x.shape[0],) + x.shape[1:-1] + (w_t.shape[1],))
    out = _rows(y, n)
    _mm(own, w_t, out[r], bias)
    for p in ex.peers:
        _mm(incoming[p].wait(), w_t, out[p], bias)
        incoming[p].release()
    ex.join()
    return y


def matmul_reduce_scatter(x: torch.Tensor, w_t: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """reduce_scatter(x @ w_t) over dim 0: x [n * m, ..., k], w_t [k, o] -> [m, ..., o], this rank's block summed."""
    ex, n, r = comm.peer_exchange(), comm.size, comm.rank
    if x.shape[0] % n:
        raise ValueError(f"async TP needs dim 0 of {tuple(x.shape)} divisible by tp={n} (the sequence under SP)")
    blocks = _rows(x.contiguous(), n)
    incoming = {}
    for p in ex.peers:
        incoming.update(ex.push({p: blocks[p] @ w_t}))
    y = blocks[r] @ w_t
    for p in ex.peers:
        y += incoming[p].wait()
        incoming[p].release()
    ex.join()
    return y.view((x.shape[0] // n,) + x.shape[1:-1] + (w_t.shape[1],))


def column_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, comm: Communicator, has_bias: bool):
    """(dX, dW, db) of y = all_gather(x) W^T + b: dX = reduce_scatter(dY W), dW = dY^T all_gather(x), db = sum dY.
    x is this rank's block, gathered again here (under the dX GEMMs) for dW: one GEMM over the whole sequence,
    rounded once. db is empty without a bias."""
    ex, n, r = comm.peer_exchange(), comm.size, comm.rank
    dy = grad.contiguous().view(-1, grad.shape[-1])
    blocks = _rows(dy, n)
    gathered = ex.gather(x.contiguous().view(-1, x.shape[-1]))  # the input again, for dW
    partials = {}
    for p in ex.peers:
        partials.update(ex.push({p: blocks[p] @ weight}))
    gx = blocks[r] @ weight
    gb = dy.sum(0) if has_bias else grad.new_empty(0)
    gw = dy.t() @ gathered.full()
    gathered.release()
    for p in ex.peers:
        gx += partials[p].wait()
        partials[p].release()
    ex.join()
    return gx.view(x.shape), gw, gb


def row_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, comm: Communicator):
    """(dX, dW) of y = reduce_scatter(x W^T): dY = all_gather(dy), dX = dY W (block by block as dY arrives),
    dW = dY^T x (one GEMM over the whole sequence, rounded once)."""
    ex, n, r = comm.peer_exchange(), comm.size, comm.rank
    own = grad.contiguous().view(-1, grad.shape[-1])
    gathered = ex.gather(own)
    gx = x.new_empty(x.shape)
    out = _rows(gx, n)
    torch.mm(own, weight, out=out[r])
    for p in ex.peers:
        torch.mm(gathered.wait(p), weight, out=out[p])
    gw = gathered.full().t() @ x.reshape(-1, x.shape[-1])
    gathered.release()
    ex.join()
    return gx, gw


class _EagerColumn(torch.autograd.Function):
    """The column layer outside torch.compile: the same bodies as the custom ops without their dispatch, which
    costs more host time than the copies' own calls (benchmarks/RESULTS.md, 'Async TP by copy engines: host cost per
    layer call, and the step with transfers free')."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm):
        ctx.save_for_backward(x, weight)
        ctx.comm, ctx.has_bias = comm, bias is not None
        return all_gather_matmul(x, weight.t(), comm, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        gx, gw, gb = column_backward(grad, x, weight, ctx.comm, ctx.has_bias)
        return gx, gw, (gb if ctx.has_bias else None), None


class _EagerRow(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, comm):
        ctx.save_for_backward(x, weight)
        ctx.comm = comm
        return matmul_reduce_scatter(x, weight.t(), comm)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        gx, gw = row_backward(grad, x, weight, ctx.comm)
        return gx, gw, None


def ce_column(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, comm: Communicator) -> torch.Tensor:
    """all_gather(x) weight^T + bias for the layers: the custom op while torch.compile traces, else the Function."""
    if torch.compiler.is_compiling():
        return torch.ops.tpframe.ce_column_linear(x, weight, bias, comm.name)
    return _EagerColumn.apply(x, weight, bias, comm)


def ce_row(x: torch.Tensor, weight: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """reduce_scatter(x weight^T) for the layers: the custom op while torch.compile traces, else the Function."""
    if torch.compiler.is_compiling():
        return torch.ops.tpframe.ce_row_linear(x, weight, comm.name)
    return _EagerRow.apply(x, weight, comm)


@torch.library.custom_op("tpframe::ce_column_linear", mutates_args=())
def ce_column_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, comm_name: str) -> torch.Tensor:
    """all_gather(x) weight^T + bias, x this rank's sequence block."""
    return all_gather_matmul(x, weight.t(), comm_ops.lookup(comm_name), bias)


@ce_column_linear.register_fake
def _(x, weight, bias, comm_name):
    return x.new_empty((comm_ops.lookup(comm_name).size * x.shape[0],) + tuple(x.shape[1:-1]) + (weight.shape[0],))


@torch.library.custom_op("tpframe::ce_column_backward", mutates_args=())
def ce_column_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, has_bias: bool, comm_name: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return column_backward(grad, x, weight, comm_ops.lookup(comm_name), has_bias)


@ce_column_backward.register_fake
def _(grad, x, weight, has_bias, comm_name):
    return x.new_empty(x.shape), weight.new_empty(weight.shape), grad.new_empty(weight.shape[0] if has_bias else 0)


@torch.library.custom_op("tpframe::ce_row_linear", mutates_args=())
def ce_row_linear(x: torch.Tensor, weight: torch.Tensor, comm_name: str) -> torch.Tensor:
    """reduce_scatter(x weight^T) over dim 0 (the sequence)."""
    return matmul_reduce_scatter(x, weight.t(), comm_ops.lookup(comm_name))


@ce_row_linear.register_fake
def _(x, weight, comm_name):
    return x.new_empty((x.shape[0] // comm_ops.lookup(comm_name).size,) + tuple(x.shape[1:-1]) + (weight.shape[0],))


@torch.library.custom_op("tpframe::ce_row_backward", mutates_args=())
def ce_row_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, comm_name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return row_backward(grad, x, weight, comm_ops.lookup(comm_name))


@ce_row_backward.register_fake
def _(grad, x, weight, comm_name):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _column_setup(ctx, inputs, output):
    x, weight, bias, comm_name = inputs
    ctx.save_for_backward(x, weight)
    ctx.comm_name, ctx.has_bias = comm_name, bias is not None


def _column_grads(ctx, grad):
    x, weight = ctx.saved_tensors
    gx, gw, gb = torch.ops.tpframe.ce_column_backward(grad, x, weight, ctx.has_bias, ctx.comm_name)
    return gx, gw, (gb if ctx.has_bias else None), None


def _row_grads(ctx, grad):
    x, weight = ctx.saved_tensors
    gx, gw = torch.ops.tpframe.ce_row_backward(grad, x, weight, ctx.comm_name)
    return gx, gw, None


ce_column_linear.register_autograd(_column_grads, setup_context=_column_setup)
ce_row_linear.register_autograd(_row_grads, setup_context=_row_setup)
