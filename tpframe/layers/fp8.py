"""Float8 GEMMs for linear layers, three recipes of dynamic scaling (each scale from its own block's absolute maximum
just before the cast: no history, no amax all-reduce) in one autograd Function:

    y = fp8_linear(x, weight, bias, recipe="rowwise")   # x [..., in] bf16, weight [out, in] bf16 -> [..., out] bf16

    tensorwise  one scale per tensor (torchao's "tensorwise", Transformer Engine's HYBRID): x and w in e4m3, the
                output gradient in e5m2; backward keeps the float8 copies of x and w (their scales transpose)
    rowwise     one scale per row along each GEMM's contraction dim, powers of two, e4m3 everywhere (torchao's
                "rowwise"); backward keeps x and w in bf16 and scales them again along the other dim
    blockwise   DeepSeek-V3's: 1x128 tiles along the contraction dim for activations and gradients, 128x128 blocks for
                weights, powers of two, e4m3 everywhere; backward keeps x in bf16 and the weight's float8 blocks

Every GEMM is a @ b^T with a [M, K] and b [N, K] both scaled along K, fp32 accumulation, bf16 out:
    forward   y  = x w^T          backward  dx = g (w^T)^T          dw = g^T (x^T)^T          db = sum(g)
tensorwise and rowwise run torch._scaled_mm (CUDA 8.9+; tensorwise also on CPU); blockwise runs F.scaled_mm's
BlockWise1x128 and BlockWise128x128 kernels on CUDA (Hopper); where torch has no such kernel (CPU: rowwise and
blockwise) the same float8 operands are dequantized and multiplied in fp32 (tests). Under TP each rank scales its own
shards, so TP sizes agree to float8 rounding, not bit for bit. Dims: multiples of 16, of 128 for blockwise (train.fp8's
validation and `fp8_refusal` see to that). Under a zero-bubble schedule the weight gradient's GEMM is deferred like the
bf16 path's (parallel/pipeline/weight_grad.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from tpframe.errors import ConfigError
from tpframe.layers.async_tp import asked
from tpframe.parallel.pipeline.weight_grad import deferral

RECIPES = ("tensorwise", "rowwise", "blockwise")  # train.fp8's choices (true: "tensorwise")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}
BLOCK = 128  # blockwise's tile and block side


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


def quantize(t: torch.Tensor, recipe: str, *, dtype=E4M3, weight: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """t [rows, K] (any strides) as a row-major float8 [rows, K] scaled along K, and its fp32 inverse scales: [] for
    tensorwise, [rows, 1] rowwise, [rows, K/128] blockwise 1x128 tiles, [rows/128, K/128] with `weight` (blocks)."""
    if recipe == "tensorwise":
        t8, inv = to_float8(t, dtype)
        return t8.contiguous(), inv
    rows, k = t.shape
    if recipe == "rowwise":
        tiles = t.unsqueeze(1)  # [rows, 1, K]
    elif weight:
        tiles = t.reshape(rows // BLOCK, BLOCK, k // BLOCK, BLOCK).transpose(1, 2)  # [rows/128, K/128, 128, 128]
    else:
        tiles = t.reshape(rows, k // BLOCK, BLOCK)
    amax = tiles.abs().amax(dim=(-2, -1) if weight and recipe == "blockwise" else -1, keepdim=True).float()
    scale = torch.exp2(torch.floor(torch.log2(_MAX[dtype] / amax.clamp(min=1e-12))))  # a power of two: exact
    t8 = (tiles * scale.to(t.dtype)).clamp_(-_MAX[dtype], _MAX[dtype]).to(dtype)
    t8 = t8.transpose(1, 2) if weight and recipe == "blockwise" else t8
    inv = scale.reciprocal().reshape(tiles.shape[:2] if recipe == "blockwise" else (rows, 1))
    return t8.reshape(rows, k).contiguous(), inv


def dequantize(t8: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """A float8 operand of `quantize` back in fp32 (each scale spread over its row, tile or block)."""
    if inv.dim() == 2:
        inv = inv.repeat_interleave(t8.shape[1] // inv.shape[1], 1).repeat_interleave(t8.shape[0] // inv.shape[0], 0)
    return t8.float() * inv


def scaled_mm(a, b, recipe: str, *, out_dtype: torch.dtype, bias=None, b_blocks: bool = False) -> torch.Tensor:
    """a8 b8^T of two `quantize` results a = (a8 [M, K], its scales), b = (b8 [N, K], its scales); `b_blocks`: b has
    128x128 blocks (the weight under blockwise)."""
    (a8, sa), (b8, sb) = a, b
    if recipe == "tensorwise" or (recipe == "rowwise" and a8.is_cuda):  # (CPU _scaled_mm: tensorwise only in 2.11)
        return torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb.t(), bias=bias, out_dtype=out_dtype)
    if recipe == "blockwise" and a8.is_cuda:
        y = blockwise_mm(a8, b8, sa, sb, b_blocks, out_dtype)
    else:  # no such float8 GEMM in torch here (CPU): the same operands in fp32
        y = (dequantize(a8, sa) @ dequantize(b8, sb).t()).to(out_dtype)
    return y if bias is None else y + bias


@torch.library.custom_op("tpframe::blockwise_mm", mutates_args=())
def blockwise_mm(
    a8: torch.Tensor, b8: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, b_blocks: bool, out_dtype: torch.dtype
) -> torch.Tensor:
    """a8 [M, K] 1x128 tiles (sa [M, K/128]) times b8^T, b8 [N, K] in 1x128 tiles or 128x128 blocks (`b_blocks`, sb
    [N/128, K/128]), by F.scaled_mm on CUDA (a custom op: torch 2.11's Dynamo cannot trace F.scaled_mm). The layouts
    F.scaled_mm checks are made here: scales column-major (outer dim fastest), a 128x128 operand's K/128 padded to a
    multiple of 4."""
    sa = sa.t().contiguous().t()
    sb = F.pad(sb, (0, -sb.shape[1] % 4)).contiguous().t() if b_blocks else sb.t().contiguous().t()
    kind_b = F.ScalingType.BlockWise128x128 if b_blocks else F.ScalingType.BlockWise1x128
    one = F.ScalingType.BlockWise1x128
    return F.scaled_mm(a8.contiguous(), b8.contiguous().t(), sa, one, sb, kind_b, output_dtype=out_dtype)


@blockwise_mm.register_fake
def _(a8, b8, sa, sb, b_blocks, out_dtype):
    return a8.new_empty(a8.shape[0], b8.shape[0], dtype=out_dtype)


def _transposed(t: torch.Tensor, q: tuple, recipe: str, *, dtype=E4M3, weight: bool = False) -> tuple:
    """The operand for t^T from t and its quantized form q: tensorwise scales and 128x128 blocks transpose with it;
    rows and 1x128 tiles run along the other dim, so t^T is scaled afresh from t (bf16)."""
    if recipe == "tensorwise" or (recipe == "blockwise" and weight):
        return q[0].t().contiguous(), q[1].t()
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
        xq, wq = quantize(x2, recipe), quantize(weight, recipe, weight=True)
        y = scaled_mm(xq, wq, recipe, out_dtype=x.dtype, bias=bias, b_blocks=True)
        # tensorwise keeps x's and w's float8 copies; rowwise x and w (bf16: rescaled along the other dim, and with
        # selective recompute x is the norm output it refills); blockwise x and the weight's blocks
        x_kept = xq[0] if recipe == "tensorwise" else x2
        w_kept = weight if recipe == "rowwise" else wq[0]
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
            wt = _transposed(w_kept, (w_kept, w_inv), recipe, weight=True)
            gx = scaled_mm(g8, wt, recipe, out_dtype=grad.dtype, b_blocks=True).view(ctx.x_shape)
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


def fp8_pays(local_out: int, local_in: int) -> bool:
    """Whether a GEMM of this per-rank weight shape [out, in] gains from float8 enough to pay for its casts: not
    when out <= 4096 and in <= 1024 (the threshold torchao's auto-filter for tensorwise scaling takes from its H100
    measurements; GPT-125M's blocks, all of whose layers but fc2 fall under it, ran slower in float8:
    benchmarks/RESULTS.md, 'Float8 GEMMs (train.fp8)')."""
    return not (local_out <= 4096 and local_in <= 1024)


def multiple(recipe: str) -> int:
    """What every float8 GEMM dim must be a multiple of under `recipe` (blockwise: its 128-wide tiles)."""
    return BLOCK if recipe == "blockwise" else 16


def fp8_refusal(local_out: int, local_in: int, recipe: str = "tensorwise", *, small_layers: bool = False) -> str | None:
    """Why a linear layer with this per-rank weight [out, in] keeps its GEMMs in the compute dtype under train.fp8
    (dims the recipe's float8 GEMM cannot take; unless `small_layers`, too small to gain), or None."""
    if local_in % multiple(recipe) or local_out % multiple(recipe):
        return f"not multiples of {multiple(recipe)}"
    if not small_layers and not fp8_pays(local_out, local_in):
        return "too small to gain"
    return None


def check_fp8(cfg, widths) -> None:
    """train.fp8 (`cfg`: the run's Config): bf16 activations, the plain GEMM path, every GEMM dim a multiple of 16
    (128 for blockwise, whose tiles also run along the tokens in the weight gradient's GEMM).
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
    if recipe == "blockwise" and cfg.model.moe_experts:
        raise ConfigError(
            "train.fp8=blockwise tiles each expert's tokens by 128, which routing does not keep; use rowwise"
        )
    tokens, m = t.micro_batch_size * t.seq_len // p.cp, multiple(recipe)
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
