"""LayerNorm and RMSNorm over the last dimension, forward and backward, with the weight (and bias) gradients
summed in the same pass as the input gradient.

    y = (x - mean) * rstd * w + b      (RMSNorm: mean = 0, no b; rstd = 1 / sqrt(mean(x^2) + eps))

Eager torch runs the backward as two kernels, the input gradient and a weight/bias reduction
(`GammaBetaBackward`) that re-reads x and dy: together several times the backward's memory traffic
(benchmarks/RESULTS.md, 'Numbers moved out of code comments'). Here one program per row computes the forward
(statistics in fp32); in the backward each of a few hundred programs walks a stride of rows, writes dx, and keeps
running fp32 sums of dy * xhat and dy for its rows, and a tiny torch sum over the programs finishes the weight and
bias gradients.
Plain-torch twin: F.layer_norm / F.rms_norm (the CPU path, compiled blocks, and the tests' oracle).
"""

from __future__ import annotations

import torch

from tpframe.kernels import HAVE_TRITON, use_triton

MAX_HIDDEN = 16384  # one row in registers
BWD_PROGRAMS = 528  # programs of the backward (4 per SM of an H100/H200); each walks rows with this stride
# Below this many input elements eager calls take torch's ops: the GPU time the kernel saves shrinks with the size,
# while its Python side (the autograd Function, the Triton launches, the partial sums) costs more host time than
# torch's, and with few tokens per step the host is what paces the step (GPT-1.3B at micro-batch 1 ran slower with
# the kernel than without: benchmarks/RESULTS.md, 'The kernel norms at small sizes: where their host cost paced the
# step, and a size policy'). Inside a CUDA graph the host cost is gone and the kernel always runs.
FUSED_MIN_NUMEL = 8 << 20

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _norm_fwd(
        x, w, b, y, mean_out, rstd_out, H, eps, RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < H
        xv = tl.load(x + row * H + cols, mask=inside, other=0.0).to(tl.float32)
        if RMS:
            mean = 0.0
        else:
            mean = tl.sum(xv, axis=0) / H
        xc = tl.where(inside, xv - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / H + eps)
        out = xc * rstd * tl.load(w + cols, mask=inside, other=0.0).to(tl.float32)
        if HAS_BIAS:
            out += tl.load(b + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(y + row * H + cols, out.to(y.dtype.element_ty), mask=inside)
        tl.store(mean_out + row, mean)
        tl.store(rstd_out + row, rstd)

    @triton.jit
    def _norm_bwd(
        x,
        w,
        dy,
        dx,
        mean_in,
        rstd_in,
        dw_part,
        db_part,
        R,
        H,
        RMS: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        inside = cols < H
        wv = tl.load(w + cols, mask=inside, other=0.0).to(tl.float32)
        dw_acc = tl.zeros((BLOCK,), tl.float32)
        db_acc = tl.zeros((BLOCK,), tl.float32)
        for r in range(pid, R, tl.num_programs(0)):
            off = tl.cast(r, tl.int64) * H + cols
            xv = tl.load(x + off, mask=inside, other=0.0).to(tl.float32)
            g = tl.load(dy + off, mask=inside, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_in + r)
            xhat = tl.where(inside, (xv - tl.load(mean_in + r)) * rstd, 0.0)
            wg = g * wv
            c1 = tl.sum(xhat * wg, axis=0) / H
            if RMS:
                grad = (wg - xhat * c1) * rstd
            else:
                grad = (wg - xhat * c1 - tl.sum(wg, axis=0) / H) * rstd
            tl.store(dx + off, grad.to(dx.dtype.element_ty), mask=inside)
            dw_acc += g * xhat
            if HAS_BIAS:
                db_acc += g
        tl.store(dw_part + pid * H + cols, dw_acc, mask=inside)
        if HAS_BIAS:
            tl.store(db_part + pid * H + cols, db_acc, mask=inside)


def _warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, rms: bool):
        h = x.shape[-1]
        x2 = x.reshape(-1, h)
        rows = x2.shape[0]
        y = torch.empty_like(x2)
        mean = torch.empty(rows, dtype=torch.float32, device=x.device)
        rstd = torch.empty_like(mean)
        block = triton.next_power_of_2(h)
        _norm_fwd[(rows,)](
            x2,
            weight,
            bias if bias is not None else weight,
            y,
            mean,
            rstd,
            h,
            eps,
            RMS=rms,
            HAS_BIAS=bias is not None,
            BLOCK=block,
            num_warps=_warps(block),
        )
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.rms, ctx.has_bias, ctx.shape = rms, bias is not None, x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, mean, rstd = ctx.saved_tensors
        rows, h = x2.shape
        dy2 = dy.reshape(rows, h).contiguous()
        dx = torch.empty_like(x2)
        programs = max(1, min(BWD_PROGRAMS, rows))
        dw_part = torch.empty(programs, h, dtype=torch.float32, device=x2.device)
        db_part = torch.empty_like(dw_part) if ctx.has_bias else dw_part
        block = triton.next_power_of_2(h)
        _norm_bwd[(programs,)](
            x2,
            weight,
            dy2,
            dx,
            mean,
            rstd,
            dw_part,
            db_part,
            rows,
            h,
            RMS=ctx.rms,
            HAS_BIAS=ctx.has_bias,
            BLOCK=block,
            num_warps=_warps(block),
        )
        dw = dw_part.sum(0).to(weight.dtype)
        db = db_part.sum(0).to(weight.dtype) if ctx.has_bias else None
        return dx.view(ctx.shape), dw, db, None, None


def fused_norm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `norm` runs the kernel on these tensors (else torch's own ops): CUDA, Triton, not under compile
    tracing, a contiguous input no wider than MAX_HIDDEN, weight of the input's dtype."""
    return (
        use_triton(x) and x.is_contiguous() and x.shape[-1] <= MAX_HIDDEN and weight.dtype == x.dtype and x.numel() > 0
    )


def norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, *, rms: bool, fused: bool = True
) -> torch.Tensor:
    """LayerNorm (`rms=False`, optional bias) or RMSNorm (`rms=True`, no bias) of `x` over its last dimension;
    `fused=False` always takes torch's ops, and so do eager calls on fewer than FUSED_MIN_NUMEL elements."""
    if rms and bias is not None:
        raise ValueError("RMSNorm has no bias")
    if (
        fused
        and fused_norm_applies(x, weight)
        and (x.numel() >= FUSED_MIN_NUMEL or torch.cuda.is_current_stream_capturing())
    ):
        return _Norm.apply(x, weight, bias, eps, rms)
    if rms:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)
