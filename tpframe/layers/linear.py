"""Column- and row-parallel linear layers (Megatron-LM's MLP/attention split).

Column: weight [out/tp, in], rank r holds rows r*out/tp:(r+1)*out/tp; output is split on the last dim.
Row:    weight [out, in/tp], rank r holds columns r*in/tp:(r+1)*in/tp; partial outputs are summed,
        then the full bias [out] is added once.

Async TP (`async_tp="ring"` or `"copy_engine"`, with sequence parallelism; tpframe/layers/async_tp.py): each GEMM
and its sequence collective are one autograd Function (or custom op) whose collective is micro-pipelined with the
GEMM's blocks:
    column: forward  all-gather(x) @ W^T        backward  reduce-scatter(dy @ W), dW = dy^T all-gather(x)
    row:    forward  reduce-scatter(x @ W^T)    backward  all-gather(dy) @ W,     dW = all-gather(dy)^T x
Where it cannot run (tp = 1, no SP, CUDA-graph capture of the eager ring, "copy_engine" without the copy-engine
transport) the same layers take the plain path below.

`fp8=True`: the plain path's GEMM in float8 (tpframe/layers/fp8.py; not with async TP or deferred weight
gradients, which the config refuses).
"""

from __future__ import annotations

import torch
from torch import nn

from tpframe.comm import Communicator
from tpframe.kernels import gemv
from tpframe.layers.async_tp import (
    RingAllGatherLinear,
    RingLinearReduceScatter,
    async_tp_available,
    normalize_mode,
    ring_traced,
)
from tpframe.layers.async_tp_ce import ce_column, ce_row  # parallel.async_tp=copy_engine
from tpframe.layers.fp8 import fp8_linear
from tpframe.layers.mappings import (
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_tp,
)
from tpframe.layers.utils import InitMethod, divide, init_shard, normal_init, tag_param
from tpframe.parallel.pipeline.weight_grad import linear
from tpframe.parallel.state import default_tp_comm


def _check_last_dim(x: torch.Tensor, expected: int, layer: str, what: str) -> None:
    if x.shape[-1] != expected:
        raise ValueError(
            f"{layer}: input of shape {tuple(x.shape)} has last dim {x.shape[-1]}, expected {what} = {expected}"
        )


def enter_tp_region(x: torch.Tensor, comm: Communicator, sequence_parallel: bool) -> torch.Tensor:
    """A column layer's input as its GEMM takes it: the sequence all-gathered under SP, else the identity
    whose backward all-reduces. Its output feeds only the GEMM: its gradient is fresh and may be reduced in place."""
    return gather_from_sp(x, comm) if sequence_parallel else copy_to_tp(x, comm, donate_grad=True)


def local_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    fp8: bool = False,
    decode_kernel: bool = True,
) -> torch.Tensor:
    """This rank's GEMM of a TP layer: float8 (`fp8`); the one-row kernel inside a batch-1 decode step's CUDA
    graph (`decode_kernel`, tpframe/kernels/gemv.py); else F.linear, whose weight gradient zero-bubble pipeline
    schedules may defer."""
    if fp8:
        return fp8_linear(x, weight, bias)
    if decode_kernel and gemv.takes(x, weight):
        return gemv.row_linear(x, weight, bias)
    return linear(x, weight, bias)


def column_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    comm: Communicator,
    sequence_parallel: bool = False,
    gather_output: bool = False,
    *,
    async_tp: bool | str | None = None,
    fp8: bool = False,
    entered: bool = False,
    decode_kernel: bool = True,
) -> torch.Tensor:
    """y = x W^T + b with W split by output rows.

    x: [s, b, h] replicated, or [s/tp, b, h] with sequence parallelism.
    Forward: identity (or all-gather of the sequence); backward: all-reduce (or reduce-scatter).
    Returns [s, b, out/tp], or [s, b, out] with `gather_output` (all-gather of the last dim).
    `entered=True`: x has already been through `enter_tp_region` (selective recompute does that itself).
    `async_tp`: None, "ring" or "copy_engine" (True = "ring"): the SP all-gather under the GEMM.
    `decode_kernel`: a one-row input inside a decode step's CUDA graph runs tpframe/kernels/gemv.py.
    """
    mode = normalize_mode(async_tp) if sequence_parallel and not entered else None
    if ring_traced(comm, mode):  # compiled blocks: the ring as a custom op
        y = torch.ops.tpframe.ring_column_linear(x, weight, bias, comm.name)[1]
    elif mode is not None and async_tp_available(comm, x, mode):  # computes its weight gradient itself (not deferred)
        if mode == "copy_engine":
            y = ce_column(x, weight, bias, comm)
        else:
            y = RingAllGatherLinear.apply(x, weight, bias, comm)
    else:
        x = x if entered else enter_tp_region(x, comm, sequence_parallel)
        y = local_linear(x, weight, bias, fp8=fp8, decode_kernel=decode_kernel)
    return gather_from_tp(y, comm) if gather_output else y


