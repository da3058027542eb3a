"""LayerNorm and RMSNorm whose weights are replicated across TP.

Under sequence parallelism each TP rank normalizes only its [s/tp, b, h] slice, so its weight
gradient is partial: the parameters are tagged `sequence_parallel` and the trainer all-reduces
their gradients over TP (see tpframe.optim.grad_buffer).
"""

from __future__ import annotations

import torch
from torch import nn

from tpframe.kernels.norm import norm
from tpframe.layers.mode import DEFAULT_MODE, LayerMode
from tpframe.layers.utils import tag_param


class _Norm(nn.Module):
    """LayerNorm's and RMSNorm's weight (and LayerNorm's optional bias), replicated over TP, and their forward."""

    rms = False

    def __init__(
        self,
        hidden: int,
        eps: float = 1e-5,
        *,
        bias: bool = True,
        sequence_parallel: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        mode: LayerMode = DEFAULT_MODE,
    ):
        super().__init__()
        self.hidden, self.eps = hidden, eps
        tags = dict(tp_dim=None, sequence_parallel=sequence_parallel)
        self.weight = tag_param(nn.Parameter(torch.ones(hidden, dtype=dtype, device=device)), **tags)
        if bias:
            self.bias = tag_param(nn.Parameter(torch.zeros(hidden, dtype=dtype, device=device)), **tags)
        else:
            self.register_parameter("bias", None)
        self.fused = mode.fused_kernels  # the Triton kernel on CUDA (tpframe/kernels/norm.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return norm(x, self.weight, self.bias, self.eps, rms=self.rms, fused=self.fused)


class LayerNorm(_Norm):
    """y = (x - mean(x)) / sqrt(var(x) + eps) * weight (+ bias), over the last dimension."""


class RMSNorm(_Norm):
    """y = x / sqrt(mean(x^2) + eps) * weight, over the last dimension; no bias."""

    rms = True

    def __init__(self, hidden: int, eps: float = 1e-5, **kwargs):
        """`kwargs`: sequence_parallel, dtype, device, mode (as LayerNorm's)."""
        super().__init__(hidden, eps, bias=False, **kwargs)


def build_norm(kind: str, hidden: int, eps: float = 1e-5, *, bias: bool = True, **kwargs) -> nn.Module:
    """'layernorm' or 'rmsnorm' (RMSNorm has no bias); `kwargs`: sequence_parallel, dtype, device, mode."""
    if kind == "layernorm":
        return LayerNorm(hidden, eps, bias=bias, **kwargs)
    if kind == "rmsnorm":
        return RMSNorm(hidden, eps, **kwargs)
    raise ValueError(f"norm must be 'layernorm' or 'rmsnorm', got {kind!r}")
