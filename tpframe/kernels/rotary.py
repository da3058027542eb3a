"""Split the fused qkv projection into SDPA's head-major layout and apply rotary positions, in one kernel.

    qkv [s, b, (nq + 2 nkv) * d]  ->  q [b, nq, s, d] (rotated), k [b, nkv, s, d] (rotated), v [b, nkv, s, d]

Rotation (GPT-NeoX rotate-half, tables cos/sin [s, 1, 1, d]): with x = (x1, x2) halves of a head,
    out1 = x1 cos1 - x2 sin1,   out2 = x2 cos2 + x1 sin2
computed in fp32 and rounded once. Eager PyTorch spends about six passes over q and k (halves, negation,
concatenation, two products, a sum) plus the layout copies; this reads qkv once and writes q, k, v once,
and the backward does the inverse rotation into one gradient buffer for qkv.
"""

from __future__ import annotations

import torch

from tpframe.kernels import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _qkv_rotary_fwd(qkv, cos, sin, q, k, v, S, B, NQ: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr,
                        HEADS: tl.constexpr, HALF: tl.constexpr):
        tok = tl.program_id(0)  # = s_i * B + b_i, the row of qkv
        s_i = tok // B
        b_i = tok % B
        h = tl.arange(0, HEADS)[:, None]
        j = tl.arange(0, HALF)[None, :]
        inside = (h < NQ + 2 * NKV) & (j < D // 2)
        row = qkv + tok.to(tl.int64) * ((NQ + 2 * NKV) * D) + h * D + j
        x1 = tl.load(row, mask=inside, other=0.0).to(tl.float32)
        x2 = tl.load(row + D // 2, mask=inside, other=0.0).to(tl.float32)
        t = s_i.to(tl.int64) * D + j
        c1 = tl.load(cos + t, mask=j < D // 2, other=0.0).to(tl.float32)
        c2 = tl.load(cos + t + D // 2, mask=j < D // 2, other=0.0).to(tl.float32)
        s1 = tl.load(sin + t, mask=j < D // 2, other=0.0).to(tl.float32)
        s2 = tl.load(sin + t + D // 2, mask=j < D // 2, other=0.0).to(tl.float32)
        rot = h < NQ + NKV  # q and k heads rotate; v heads are copied
        o1 = tl.where(rot, x1 * c1 - x2 * s1, x1).to(q.dtype.element_ty)
        o2 = tl.where(rot, x2 * c2 + x1 * s2, x2).to(q.dtype.element_ty)
        sb = s_i.to(tl.int64) * D + j
        is_q = inside & (h < NQ)
        dq = q + (b_i.to(tl.int64) * NQ + h) * (S * D) + sb
        tl.store(dq, o1, mask=is_q)
        tl.store(dq + D // 2, o2, mask=is_q)
        is_k = inside & (h >= NQ) & (h < NQ + NKV)
        dk = k + (b_i.to(tl.int64) * NKV + (h - NQ)) * (S * D) + sb
        tl.store(dk, o1, mask=is_k)
        tl.store(dk + D // 2, o2, mask=is_k)
        is_v = inside & (h >= NQ + NKV)
        dv = v + (b_i.to(tl.int64) * NKV + (h - NQ - NKV)) * (S * D) + sb
        tl.store(dv, o1, mask=is_v)
        tl.store(dv + D // 2, o2, mask=is_v)

    @triton.jit
    def _qkv_rotary_bwd(gq, gk, gv, cos, sin, gqkv, S, B, NQ: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr,
                        HEADS: tl.constexpr, HALF: tl.constexpr):
        tok = tl.program_id(0)
        s_i = tok // B
        b_i = tok % B
        h = tl.arange(0, HEADS)[:, None]
        j = tl.arange(0, HALF)[None, :]
        inside = (h < NQ + 2 * NKV) & (j < D // 2)
        sb = s_i.to(tl.int64) * D + j
        is_q = inside & (h < NQ)
        is_k = inside & (h >= NQ) & (h < NQ + NKV)
        is_v = inside & (h >= NQ + NKV)
        pq = gq + (b_i.to(tl.int64) * NQ + h) * (S * D) + sb
        pk = gk + (b_i.to(tl.int64) * NKV + (h - NQ)) * (S * D) + sb
        pv = gv + (b_i.to(tl.int64) * NKV + (h - NQ - NKV)) * (S * D) + sb
        g1 = (tl.load(pq, mask=is_q, other=0.0).to(tl.float32) + tl.load(pk, mask=is_k, other=0.0).to(tl.float32)
              + tl.load(pv, mask=is_v, other=0.0).to(tl.float32))
        g2 = (tl.load(pq + D // 2, mask=is_q, other=0.0).to(tl.float32)
              + tl.load(pk + D // 2, mask=is_k, other=0.0).to(tl.float32)
              + tl.load(pv + D // 2, mask=is_v, other=0.0).to(tl.float32))
        t = s_i.to(tl.int64) * D + j
        c1 = tl.load(cos + t, mask=j < D // 2, other=0.0).to(tl.float32)
        c2 = tl.load(cos + t + D // 2, mask=j < D // 2, other=0.0).to(tl.float32)
        s1 = tl.load(sin + t, mask=j < D // 2, other=0.0).to(tl.float32)
        s2 = tl.load(sin + t + D // 2, mask=j < D // 2, other=0.0).to(tl.float32)
        rot = h < NQ + NKV
        d1 = tl.where(rot, g1 * c1 + g2 * s2, g1).to(gqkv.dtype.element_ty)
        d2 = tl.where(rot, g2 * c2 - g1 * s1, g2).to(gqkv.dtype.element_ty)
        row = gqkv + tok.to(tl.int64) * ((NQ + 2 * NKV) * D) + h * D + j
        tl.store(row, d1, mask=inside)
        tl.store(row + D // 2, d2, mask=inside)


def _launch_meta(nq: int, nkv: int, d: int) -> dict:
    heads, half = triton.next_power_of_2(nq + 2 * nkv), triton.next_power_of_2(d // 2)
    return dict(NQ=nq, NKV=nkv, D=d, HEADS=heads, HALF=half, num_warps=8 if heads * half >= 4096 else 4)


class _QKVRotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin, nq, nkv, d):
        s, b = qkv.shape[:2]
        qkv = qkv.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        q = qkv.new_empty((b, nq, s, d))
        k, v = qkv.new_empty((b, nkv, s, d)), qkv.new_empty((b, nkv, s, d))
        _qkv_rotary_fwd[(s * b,)](qkv, cos, sin, q, k, v, s, b, **_launch_meta(nq, nkv, d))
        ctx.save_for_backward(cos, sin)
        ctx.dims, ctx.dtype = (s, b, nq, nkv, d), qkv.dtype
        return q, k, v

    @staticmethod
    def backward(ctx, gq, gk, gv):
        cos, sin = ctx.saved_tensors
        s, b, nq, nkv, d = ctx.dims
        grads = []
        for g, n in ((gq, nq), (gk, nkv), (gv, nkv)):
            grads.append(torch.zeros((b, n, s, d), dtype=ctx.dtype, device=cos.device) if g is None else g.contiguous())
        gqkv = grads[0].new_empty((s, b, (nq + 2 * nkv) * d))
        _qkv_rotary_bwd[(s * b,)](*grads, cos, sin, gqkv, s, b, **_launch_meta(nq, nkv, d))
        return gqkv, None, None, None, None, None


def qkv_rotary(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, nq: int, nkv: int, d: int):
    """The Triton path: (q, k, v), each contiguous [b, n, s, d]; cos/sin [s, 1, 1, d] (or [s, d])."""
    if not HAVE_TRITON:
        raise RuntimeError("qkv_rotary needs Triton")
    if qkv.shape[-1] != (nq + 2 * nkv) * d or d % 2 or cos.numel() != qkv.shape[0] * d:
        raise ValueError(f"qkv_rotary: qkv {tuple(qkv.shape)} / cos {tuple(cos.shape)} do not match "
                         f"nq={nq}, nkv={nkv}, d={d}")
    return _QKVRotary.apply(qkv, cos, sin, nq, nkv, d)