def row_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    comm: Communicator,
    sequence_parallel: bool = False,
    input_is_parallel: bool = True,
    *,
    async_tp: bool | str | None = None,
    fp8: bool = False,
    decode_kernel: bool = True,
) -> torch.Tensor:
    """y = x W^T + b with W split by input columns.

    x: [s, b, in/tp] (or [s, b, in], sliced here when not `input_is_parallel`).
    Forward: all-reduce of the partial products (or reduce-scatter to [s/tp, b, out]).
    """
    if not input_is_parallel:
        x = scatter_to_tp(x, comm)
    mode = normalize_mode(async_tp) if sequence_parallel else None
    if ring_traced(comm, mode):  # compiled blocks: the ring as a custom op
        y = torch.ops.tpframe.ring_row_linear(x, weight, comm.name)
    elif mode is not None and async_tp_available(comm, x, mode):  # computes its weight gradient itself (not deferred)
        if mode == "copy_engine":
            y = ce_row(x, weight, comm)
        else:
            y = RingLinearReduceScatter.apply(x, weight, comm)
    else:
        y = local_linear(x, weight, fp8=fp8, decode_kernel=decode_kernel)
        # the GEMM output is fresh and not saved for backward: NCCL may reduce it in place
        y = reduce_scatter_to_sp(y, comm) if sequence_parallel else reduce_from_tp(y, comm, donate=True)
    return y + bias if bias is not None else y


class ColumnParallelLinear(nn.Module):
    """Linear layer whose output features are split across the TP group.

    `fused_parts` (e.g. (("q", 64), ("k", 16), ("v", 16))) fuses several logical weights into one
    GEMM: each part is row-split across TP on its own and the local weight is the concatenation
    of this rank's part shards, so every part stays a plain row-shard of its own global tensor.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        comm: Communicator | None = None,
        init_method: InitMethod | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        fused_parts: tuple[tuple[str, int], ...] | None = None,
        async_tp: bool | str | None = None,
        fp8: bool = False,
    ):
        super().__init__()
        self.comm = comm or default_tp_comm()
        tp, rank = self.comm.size, self.comm.rank
        self.in_features, self.out_features = in_features, out_features
        self.out_per_rank = divide(out_features, tp, "ColumnParallelLinear out_features")
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.async_tp, self.fp8 = normalize_mode(async_tp), fp8
        self.fused_decode = True  # the one-row kernel in batch-1 decode graphs (tpframe/kernels/gemv.py)
        if fused_parts is not None:
            if gather_output:
                raise ValueError("ColumnParallelLinear: gather_output=True cannot be combined with fused_parts")
            if sum(size for _, size in fused_parts) != out_features:
                raise ValueError(f"fused_parts {fused_parts} must add up to out_features = {out_features}")
            for name, size in fused_parts:
                divide(size, tp, f"ColumnParallelLinear part {name!r} size")
        parts = fused_parts or (("weight", out_features),)
        device = device or self.comm.device
        init_method = init_method or normal_init()
        w = torch.cat([init_shard((size, in_features), 0, rank, tp, init_method, dtype, device) for _, size in parts])
        self.weight = tag_param(nn.Parameter(w), tp_dim=0)
        if fused_parts is not None:
            self.weight.fused_parts = tuple(fused_parts)
        if bias:
            b = torch.cat([init_shard((size,), 0, rank, tp, nn.init.zeros_, dtype, device) for _, size in parts])
            self.bias = tag_param(nn.Parameter(b), tp_dim=0)
            if fused_parts is not None:
                self.bias.fused_parts = tuple(fused_parts)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, *, entered: bool = False) -> torch.Tensor:
        """`entered=True`: x is already `self.enter(input)` (all-gathered under SP)."""
        _check_last_dim(x, self.in_features, "ColumnParallelLinear", "in_features")
        return column_parallel_linear(
            x,
            self.weight,
            self.bias,
            self.comm,
            self.sequence_parallel,
            self.gather_output,
            async_tp=self.async_tp,
            fp8=self.fp8,
            entered=entered,
            decode_kernel=self.fused_decode,
        )

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """The input's entry into the TP region; forward(enter(x), entered=True) == forward(x)."""
        return enter_tp_region(x, self.comm, self.sequence_parallel)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features} ({self.out_per_rank}/rank), "
            f"bias={self.bias is not None}, gather_output={self.gather_output}, sp={self.sequence_parallel}"
            + (f", async_tp={self.async_tp}" if self.async_tp else "")
            + (", fp8=True" if self.fp8 else "")
        )


