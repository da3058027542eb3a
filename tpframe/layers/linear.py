"""Column- and row-parallel linear layers (Megatron-LM's MLP/attention split).

Column: weight [out/tp, in], rank r holds rows r*out/tp:(r+1)*out/tp; output is split on the last dim.
Row:    weight [out, in/tp], rank r holds columns r*in/tp:(r+1)*in/tp; partial outputs are summed,
        then the full bias [out] is added once.

Each layer decides at construction from its `LayerMode` (tpframe/layers/mode.py) and its shard what it runs.
Async TP (`mode.async_tp`, with sequence parallelism; tpframe/layers/async_tp.py): each GEMM and its sequence
collective are one autograd Function (or custom op) whose collective is pipelined with the GEMM's blocks:
    column: forward  all-gather(x) @ W^T        backward  reduce-scatter(dy @ W), dW = dy^T all-gather(x)
    row:    forward  reduce-scatter(x @ W^T)    backward  all-gather(dy) @ W,     dW = all-gather(dy)^T x
Where it cannot run (tp = 1, no SP, no copy-engine transport) the same layers take the plain path below.

`mode.fp8`: the plain path's GEMM in float8 with the mode's recipe where the shard gains (tpframe/layers/fp8.py; not
with async TP, which the config refuses).
"""

from __future__ import annotations

import torch
from torch import nn

from tpframe.comm import Communicator
from tpframe.kernels import gemv
from tpframe.layers.async_tp import async_tp_available, ce_column, ce_row
from tpframe.layers.fp8 import fp8_linear, fp8_refusal
from tpframe.layers.lora import column_adapter, column_delta, row_adapter, row_delta
from tpframe.layers.mappings import (
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_tp,
)
from tpframe.layers.mode import DEFAULT_MODE, LayerMode
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
    fp8: str | None = None,
    decode_kernel: bool = True,
) -> torch.Tensor:
    """This rank's GEMM of a TP layer: float8 (`fp8`: the recipe); the one-row kernel inside a batch-1 decode step's
    CUDA graph (`decode_kernel`, tpframe/kernels/gemv.py); else F.linear, whose weight gradient zero-bubble pipeline
    schedules may defer."""
    if fp8:
        return fp8_linear(x, weight, bias, recipe=fp8)
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
    async_tp: str | None = None,
    fp8: str | None = None,
    entered: bool = False,
    decode_kernel: bool = True,
) -> torch.Tensor:
    """y = x W^T + b with W split by output rows.

    x: [s, b, h] replicated, or [s/tp, b, h] with sequence parallelism.
    Forward: identity (or all-gather of the sequence); backward: all-reduce (or reduce-scatter).
    Returns [s, b, out/tp], or [s, b, out] with `gather_output` (all-gather of the last dim).
    `entered=True`: x has already been through `enter_tp_region` (selective recompute does that itself).
    `async_tp`: None or "copy_engine": the SP all-gather under the GEMM.
    `decode_kernel`: a one-row input inside a decode step's CUDA graph runs tpframe/kernels/gemv.py.
    """
    if async_tp and sequence_parallel and not entered and async_tp_available(comm, x):
        y = ce_column(x, weight, bias, comm)  # computes its weight gradient itself (not deferred)
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
    async_tp: str | None = None,
    fp8: str | None = None,
    decode_kernel: bool = True,
) -> torch.Tensor:
    """y = x W^T + b with W split by input columns.

    x: [s, b, in/tp] (or [s, b, in], sliced here when not `input_is_parallel`).
    Forward: all-reduce of the partial products (or reduce-scatter to [s/tp, b, out]).
    """
    if not input_is_parallel:
        x = scatter_to_tp(x, comm)
    if async_tp and sequence_parallel and async_tp_available(comm, x):
        y = ce_row(x, weight, comm)  # computes its weight gradient itself (not deferred)
    else:
        y = local_linear(x, weight, fp8=fp8, decode_kernel=decode_kernel)
        # the GEMM output is fresh and not saved for backward: NCCL may reduce it in place
        y = reduce_scatter_to_sp(y, comm) if sequence_parallel else reduce_from_tp(y, comm, donate=True)
    return y + bias if bias is not None else y


def _decide(layer: nn.Module, mode: LayerMode) -> None:
    """What a column/row layer runs, decided once from `mode` and its own shard [out/tp, in] or [out, in/tp]."""
    layer.async_tp = mode.async_tp if layer.sequence_parallel else None
    layer.fp8 = mode.uses_fp8(*layer.weight.shape)
    # the one-row kernel in batch-1 decode graphs (tpframe/kernels/gemv.py); not with an adapter, which it would skip
    layer.fused_decode = mode.fused_kernels and layer.lora_a is None
    if layer.async_tp and layer.comm.size > 1 and layer.weight.device.type != "meta":
        layer.comm.peer_exchange()  # the transport, set up now (a collective every rank reaches: they build alike)


