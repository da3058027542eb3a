"""Float8 GEMMs for linear layers: tensorwise dynamic scaling, the recipe of torchao's float8 training
(`Float8LinearConfig` "tensorwise") and Transformer Engine's HYBRID format, in one autograd Function.

    y = fp8_linear(x, weight, bias)    # x [..., in] bf16, weight [out, in] bf16 -> y [..., out] bf16

Each GEMM operand is cast to float8 with one scale per tensor, computed from its own absolute maximum just
before the cast (no history, no amax all-reduce): activations and weights in e4m3 (more mantissa), output
gradients in e5m2 (more range). The three GEMMs run in torch._scaled_mm with fp32 accumulation and bf16 out:
    forward   y  = (x8 @ w8^T) / (sx * sw) + b
    backward  dx = (g8 @ w8)   / (sg * sw)        dw = (g8^T @ x8) / (sg * sx)        db = sum(g)
The float8 copies of x and w are what backward keeps (half the bytes of bf16). Under TP each rank scales
its own shards, so TP sizes agree to float8 rounding, not bit for bit. _scaled_mm wants its second operand
column-major and every dim a multiple of 16 (train.fp8's validation and `fp8_refusal` see to that).
On CUDA it needs compute capability 8.9+ (Ada, Hopper); CPU builds of torch run it too (slowly: tests).
"""

from __future__ import annotations

import torch

from tpframe.errors import ConfigError
from tpframe.layers.async_tp import asked

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}


def to_float8(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(t * scale cast to `dtype`, 1 / scale): scale maps t's absolute maximum to the format's largest value.
    Eager torch runs this as four passes over t; inside a compiled block Inductor fuses it with its neighbours,
    which is why train.fp8 asks for train.compile on GPUs."""
    amax = torch.linalg.vector_norm(t, float("inf")).float().clamp(min=1e-12)  # max |t|, one pass
    scale = (_MAX[dtype] / amax).to(t.dtype)  # scaled in t's dtype: bf16's rounding is far finer than float8's
    t8 = (t * scale).clamp_(-_MAX[dtype], _MAX[dtype]).to(dtype)  # clamped: e4m3 has no infinity, only NaN
    return t8, scale.float().reciprocal()


def _column_major(t8: torch.Tensor) -> torch.Tensor:
    """The same matrix laid out column-major (what _scaled_mm takes as its second operand)."""
    return t8.t().contiguous().t()


class _Float8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        x2 = x.reshape(-1, x.shape[-1])
        x8, x_inv = to_float8(x2, E4M3)
        w8, w_inv = to_float8(weight, E4M3)
        y = torch._scaled_mm(x8, w8.t(), scale_a=x_inv, scale_b=w_inv, bias=bias, out_dtype=x.dtype)
        ctx.save_for_backward(x8, x_inv, w8, w_inv)
        ctx.has_bias, ctx.x_shape = bias is not None, x.shape
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x8, x_inv, w8, w_inv = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        g8, g_inv = to_float8(g2, E5M2)
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = torch._scaled_mm(g8, _column_major(w8), scale_a=g_inv, scale_b=w_inv, out_dtype=grad.dtype)
            gx = gx.view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            gw = torch._scaled_mm(
                g8.t().contiguous(), _column_major(x8), scale_a=g_inv, scale_b=x_inv, out_dtype=grad.dtype
            )
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0)
        return gx, gw, gb


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b with the three GEMMs in float8 (see the module docstring)."""
    return _Float8Linear.apply(x, weight, bias)


def fp8_pays(local_out: int, local_in: int) -> bool:
    """Whether a GEMM of this per-rank weight shape [out, in] gains from float8 enough to pay for its casts: not
    when out <= 4096 and in <= 1024 (the threshold torchao's auto-filter for tensorwise scaling takes from its H100
    measurements; GPT-125M's blocks, all of whose layers but fc2 fall under it, ran slower in float8:
    benchmarks/RESULTS.md, 'Float8 GEMMs (train.fp8)')."""
    return not (local_out <= 4096 and local_in <= 1024)


def fp8_refusal(local_out: int, local_in: int, *, small_layers: bool = False) -> str | None:
    """Why a linear layer with this per-rank weight [out, in] keeps its GEMMs in the compute dtype under train.fp8
    (dims the float8 GEMM cannot take; unless `small_layers`, too small to gain), or None."""
    if local_in % 16 or local_out % 16:
        return "not multiples of 16"
    if not small_layers and not fp8_pays(local_out, local_in):
        return "too small to gain"
    return None


def check_fp8(cfg, widths) -> None:
    """train.fp8 (`cfg`: the run's Config): bf16 activations, the plain GEMM path, every GEMM dim a multiple of 16.
    `widths`: (what, width) of each model dimension the GEMMs split over TP (tpframe.models.config.gemm_widths)."""
    p, t = cfg.parallel, cfg.train
    if t.dtype != "bfloat16":
        raise ConfigError(
            f"train.fp8 computes in float8 with bf16 inputs and outputs; set train.dtype=bfloat16 (got {t.dtype})"
        )
    if asked(p.async_tp):
        raise ConfigError(
            "train.fp8 and parallel.async_tp cannot be combined (the overlapped GEMMs are bf16); turn one off"
        )
    if p.pp > 1 and p.pp_schedule == "zb_h1":
        raise ConfigError(
            "train.fp8 cannot defer weight gradients (parallel.pp_schedule=zb_h1); use 1f1b, afab or interleaved_1f1b"
        )
    tokens = t.micro_batch_size * t.seq_len
    if tokens % 16:
        raise ConfigError(
            f"train.fp8 needs train.micro_batch_size*train.seq_len = {tokens} to be a multiple of 16 (float8 GEMM dims)"
        )
    for key, value in widths:
        if value % (16 * p.tp):
            raise ConfigError(
                f"train.fp8 needs {key} = {value} divisible by 16*parallel.tp = {16 * p.tp} "
                "(each rank's float8 GEMM dims are multiples of 16)"
            )