class RowParallelLinear(nn.Module):
    """Linear layer whose input features are split across the TP group."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        comm: Communicator | None = None,
        init_method: InitMethod | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        async_tp: bool | str | None = None,
        fp8: bool = False,
    ):
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True needs input_is_parallel=True")
        self.comm = comm or default_tp_comm()
        tp, rank = self.comm.size, self.comm.rank
        self.in_features, self.out_features = in_features, out_features
        self.in_per_rank = divide(in_features, tp, "RowParallelLinear in_features")
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.async_tp, self.fp8 = normalize_mode(async_tp), fp8
        self.fused_decode = True  # the one-row kernel in batch-1 decode graphs (tpframe/kernels/gemv.py)
        device = device or self.comm.device
        init_method = init_method or normal_init()
        w = init_shard((out_features, in_features), 1, rank, tp, init_method, dtype, device)
        self.weight = tag_param(nn.Parameter(w), tp_dim=1)
        if bias:
            b = init_shard((out_features,), None, rank, tp, nn.init.zeros_, dtype, device)
            self.bias = tag_param(nn.Parameter(b), tp_dim=None, sequence_parallel=sequence_parallel)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        expected = self.in_per_rank if self.input_is_parallel else self.in_features
        _check_last_dim(x, expected, "RowParallelLinear", "in_features/tp" if self.input_is_parallel else "in_features")
        return row_parallel_linear(
            x,
            self.weight,
            self.bias,
            self.comm,
            self.sequence_parallel,
            self.input_is_parallel,
            async_tp=self.async_tp,
            fp8=self.fp8,
            decode_kernel=self.fused_decode,
        )

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's term of the output, x_r W_r^T, not yet summed over TP and without the bias: for a caller
        that combines several layers' terms before one reduction (the experts of a MoE layer)."""
        if self.bias is not None:
            raise ValueError("RowParallelLinear.partial: a layer with a bias adds it after the TP sum; use forward()")
        _check_last_dim(x, self.in_per_rank, "RowParallelLinear", "in_features/tp")
        return local_linear(x, self.weight, fp8=self.fp8, decode_kernel=self.fused_decode)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features} ({self.in_per_rank}/rank), out={self.out_features}, "
            f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, sp={self.sequence_parallel}"
            + (f", async_tp={self.async_tp}" if self.async_tp else "")
            + (", fp8=True" if self.fp8 else "")
        )


def enable_async_tp(model: nn.Module, mode: bool | str | None = "ring") -> int:
    """Set async TP's mode ("ring", "copy_engine"; True = "ring"; None/False: off) in every sequence-parallel linear
    layer of `model`; returns how many.

    Layers fall back to the plain path per call where `async_tp_available` says no (tp = 1; the eager ring
    under CUDA-graph capture, "copy_engine" on CPU or without the group's copy-engine transport)."""
    n, mode = 0, normalize_mode(mode)
    for m in model.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.sequence_parallel:
            m.async_tp = mode
            n += 1
            if mode == "copy_engine":  # set up now (a collective), before any block is traced
                m.comm.peer_exchange()
    return n


def fp8_pays(local_out: int, local_in: int) -> bool:
    """Whether a GEMM of this per-rank weight shape [out, in] gains from float8 enough to pay for its casts: not
    when out <= 4096 and in <= 1024 (the threshold torchao's auto-filter for tensorwise scaling takes from its H100
    measurements; GPT-125M's blocks, all of whose layers but fc2 fall under it, ran 0.83x in float8 on an H200)."""
    return not (local_out <= 4096 and local_in <= 1024)


def enable_fp8(model: nn.Module, enabled: bool = True, *, small_layers: bool = False) -> tuple[int, list[str]]:
    """Switch the float8 GEMMs (tpframe/layers/fp8.py) on (or off) in the column/row-parallel linear layers of
    `model`: those whose per-rank sizes are multiples of 16 (what the float8 GEMM takes) and, unless
    `small_layers`, big enough to gain (`fp8_pays`). The vocabulary head and the embedding are other classes and
    stay in the compute dtype. Returns (layers switched, "name (why not)" of the others)."""
    n, skipped = 0, []
    for name, m in model.named_modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            local_out, local_in = m.weight.shape
            if enabled and (local_in % 16 or local_out % 16):
                skipped.append(f"{name} ({local_out}x{local_in}: not multiples of 16)")
                continue
            if enabled and not small_layers and not fp8_pays(local_out, local_in):
                skipped.append(f"{name} ({local_out}x{local_in}: too small to gain)")
                continue
            m.fp8 = enabled
            n += 1
    return n, skipped
