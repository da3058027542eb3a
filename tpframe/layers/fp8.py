"""Float8 GEMMs for linear layers, two recipes of dynamic scaling (each scale from its own block's absolute maximum
just before the cast: no history, no amax all-reduce) in one autograd Function:

    y = fp8_linear(x, weight, bias, recipe="rowwise")   # x [..., in] bf16, weight [out, in] bf16 -> [..., out] bf16

    tensorwise  one scale per tensor (torchao's "tensorwise", Transformer Engine's HYBRID): x and w in e4m3, the
                output gradient in e5m2; backward keeps the float8 copies of x and w (their scales transpose)
    rowwise     one scale per row along each GEMM's contraction dim, powers of two, e4m3 everywhere (torchao's
                "rowwise"); backward keeps x and w in bf16 and scales them again along the other dim (on GPUs by
                tpframe/kernels/cast_transpose.py: 1.02x the step of Inductor's code for it)

Every GEMM is a @ b^T with a [M, K] and b [N, K] both scaled along K, fp32 accumulation, bf16 out:
    forward   y  = x w^T          backward  dx = g (w^T)^T          dw = g^T (x^T)^T          db = sum(g)
Both run torch._scaled_mm (CUDA 8.9+; tensorwise also on CPU); where torch has no such kernel (CPU: rowwise) the same
float8 operands are dequantized and multiplied in fp32 (tests). Under TP each rank scales its own shards, so TP sizes
agree to float8 rounding, not bit for bit. Dims: multiples of 16 (train.fp8's validation and `fp8_refusal` see to
that). Under a zero-bubble schedule the weight gradient's GEMM is deferred like the bf16 path's
(parallel/pipeline/weight_grad.py). DeepSeek-V3's blockwise recipe (1x128 tiles, 128x128 weight blocks) was built
and measured slower than bf16 at the 7B-class shape (benchmarks/RESULTS.md, "blockwise dropped"): not offered.
"""

from __future__ import annotations

import functools

import torch

from tpframe.errors import ConfigError
from tpframe.kernels import cast_transpose
from tpframe.layers.async_tp import asked
from tpframe.parallel.pipeline.weight_grad import deferral

RECIPES = ("tensorwise", "rowwise")  # train.fp8's choices (true: "tensorwise")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}
MULTIPLE = 16  # what every float8 GEMM dim must be a multiple of (torch._scaled_mm)


def recipe_of(value) -> str | None:
    """train.fp8 as a recipe name: false -> None, true -> "tensorwise"."""
    return "tensorwise" if value is True else (value or None)


