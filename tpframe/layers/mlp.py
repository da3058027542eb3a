"""The transformer MLP: column-parallel up-projection, activation, row-parallel down-projection.

Only two collectives per direction: the input enters the TP region (identity, or all-gather of
the sequence under SP) and the output leaves it (all-reduce, or reduce-scatter under SP).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tpframe.comm import Communicator
from tpframe.kernels import gemv
from tpframe.layers.linear import ColumnParallelLinear, RowParallelLinear
from tpframe.layers.mode import DEFAULT_MODE, LayerMode
from tpframe.layers.utils import InitMethod
from tpframe.parallel.recompute import RecomputedOutput

ACTIVATIONS = ("gelu", "swiglu", "relu")


def _swiglu_grad(grad: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """d(silu(gate) * up)/dh for h = [gate | up], with silu(gate) computed again: autograd's own ops."""
    gate, up = h.chunk(2, dim=-1)
    return torch.cat([torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)], dim=-1)


@functools.cache
def _fused_swiglu_grad():
    """_swiglu_grad compiled, its passes fused by Inductor (eager runs on GPUs): eager's five passes over ffn-wide
    tensors made the recompute cost 1.8% of an eager Llama-3-8B LoRA step (benchmarks/RESULTS.md, "SwiGLU keeps its
    input alone")."""
    return torch.compile(_swiglu_grad, dynamic=None)


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up of h = [gate | up], keeping only h for backward and computing silu(gate) again there (as
    Megatron's fused SwiGLU does): autograd's own graph would also keep silu(gate), one more ffn-wide activation per
    layer. The same ops as autograd's, so the same values; eager on a GPU they run compiled."""

    @staticmethod
    def forward(ctx, h: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h)
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (h,) = ctx.saved_tensors
        if h.is_cuda and not torch.compiler.is_compiling():
            return _fused_swiglu_grad()(grad, h)
        return _swiglu_grad(grad, h)


class ParallelMLP(nn.Module):
    """[s, b, h] -> [s, b, h] (or [s/tp, b, h] in and out with sequence parallelism).

    GELU/ReLU: fc1 [ffn/tp, h]. SwiGLU: fc1 fuses the logical `gate` and `up` weights (each a
    row-shard of its own [ffn, h] tensor), out = fc2(silu(gate) * up).
    """

    def __init__(
        self,
        hidden: int,
        ffn_hidden: int,
        *,
        activation: str = "gelu",
        bias: bool = True,
        sequence_parallel: bool = False,
        comm: Communicator | None = None,
        init_method: InitMethod | None = None,
        output_init_method: InitMethod | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        mode: LayerMode = DEFAULT_MODE,
    ):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.activation = activation
        common = dict(bias=bias, sequence_parallel=sequence_parallel, comm=comm, dtype=dtype, device=device, mode=mode)
        if activation == "swiglu":
            self.fc1 = ColumnParallelLinear(
                hidden,
                2 * ffn_hidden,
                init_method=init_method,
                fused_parts=(("gate", ffn_hidden), ("up", ffn_hidden)),
                lora_role="fc1",
                **common,
            )
        else:
            self.fc1 = ColumnParallelLinear(hidden, ffn_hidden, init_method=init_method, lora_role="fc1", **common)
        out_init = output_init_method or init_method
        self.fc2 = RowParallelLinear(ffn_hidden, hidden, init_method=out_init, lora_role="fc2", **common)

    def forward(
        self, x: torch.Tensor, *, entered: bool = False, recompute_activation: bool = False, reduce: bool = True
    ) -> torch.Tensor:
        """`entered=True`: x is already `self.fc1.enter(x)`. `recompute_activation`: the activation's output
        (fc2's saved input, the block's largest activation) is freed after fc2 and recomputed in backward.
        `reduce=False` (bias-free MLPs, with `entered=True`): this rank's partial output, not yet summed over TP."""
        fc2 = self.fc2 if reduce else self.fc2.partial
        fc1 = self.fc1
        if fc1.fused_decode and not (fc1.fp8 or fc1.sequence_parallel) and gemv.takes(x, fc1.weight):
            # a batch-1 decode graph (entering the TP region is the identity here): fc1 and the activation in
            # one kernel (tpframe/kernels/gemv.py)
            return fc2(gemv.row_linear(x, fc1.weight, fc1.bias, activation=self.activation))
        h = fc1(x, entered=entered)
        if not recompute_activation:
            return fc2(self.act(h))
        act = RecomputedOutput(self.act, h)
        y = fc2(act.output)
        act.discard(after=y)
        return y

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """The input's entry into the TP region; forward(enter(x), entered=True) == forward(x)."""
        return self.fc1.enter(x)

    def act(self, h: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            return _SwiGLU.apply(h)
        if self.activation == "gelu":
            return F.gelu(h, approximate="tanh")
        return F.relu(h)
