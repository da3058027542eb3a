"""Split the fused qkv projection into SDPA's head-major layout and apply rotary positions, in one kernel.

    qkv [s, b, (nq + 2 nkv) * d]  ->  q [b, nq, s, d] (rotated), k [b, nkv, s, d] (rotated), v [b, nkv, s, d]

Rotation (GPT-NeoX rotate-half, tables cos/sin [s, 1, 1, d] shared by the batch, or [s, b, 1, d] per row as
generation's left-padded rows need): with x = (x1, x2) halves of a head,
    out1 = x1 cos1 - x2 sin1,   out2 = x2 cos2 + x1 sin2
computed in fp32 and rounded once. Eager PyTorch spends about six passes over q and k (halves, negation,
concatenation, two products, a sum) plus the layout copies; this reads qkv once and writes q, k, v once,
and the backward does the inverse rotation into one gradient buffer for qkv. With Qwen3's query/key RMSNorms
(eager), each q and k head is normalized in the same pass and the backward goes through the norms too, their
weights' gradients summed per token, then over the tokens.
"""

from __future__ import annotations

import torch

from tpframe.kernels import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _head_weights(qw, kw, h, j, NQ: tl.constexpr, D: tl.constexpr):
        """The halves of each head's norm weight, in fp32: q's for the query heads, k's for the others."""
        jm = j < D // 2
        q1 = tl.load(qw + j, mask=jm, other=0.0).to(tl.float32)
        q2 = tl.load(qw + j + D // 2, mask=jm, other=0.0).to(tl.float32)
        k1 = tl.load(kw + j, mask=jm, other=0.0).to(tl.float32)
        k2 = tl.load(kw + j + D // 2, mask=jm, other=0.0).to(tl.float32)
        return tl.where(h < NQ, q1, k1), tl.where(h < NQ, q2, k2)

    @triton.jit
    def _qkv_rotary_fwd(
        qkv,
        cos,
        sin,
        q,
        k,
        v,
        qw,
        kw,
        eps,
        S,
        B,
        CS,
        CB,
        QB,
        QN,
        QS,
        KB,
        KN,
        KS,
        NQ: tl.constexpr,
        NKV: tl.constexpr,
        D: tl.constexpr,
        HEADS: tl.constexpr,
        HALF: tl.constexpr,
        NORM: tl.constexpr,
        WRITE_V: tl.constexpr,
    ):
        tok = tl.program_id(0)  # = s_i * B + b_i, the row of qkv
        s_i = tok // B
        b_i = tok % B
        h = tl.arange(0, HEADS)[:, None]
        j = tl.arange(0, HALF)[None, :]
        inside = (h < NQ + 2 * NKV) & (j < D // 2)
        row = qkv + tok.to(tl.int64) * ((NQ + 2 * NKV) * D) + h * D + j
        x1 = tl.load(row, mask=inside, other=0.0).to(tl.float32)
        x2 = tl.load(row + D // 2, mask=inside, other=0.0).to(tl.float32)
        rot = h < NQ + NKV  # q and k heads rotate; v heads are copied
        if NORM:  # q and k heads first go through their RMSNorms (Qwen3's), in fp32
            rstd = tl.rsqrt(tl.sum(x1 * x1 + x2 * x2, axis=1, keep_dims=True) / D + eps)
            w1, w2 = _head_weights(qw, kw, h, j, NQ, D)
            x1 = tl.where(rot, x1 * rstd * w1, x1)
            x2 = tl.where(rot, x2 * rstd * w2, x2)
        t = s_i.to(tl.int64) * CS + b_i.to(tl.int64) * CB + j  # this token's table row
        c1 = tl.load(cos + t, mask=j < D // 2, other=0.0).to(tl.float32)
        c2 = tl.load(cos + t + D // 2, mask=j < D // 2, other=0.0).to(tl.float32)
        s1 = tl.load(sin + t, mask=j < D // 2, other=0.0).to(tl.float32)
        s2 = tl.load(sin + t + D // 2, mask=j < D // 2, other=0.0).to(tl.float32)
        o1 = tl.where(rot, x1 * c1 - x2 * s1, x1).to(q.dtype.element_ty)
        o2 = tl.where(rot, x2 * c2 + x1 * s2, x2).to(q.dtype.element_ty)
        # element strides of q's and of k's and v's (b, head, s) dims: head-major [b, n, s, d] or token-major
        # [b, s, n, d] memory
        bq, bk = b_i.to(tl.int64) * QB + s_i.to(tl.int64) * QS + j, b_i.to(tl.int64) * KB + s_i.to(tl.int64) * KS + j
        is_q = inside & (h < NQ)
        dq = q + bq + h.to(tl.int64) * QN
        tl.store(dq, o1, mask=is_q)
        tl.store(dq + D // 2, o2, mask=is_q)
        is_k = inside & (h >= NQ) & (h < NQ + NKV)
        dk = k + bk + (h - NQ).to(tl.int64) * KN
        tl.store(dk, o1, mask=is_k)
        tl.store(dk + D // 2, o2, mask=is_k)
        is_v = inside & (h >= NQ + NKV) & WRITE_V  # else v is a view of qkv, written by no one
        dv = v + bk + (h - NQ - NKV).to(tl.int64) * KN
        tl.store(dv, o1, mask=is_v)
        tl.store(dv + D // 2, o2, mask=is_v)

    @triton.jit
    def _qkv_rotary_bwd(
        gq,
        gk,
        gv,
        cos,
        sin,
        gqkv,
        qkv,
        qw,
        kw,
        dw_part,
        eps,
        S,
        B,
        CS,
        CB,
        QB,
        QN,
        QS,
        KB,
        KN,
        KS,
        VB,
        VN,
        VS,
        NQ: tl.constexpr,
        NKV: tl.constexpr,
        D: tl.constexpr,
        HEADS: tl.constexpr,
        HALF: tl.constexpr,
        NORM: tl.constexpr,
    ):
        tok = tl.program_id(0)
        s_i = tok // B
        b_i = tok % B
        h = tl.arange(0, HEADS)[:, None]
        j = tl.arange(0, HALF)[None, :]
        inside = (h < NQ + 2 * NKV) & (j < D // 2)
        b64, s64 = b_i.to(tl.int64), s_i.to(tl.int64)
        is_q = inside & (h < NQ)
        is_k = inside & (h >= NQ) & (h < NQ + NKV)
        is_v = inside & (h >= NQ + NKV)
        pq = gq + b64 * QB + s64 * QS + h.to(tl.int64) * QN + j  # each gradient in its own layout (strides)
        pk = gk + b64 * KB + s64 * KS + (h - NQ).to(tl.int64) * KN + j
        pv = gv + b64 * VB + s64 * VS + (h - NQ - NKV).to(tl.int64) * VN + j
        g1 = (
            tl.load(pq, mask=is_q, other=0.0).to(tl.float32)
            + tl.load(pk, mask=is_k, other=0.0).to(tl.float32)
            + tl.load(pv, mask=is_v, other=0.0).to(tl.float32)
        )
        g2 = (
            tl.load(pq + D // 2, mask=is_q, other=0.0).to(tl.float32)
            + tl.load(pk + D // 2, mask=is_k, other=0.0).to(tl.float32)
            + tl.load(pv + D // 2, mask=is_v, other=0.0).to(tl.float32)
        )
        t = s_i.to(tl.int64) * CS + b_i.to(tl.int64) * CB + j  # this token's table row
        c1 = tl.load(cos + t, mask=j < D // 2, other=0.0).to(tl.float32)
        c2 = tl.load(cos + t + D // 2, mask=j < D // 2, other=0.0).to(tl.float32)
        s1 = tl.load(sin + t, mask=j < D // 2, other=0.0).to(tl.float32)
        s2 = tl.load(sin + t + D // 2, mask=j < D // 2, other=0.0).to(tl.float32)
        rot = h < NQ + NKV
        d1 = tl.where(rot, g1 * c1 + g2 * s2, g1)
        d2 = tl.where(rot, g2 * c2 - g1 * s1, g2)
        if NORM:  # through the norms: y = x * rstd * w, their input recomputed from qkv
            src = qkv + tok.to(tl.int64) * ((NQ + 2 * NKV) * D) + h * D + j
            x1 = tl.load(src, mask=inside & rot, other=0.0).to(tl.float32)
            x2 = tl.load(src + D // 2, mask=inside & rot, other=0.0).to(tl.float32)
            rstd = tl.rsqrt(tl.sum(x1 * x1 + x2 * x2, axis=1, keep_dims=True) / D + eps)
            w1, w2 = _head_weights(qw, kw, h, j, NQ, D)
            n1, n2 = x1 * rstd, x2 * rstd  # the normalized input
            e1, e2 = d1 * w1, d2 * w2  # its gradient
            mean = tl.sum(e1 * n1 + e2 * n2, axis=1, keep_dims=True) / D
            # this token's share of the weights' gradients, dw_part[token] = [q's D, k's D], summed over tokens after
            part = dw_part + tok.to(tl.int64) * (2 * D) + tl.arange(0, HALF)
            jm = tl.arange(0, HALF) < D // 2
            is_qh, is_kh = h < NQ, (h >= NQ) & rot
            tl.store(part, tl.sum(tl.where(is_qh, d1 * n1, 0.0), axis=0), mask=jm)
            tl.store(part + D // 2, tl.sum(tl.where(is_qh, d2 * n2, 0.0), axis=0), mask=jm)
            tl.store(part + D, tl.sum(tl.where(is_kh, d1 * n1, 0.0), axis=0), mask=jm)
            tl.store(part + D + D // 2, tl.sum(tl.where(is_kh, d2 * n2, 0.0), axis=0), mask=jm)
            d1 = tl.where(rot, rstd * (e1 - n1 * mean), d1)
            d2 = tl.where(rot, rstd * (e2 - n2 * mean), d2)
        row = gqkv + tok.to(tl.int64) * ((NQ + 2 * NKV) * D) + h * D + j
        tl.store(row, d1.to(gqkv.dtype.element_ty), mask=inside)
        tl.store(row + D // 2, d2.to(gqkv.dtype.element_ty), mask=inside)


def _launch_meta(nq: int, nkv: int, d: int) -> dict:
    heads, half = triton.next_power_of_2(nq + 2 * nkv), triton.next_power_of_2(d // 2)
    return dict(NQ=nq, NKV=nkv, D=d, HEADS=heads, HALF=half, num_warps=8 if heads * half >= 4096 else 4)


def _table_strides(cos: torch.Tensor, d: int) -> tuple[int, int]:
    """Element strides of a contiguous table's s and b dims: [s, 1, 1, d] (or [s, d]) is shared by the batch
    (b stride 0), [s, b, 1, d] holds a row per sequence."""
    rows = cos.numel() // (cos.shape[0] * d)
    return rows * d, (d if rows > 1 else 0)


def _empty(
    like: torch.Tensor, b: int, n: int, s: int, d: int, token_major: bool, seq_major: bool = False
) -> torch.Tensor:
    """[b, n, s, d]: contiguous, or a view of token-major [b, s, n, d] or of seq-major [s, b, n, d] memory."""
    if token_major:
        return like.new_empty((b, s, n, d)).transpose(1, 2)
    return like.new_empty((s, b, n, d)).permute(1, 2, 0, 3) if seq_major else like.new_empty((b, n, s, d))


def _bns_strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _v_view(qkv: torch.Tensor, nq: int, nkv: int, d: int) -> torch.Tensor:
    """v as [b, nkv, s, d], a view of qkv's memory."""
    s, b = qkv.shape[:2]
    return qkv.view(s, b, nq + 2 * nkv, d)[:, :, nq + nkv :].permute(1, 2, 0, 3)


def _rotary_fwd(
    qkv,
    cos,
    sin,
    nq: int,
    nkv: int,
    d: int,
    token_major: bool = False,
    qw=None,
    kw=None,
    eps: float = 0.0,
    *,
    seq_major: bool = False,
    write_v: bool = True,
):
    """(q, k, v); `seq_major`: in [s, b, n, d] memory (qkv's order); `write_v=False`: v is the view of qkv (with the
    norms, whose backward keeps qkv anyway)."""
    s, b = qkv.shape[:2]
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    q, k = _empty(qkv, b, nq, s, d, token_major, seq_major), _empty(qkv, b, nkv, s, d, token_major, seq_major)
    v = _empty(qkv, b, nkv, s, d, token_major, seq_major) if write_v else _v_view(qkv, nq, nkv, d)
    norm = qw is not None
    _qkv_rotary_fwd[(s * b,)](
        qkv,
        cos,
        sin,
        q,
        k,
        v,
        qw if norm else cos,
        kw if norm else cos,
        eps,
        s,
        b,
        *_table_strides(cos, d),
        *_bns_strides(q),
        *_bns_strides(k),
        NORM=norm,
        WRITE_V=write_v,
        **_launch_meta(nq, nkv, d),
    )
    return q, k, v


def _rotary_bwd(gq, gk, gv, cos, sin, nq: int, nkv: int, d: int, qkv=None, qw=None, kw=None, eps: float = 0.0):
    """The gradient of qkv; with the norms (`qkv` their input, `qw`/`kw` their weights)
    also those of the weights."""
    b, _, s, _ = gq.shape
    gqkv = gq.new_empty((s, b, (nq + 2 * nkv) * d))
    cos, sin = cos.contiguous(), sin.contiguous()
    gq, gk, gv = (g if g.stride(-1) == 1 else g.contiguous() for g in (gq, gk, gv))  # any (b, n, s) strides
    norm = qw is not None
    parts = torch.empty((s * b, 2, d), dtype=torch.float32, device=gq.device) if norm else gqkv
    _qkv_rotary_bwd[(s * b,)](
        gq,
        gk,
        gv,
        cos,
        sin,
        gqkv,
        qkv.contiguous() if norm else gqkv,
        qw if norm else cos,
        kw if norm else cos,
        parts,
        eps,
        s,
        b,
        *_table_strides(cos, d),
        *_bns_strides(gq),
        *_bns_strides(gk),
        *_bns_strides(gv),
        NORM=norm,
        **_launch_meta(nq, nkv, d),
    )
    if not norm:
        return gqkv
    return gqkv, parts[:, 0].sum(0).to(qw.dtype), parts[:, 1].sum(0).to(kw.dtype)  # separate tensors, no views


class _QKVRotary(torch.autograd.Function):
    """The eager path: no op dispatch on the way to the kernels. Its outputs are views of seq-major [s, b, n, d]
    memory (but token-major ones), so SDPA returns its output in that order and attention's [s, b, h] output is a
    view of it, not a copy: 1.5 GiB less held for the backward at GPT-1.3B micro-batch 8, one copy fewer per layer
    (compiled the same, through the op below). With the norms, v is the view of qkv and its gradient comes back here,
    into the same buffer."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, nq, nkv, d, token_major, qw=None, kw=None, eps=0.0):
        ctx.save_for_backward(cos, sin, *((qkv, qw, kw) if qw is not None else ()))
        ctx.dims, ctx.eps = (nq, nkv, d), eps
        return _rotary_fwd(
            qkv, cos, sin, nq, nkv, d, token_major, qw, kw, eps, seq_major=True, write_v=qw is None or token_major
        )

    @staticmethod
    def backward(ctx, gq, gk, gv):  # an output without a gradient arrives as zeros (materialized by autograd)
        cos, sin, *norm = ctx.saved_tensors
        if not norm:
            return _rotary_bwd(gq, gk, gv, cos, sin, *ctx.dims), None, None, None, None, None, None, None, None, None
        gqkv, gqw, gkw = _rotary_bwd(gq, gk, gv, cos, sin, *ctx.dims, *norm, ctx.eps)
        return gqkv, None, None, None, None, None, None, gqw, gkw, None


# Under torch.compile the same kernels run as custom ops: opaque to Inductor, which would otherwise generate the
# split + rotation + layout change itself, with a backward whose transposed stores cost ~10x the kernel's.
# Its outputs are [s, b, n, d] tensors, contiguous (token-major: [b, n, s, d] views of [b, s, n, d] memory), which
# qkv_rotary permutes: Inductor keeps a custom op's contiguous outputs as they are, where it assumed permuted ones
# contiguous against their fake's strides
@torch.library.custom_op("tpframe::qkv_rotary", mutates_args=())
def qkv_rotary_op(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, nq: int, nkv: int, d: int, token_major: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out = _rotary_fwd(qkv, cos, sin, nq, nkv, d, token_major, seq_major=not token_major)
    return out if token_major else tuple(t.permute(2, 0, 1, 3) for t in out)


@qkv_rotary_op.register_fake
def _(qkv, cos, sin, nq, nkv, d, token_major=False):
    s, b = qkv.shape[:2]
    if token_major:
        return tuple(_empty(qkv, b, n, s, d, True) for n in (nq, nkv, nkv))
    return tuple(qkv.new_empty((s, b, n, d)) for n in (nq, nkv, nkv))


@torch.library.custom_op("tpframe::qkv_rotary_backward", mutates_args=())
def qkv_rotary_backward_op(
    gq: torch.Tensor,
    gk: torch.Tensor,
    gv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    nq: int,
    nkv: int,
    d: int,
) -> torch.Tensor:
    return _rotary_bwd(gq, gk, gv, cos, sin, nq, nkv, d)


@qkv_rotary_backward_op.register_fake
def _(gq, gk, gv, cos, sin, nq, nkv, d):
    b, _, s, _ = gq.shape
    return gq.new_empty((s, b, (nq + 2 * nkv) * d))


def _setup_context(ctx, inputs, output):
    _, cos, sin, nq, nkv, d, token_major = inputs
    ctx.save_for_backward(cos, sin)
    ctx.dims, ctx.token_major = (nq, nkv, d), token_major


def _backward(ctx, gq, gk, gv):
    cos, sin = ctx.saved_tensors
    if not ctx.token_major:  # the gradients of [s, b, n, d] outputs: as [b, n, s, d] views for the kernel
        gq, gk, gv = (g.permute(1, 2, 0, 3) for g in (gq, gk, gv))
    return torch.ops.tpframe.qkv_rotary_backward(gq, gk, gv, cos, sin, *ctx.dims), None, None, None, None, None, None


qkv_rotary_op.register_autograd(_backward, setup_context=_setup_context)


def qkv_rotary(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    nq: int,
    nkv: int,
    d: int,
    *,
    token_major: bool = False,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
):
    """The Triton path: (q, k, v), each [b, n, s, d]: a view of seq-major [s, b, n, d] memory, or (`token_major`)
    of [b, s, n, d] memory, which variable-length attention reads as [b*s, n, d] without a copy; cos/sin
    [s, 1, 1, d] (or [s, d]) shared by the batch, or [s, b, 1, d] with a row per sequence. `norm`: (q weight, k weight, eps) of RMSNorms over each
    query and key head before the rotation (Qwen3's), in the same pass (eager only: compiled, Inductor's fusion of
    torch's ops is as fast, 125.8 against 125.4 ms at GPT-1.3B on one H100, and holds 0.7 GiB less)."""
    if not HAVE_TRITON:
        raise RuntimeError("qkv_rotary needs Triton")
    s, b = qkv.shape[:2]
    if (
        qkv.shape[-1] != (nq + 2 * nkv) * d
        or d % 2
        or cos.shape[0] != s
        or cos.shape[-1] != d
        or cos.numel() not in (s * d, s * b * d)
        or sin.shape != cos.shape
        or norm is not None
        and (tuple(norm[0].shape) != (d,) or tuple(norm[1].shape) != (d,))
    ):
        weights = "" if norm is None else f" / norm weights {tuple(norm[0].shape)}, {tuple(norm[1].shape)}"
        raise ValueError(
            f"qkv_rotary: qkv {tuple(qkv.shape)} / cos {tuple(cos.shape)}{weights} do not match "
            f"nq={nq}, nkv={nkv}, d={d}"
        )
    if norm is None:
        if torch.compiler.is_compiling():
            out = torch.ops.tpframe.qkv_rotary(qkv, cos, sin, nq, nkv, d, token_major)
            return out if token_major else tuple(t.permute(1, 2, 0, 3) for t in out)
        return _QKVRotary.apply(qkv, cos, sin, nq, nkv, d, token_major)
    if torch.compiler.is_compiling():  # Inductor fuses the norms and the rotation as fast, holding less memory
        raise RuntimeError("qkv_rotary with norms runs eagerly; under torch.compile split_heads takes torch's ops")
    return _QKVRotary.apply(qkv, cos, sin, nq, nkv, d, token_major, norm[0], norm[1], float(norm[2]))