def to_float8(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(t * scale cast to `dtype`, 1 / scale): scale maps t's absolute maximum to the format's largest value.
    Eager torch runs this as four passes over t; inside a compiled block Inductor fuses it with its neighbours,
    which is why train.fp8 asks for train.compile on GPUs."""
    amax = torch.linalg.vector_norm(t, float("inf")).float().clamp(min=1e-12)  # max |t|, one pass
    scale = (_MAX[dtype] / amax).to(t.dtype)  # scaled in t's dtype: bf16's rounding is far finer than float8's
    t8 = (t * scale).clamp_(-_MAX[dtype], _MAX[dtype]).to(dtype)  # clamped: e4m3 has no infinity, only NaN
    return t8, scale.float().reciprocal()


def quantize(t: torch.Tensor, recipe: str, *, dtype=E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """t [rows, K] (any strides) as a row-major float8 [rows, K] scaled along K, and its fp32 inverse scales: [] for
    tensorwise, [rows, 1] rowwise."""
    if recipe == "tensorwise":
        t8, inv = to_float8(t, dtype)
        return t8.contiguous(), inv
    amax = t.abs().amax(dim=-1, keepdim=True).float()
    scale = torch.exp2(torch.floor(torch.log2(_MAX[dtype] / amax.clamp(min=1e-12))))  # a power of two: exact
    t8 = (t * scale.to(t.dtype)).clamp_(-_MAX[dtype], _MAX[dtype]).to(dtype)
    return t8.contiguous(), scale.reciprocal()


def scaled_mm(a, b, recipe: str, *, out_dtype: torch.dtype, bias=None) -> torch.Tensor:
    """a8 b8^T of two `quantize` results a = (a8 [M, K], its scales), b = (b8 [N, K], its scales)."""
    (a8, sa), (b8, sb) = a, b
    if recipe == "tensorwise" or a8.is_cuda:  # (CPU _scaled_mm: tensorwise only in 2.11)
        return torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb.t(), bias=bias, out_dtype=out_dtype)
    y = ((a8.float() * sa) @ (b8.float() * sb).t()).to(out_dtype)  # no such float8 GEMM here (CPU): fp32
    return y if bias is None else y + bias


def _transposed(t: torch.Tensor, q: tuple, recipe: str, *, dtype=E4M3) -> tuple:
    """The operand for t^T from t and its quantized form q: tensorwise scales transpose with it; rows run along the
    other dim, so t^T is scaled afresh from t (bf16)."""
    if recipe == "tensorwise":
        return q[0].t().contiguous(), q[1].t()
    if dtype == E4M3 and cast_transpose.usable(t):  # the same bytes in two passes (tpframe/kernels/cast_transpose.py)
        return torch.ops.tpframe.cast_transpose(t)
    return quantize(t.t(), recipe, dtype=dtype)


def _weight_grad(g2, g8, x_kept, x_inv, recipe: str) -> torch.Tensor:
    """dw = g^T x: g [T, out] (bf16, with its tensorwise float8 copy g8), x kept by forward (float8 or bf16)."""
    gt = _transposed(g2, g8, recipe, dtype=g8[0].dtype)
    xt = _transposed(x_kept, (x_kept, x_inv), recipe)
    return scaled_mm(gt, xt, recipe, out_dtype=g2.dtype)


class _Float8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe, deferred):
        x2 = x.reshape(-1, x.shape[-1])
        xq, wq = quantize(x2, recipe), quantize(weight, recipe)
        y = scaled_mm(xq, wq, recipe, out_dtype=x.dtype, bias=bias)
        # tensorwise keeps x's and w's float8 copies; rowwise x and w (bf16: rescaled along the other dim, and with
        # selective recompute x is the norm output it refills)
        x_kept, w_kept = (xq[0], wq[0]) if recipe == "tensorwise" else (x2, weight)
        ctx.save_for_backward(x_kept, xq[1], w_kept, wq[1])
        ctx.has_bias, ctx.x_shape, ctx.recipe, ctx.deferred = bias is not None, x.shape, recipe, deferred
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x_kept, x_inv, w_kept, w_inv = ctx.saved_tensors
        recipe, g2 = ctx.recipe, grad.reshape(-1, grad.shape[-1])
        g8 = quantize(g2, recipe, dtype=E5M2 if recipe == "tensorwise" else E4M3)
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            wt = _transposed(w_kept, (w_kept, w_inv), recipe)
            gx = scaled_mm(g8, wt, recipe, out_dtype=grad.dtype).view(ctx.x_shape)
        dw = functools.partial(_weight_grad, g2, g8, x_kept, x_inv, recipe)
        if ctx.deferred is not None:
            ctx.deferred.defer(dw)  # a zero-bubble schedule's W step computes it
        elif ctx.needs_input_grad[1]:
            gw = dw()
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0)
        return gx, gw, gb, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias=None, *, recipe: str = "tensorwise") -> torch.Tensor:
    """x W^T + b with the three GEMMs in float8 (see the module docstring); under a zero-bubble schedule's
    capture the weight gradient is deferred (the weight enters detached, as in weight_grad.linear)."""
    deferred = deferral(weight)
    return _Float8Linear.apply(x, weight if deferred is None else weight.detach(), bias, recipe, deferred)


def fp8_pays(local_out: int, local_in: int, recipe: str) -> bool:
    """Whether a GEMM of this per-rank weight shape [out, in] gains from float8 enough to pay for its casts.
    tensorwise: not when in <= 4096 and out <= 1024 (torchao's auto-filter, from its H100 tables); the 7B-class TP=4
    rank's attention projection [4096, 1024] gained converted. rowwise: not when out <= 4096 and in <= 1024; that
    projection lost converted, and torchao's stricter rowwise filter (also out <= 2048, or out <= 4096 with
    in <= 2048) slowed GPT-1.3B by keeping its [2048, 2048] and [2048, 8192] in bf16 (benchmarks/RESULTS.md,
    "Where a float8 step's time goes" and "float8 beside torchao's")."""
    if recipe == "tensorwise":
        return not (local_in <= 4096 and local_out <= 1024)
    return not (local_out <= 4096 and local_in <= 1024)


def fp8_refusal(local_out: int, local_in: int, recipe: str) -> str | None:
    """Why a linear layer with this per-rank weight [out, in] keeps its GEMMs in the compute dtype under train.fp8
    with `recipe` (dims a float8 GEMM cannot take, or too small to gain), or None."""
    if local_in % MULTIPLE or local_out % MULTIPLE:
        return f"not multiples of {MULTIPLE}"
    if not fp8_pays(local_out, local_in, recipe):
        return "too small to gain"
    return None


def check_fp8(cfg, widths) -> None:
    """train.fp8 (`cfg`: the run's Config): bf16 activations, the plain GEMM path, every GEMM dim (tokens per
    micro-batch included: the weight gradient's contraction) a multiple of 16.
    `widths`: (what, width) of each model dimension the GEMMs split over TP (tpframe.models.config.gemm_widths)."""
    p, t, recipe = cfg.parallel, cfg.train, recipe_of(cfg.train.fp8)
    if t.dtype != "bfloat16":
        raise ConfigError(
            f"train.fp8 computes in float8 with bf16 inputs and outputs; set train.dtype=bfloat16 (got {t.dtype})"
        )
    if asked(p.async_tp):
        raise ConfigError(
            "train.fp8 and parallel.async_tp cannot be combined (the overlapped GEMMs are bf16); turn one off"
        )
    tokens, m = t.micro_batch_size * t.seq_len // p.cp, MULTIPLE
    if tokens % m:
        raise ConfigError(
            f"train.fp8={recipe} needs train.micro_batch_size*train.seq_len/parallel.cp = {tokens} to be a multiple "
            f"of {m} (float8 GEMM dims)"
        )
    for key, value in widths:
        if value % (m * p.tp):
            raise ConfigError(
                f"train.fp8={recipe} needs {key} = {value} divisible by {m}*parallel.tp = {m * p.tp} "
                f"(each rank's float8 GEMM dims are multiples of {m})"
            )