def _modes_repr(layer: nn.Module) -> str:
    return (f", async_tp={layer.async_tp}" if layer.async_tp else "") + (f", fp8={layer.fp8}" if layer.fp8 else "")


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
        mode: LayerMode = DEFAULT_MODE,
        lora_role: str | None = None,
    ):
        """`lora_role`: what the layer is to optim.lora_targets ("qkv", "fc1", ...; tpframe/layers/lora.py)."""
        super().__init__()
        self.comm = comm or default_tp_comm()
        tp, rank = self.comm.size, self.comm.rank
        self.in_features, self.out_features = in_features, out_features
        self.out_per_rank = divide(out_features, tp, "ColumnParallelLinear out_features")
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        if fused_parts is not None:
            if gather_output:
                raise ValueError("ColumnParallelLinear: gather_output=True cannot be combined with fused_parts")
            if sum(size for _, size in fused_parts) != out_features:
                raise ValueError(f"fused_parts {fused_parts} must add up to out_features = {out_features}")
            for name, size in fused_parts:
                divide(size, tp, f"ColumnParallelLinear part {name!r} size")
            fused_parts = tuple(fused_parts)
        parts = fused_parts or (("weight", out_features),)
        device = device or self.comm.device
        init_method = init_method or normal_init()
        w = torch.cat([init_shard((size, in_features), 0, rank, tp, init_method, dtype, device) for _, size in parts])
        self.weight = tag_param(nn.Parameter(w), tp_dim=0, fused_parts=fused_parts)
        if bias:
            b = torch.cat([init_shard((size,), 0, rank, tp, nn.init.zeros_, dtype, device) for _, size in parts])
            self.bias = tag_param(nn.Parameter(b), tp_dim=0, fused_parts=fused_parts)
        else:
            self.register_parameter("bias", None)
        where = dict(in_features=in_features, tp=tp, dtype=dtype, device=device)
        column_adapter(self, mode.lora, lora_role, parts, fused=fused_parts is not None, **where)
        _decide(self, mode)

    def forward(self, x: torch.Tensor, *, entered: bool = False) -> torch.Tensor:
        """`entered=True`: x is already `self.enter(input)` (all-gathered under SP)."""
        _check_last_dim(x, self.in_features, "ColumnParallelLinear", "in_features")
        if self.lora_a is not None:  # the adapter reads the entered input too: no collective of its own
            x = x if entered else self.enter(x)
            y = local_linear(x, self.weight, self.bias, fp8=self.fp8, decode_kernel=False) + column_delta(x, self)
            return gather_from_tp(y, self.comm) if self.gather_output else y
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
            + _modes_repr(self)
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
        mode: LayerMode = DEFAULT_MODE,
        lora_role: str | None = None,
    ):
        """`lora_role`: what the layer is to optim.lora_targets ("proj", "fc2"; tpframe/layers/lora.py)."""
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True needs input_is_parallel=True")
        self.comm = comm or default_tp_comm()
        tp, rank = self.comm.size, self.comm.rank
        self.in_features, self.out_features = in_features, out_features
        self.in_per_rank = divide(in_features, tp, "RowParallelLinear in_features")
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        device = device or self.comm.device
        init_method = init_method or normal_init()
        w = init_shard((out_features, in_features), 1, rank, tp, init_method, dtype, device)
        self.weight = tag_param(nn.Parameter(w), tp_dim=1)
        if bias:
            b = init_shard((out_features,), None, rank, tp, nn.init.zeros_, dtype, device)
            self.bias = tag_param(nn.Parameter(b), tp_dim=None, sequence_parallel=sequence_parallel)
        else:
            self.register_parameter("bias", None)
        where = dict(in_features=in_features, tp=tp, rank=rank, dtype=dtype, device=device)
        row_adapter(self, mode.lora, lora_role, out_features, **where)
        _decide(self, mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        expected = self.in_per_rank if self.input_is_parallel else self.in_features
        _check_last_dim(x, expected, "RowParallelLinear", "in_features/tp" if self.input_is_parallel else "in_features")
        if self.lora_a is not None:  # the adapter's term joins the partial product before the layer's one reduction
            x = x if self.input_is_parallel else scatter_to_tp(x, self.comm)
            y = local_linear(x, self.weight, fp8=self.fp8, decode_kernel=False) + row_delta(x, self)
            sp = self.sequence_parallel
            y = reduce_scatter_to_sp(y, self.comm) if sp else reduce_from_tp(y, self.comm, donate=True)
            return y + self.bias if self.bias is not None else y
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
            + _modes_repr(self)
        )


def fp8_layers(model: nn.Module, recipe: str) -> tuple[int, list[str]]:
    """What the column/row-parallel layers of a model built with `LayerMode(fp8=...)` chose: (how many run float8,
    "name (out x in: why not)" of the others). The vocabulary head and the embedding are other classes and stay in
    the compute dtype."""
    n, skipped = 0, []
    for name, m in model.named_modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            n += bool(m.fp8)
            if not m.fp8:
                local_out, local_in = m.weight.shape
                why = fp8_refusal(local_out, local_in, recipe)
                skipped.append(f"{name} ({local_out}x{local_in}: {why})")
    return n, skipped
