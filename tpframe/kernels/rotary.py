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
    def _row(base, tok, h, j, NQ: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr):
        """Each head's first half in row `tok` of qkv (or of its gradient): [s * b, (NQ + 2 NKV) * D] memory."""
        return base + tok.to(tl.int64) * ((NQ + 2 * NKV) * D) + h * D + j

    @triton.jit
    def _head(base, b_i, s_i, n, j, SB, SN, SS):
        """Head `n`'s first half at (b_i, s_i) of a [b, n, s, d] tensor with element strides SB, SN, SS: head-major
        [b, n, s, d] or token-major [b, s, n, d] memory."""
        return base + (b_i * SB + s_i * SS + j) + n.to(tl.int64) * SN

    @triton.jit
    def _load_halves(p, mask, D: tl.constexpr):
        """The two halves of the heads starting at `p`, in fp32."""
        return tl.load(p, mask=mask, other=0.0).to(tl.float32), tl.load(p + D // 2, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _store_halves(p, x1, x2, mask, D: tl.constexpr):
        """Both halves of the heads starting at `p`, in p's dtype."""
        tl.store(p, x1.to(p.dtype.element_ty), mask=mask)
        tl.store(p + D // 2, x2.to(p.dtype.element_ty), mask=mask)

    @triton.jit
    def _rstd(x1, x2, eps, D: tl.constexpr):
        """1 / the root mean square of each head (over both halves), for its RMSNorm."""
        return tl.rsqrt(tl.sum(x1 * x1 + x2 * x2, axis=1, keep_dims=True) / D + eps)

    @triton.jit
    def _rotate(x1, x2, c, s, jm, rot, D: tl.constexpr, INVERSE: tl.constexpr):
        """The rotation of the heads where `rot` (the others pass through), with this token's table rows at c and
        s; `INVERSE`: its transpose, for the backward."""
        c1 = tl.load(c, mask=jm, other=0.0).to(tl.float32)
        c2 = tl.load(c + D // 2, mask=jm, other=0.0).to(tl.float32)
        s1 = tl.load(s, mask=jm, other=0.0).to(tl.float32)
        s2 = tl.load(s + D // 2, mask=jm, other=0.0).to(tl.float32)
        if INVERSE:
            y1, y2 = x1 * c1 + x2 * s2, x2 * c2 - x1 * s1
        else:
            y1, y2 = x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
        return tl.where(rot, y1, x1), tl.where(rot, y2, x2)

    @triton.jit
    def _norms_bwd(d1, d2, x1, x2, qw, kw, part, h, j, rot, eps, NQ: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr):
        """Through the norms y = x * rstd * w of the heads that rotate: the gradient of their input x, from that of
        y (d1, d2). Stores this token's share of the weights' gradients at `part`, [q's D, k's D] (summed over the
        tokens after)."""
        rstd = _rstd(x1, x2, eps, D)
        w1, w2 = _head_weights(qw, kw, h, j, NQ, D)
        n1, n2 = x1 * rstd, x2 * rstd  # the normalized input
        e1, e2 = d1 * w1, d2 * w2  # its gradient
        mean = tl.sum(e1 * n1 + e2 * n2, axis=1, keep_dims=True) / D
        part = part + tl.arange(0, HALF)
        jm = tl.arange(0, HALF) < D // 2
        is_qh, is_kh = h < NQ, (h >= NQ) & rot
        tl.store(part, tl.sum(tl.where(is_qh, d1 * n1, 0.0), axis=0), mask=jm)
        tl.store(part + D // 2, tl.sum(tl.where(is_qh, d2 * n2, 0.0), axis=0), mask=jm)
        tl.store(part + D, tl.sum(tl.where(is_kh, d1 * n1, 0.0), axis=0), mask=jm)
        tl.store(part + D + D // 2, tl.sum(tl.where(is_kh, d2 * n2, 0.0), axis=0), mask=jm)
        return tl.where(rot, rstd * (e1 - n1 * mean), d1), tl.where(rot, rstd * (e2 - n2 * mean), d2)

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
        """One token (a row of qkv) per program. CS, CB: the tables' s and b strides; QB, QN, QS and KB, KN, KS: q's
        and k's (and v's) b, head and s strides."""
        tok = tl.program_id(0)  # = s_i * B + b_i
        s_i, b_i = (tok // B).to(tl.int64), (tok % B).to(tl.int64)
        h = tl.arange(0, HEADS)[:, None]
        j = tl.arange(0, HALF)[None, :]
        inside = (h < NQ + 2 * NKV) & (j < D // 2)
        rot = h < NQ + NKV  # q and k heads rotate; v heads are copied
        x1, x2 = _load_halves(_row(qkv, tok, h, j, NQ, NKV, D), inside, D)
        if NORM:  # q and k heads first go through their RMSNorms (Qwen3's), in fp32
            rstd = _rstd(x1, x2, eps, D)
            w1, w2 = _head_weights(qw, kw, h, j, NQ, D)
            x1 = tl.where(rot, x1 * rstd * w1, x1)
            x2 = tl.where(rot, x2 * rstd * w2, x2)
        t = s_i * CS + b_i * CB + j  # this token's table row
        o1, o2 = _rotate(x1, x2, cos + t, sin + t, j < D // 2, rot, D, False)
        _store_halves(_head(q, b_i, s_i, h, j, QB, QN, QS), o1, o2, inside & (h < NQ), D)
        _store_halves(_head(k, b_i, s_i, h - NQ, j, KB, KN, KS), o1, o2, inside & (h >= NQ) & rot, D)
        is_v = inside & (h >= NQ + NKV) & WRITE_V  # else v is a view of qkv, written by no one
        _store_halves(_head(v, b_i, s_i, h - NQ - NKV, j, KB, KN, KS), o1, o2, is_v, D)

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
        """The forward's strides, and each gradient's own (b, head, s) strides."""
        tok = tl.program_id(0)
        s_i, b_i = (tok // B).to(tl.int64), (tok % B).to(tl.int64)
        h = tl.arange(0, HEADS)[:, None]
        j = tl.arange(0, HALF)[None, :]
        inside = (h < NQ + 2 * NKV) & (j < D // 2)
        rot = h < NQ + NKV
        q1, q2 = _load_halves(_head(gq, b_i, s_i, h, j, QB, QN, QS), inside & (h < NQ), D)
        k1, k2 = _load_halves(_head(gk, b_i, s_i, h - NQ, j, KB, KN, KS), inside & (h >= NQ) & rot, D)
        v1, v2 = _load_halves(_head(gv, b_i, s_i, h - NQ - NKV, j, VB, VN, VS), inside & (h >= NQ + NKV), D)
        t = s_i * CS + b_i * CB + j  # this token's table row
        d1, d2 = _rotate(q1 + k1 + v1, q2 + k2 + v2, cos + t, sin + t, j < D // 2, rot, D, True)
        if NORM:  # their input recomputed from qkv
            x1, x2 = _load_halves(_row(qkv, tok, h, j, NQ, NKV, D), inside & rot, D)
            part = dw_part + tok.to(tl.int64) * (2 * D)
            d1, d2 = _norms_bwd(d1, d2, x1, x2, qw, kw, part, h, j, rot, eps, NQ, D, HALF)
        _store_halves(_row(gqkv, tok, h, j, NQ, NKV, D), d1, d2, inside, D)


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
    view of it, not a copy: one [s, b, h] tensor less held for the backward and one copy fewer per layer
    (benchmarks/RESULTS.md, 'Qwen3's q/k norms in the rotary kernel; the kernel's outputs in seq-major memory';
    compiled the same, through the op below). With the norms, v is the view of qkv and its gradient comes back here,
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
# split + rotation + layout change itself, with a backward whose transposed stores cost many times the kernel's
# (benchmarks/RESULTS.md, 'Numbers moved out of code comments').
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
    [s, 1, 1, d] (or [s, d]) shared by the batch, or [s, b, 1, d] with a row per sequence. `norm`: (q weight,
    k weight, eps) of RMSNorms over each query and key head before the rotation (Qwen3's), in the same pass (eager
    only: compiled, Inductor's fusion of torch's ops is as fast and holds less memory)."""
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
