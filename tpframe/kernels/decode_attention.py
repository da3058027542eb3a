"""Attention of generation's new token over the KV cache (the decode step), in one kernel, two for long caches.

    q [b, nq, s, d], k and v [b, nkv, L, d] (the cache), mask [b, 1, s, L] additive (0 or -inf)  ->  [b, nq, s, d]

SDPA's kernels are built for long queries: for one query row per head (decode) cuDNN's takes many times longer
than reading a short cache does, a visible share of a small model's decode step (benchmarks/RESULTS.md, 'Decode at
TP=1: where the step's time goes, compiled blocks, and a decode-attention kernel'). Here one program handles one
(row, query head, query token) over a contiguous split of the cache slots (flash-decoding: online softmax in fp32);
with several splits a second kernel merges their partial results. Grouped-query attention (query head h reads kv
head h // (nq / nkv), as SDPA's `enable_gqa`) has its own kernel: a first version let each query head re-read its kv
head and lost to SDPA; now one program serves a kv head's whole query group (two small tl.dot per tile, each slot
read once) and beats SDPA at every shape measured (benchmarks/RESULTS.md, 'Decode attention: tpframe's kernel vs
SDPA'), so decode steps of grouped heads run it too.
Scale 1/sqrt(d), as SDPA's default.
Inference only (no backward). Under torch.compile it runs as the custom op tpframe::decode_attention.
"""

from __future__ import annotations

import math

import torch

from tpframe.kernels import HAVE_TRITON

# The best of `benchmarks/decode_attention.py --sweep` (the kernel alone in a CUDA graph): many small programs win
# (benchmarks/RESULTS.md, 'Decode at TP=1: where the step's time goes, compiled blocks, and a decode-attention kernel').
BLOCK_L = 16  # cache slots per loop iteration
NUM_WARPS = 1
PROGRAMS = 1024  # (row, head, token) programs times splits to aim for
MAX_SPLITS = 64
# Grouped-query heads (_decode_attn_group): tl.dot tiles, so at least 16 slots and 16 (padded) query rows. The best
# of the --sweep (benchmarks/RESULTS.md, 'Decode attention: tpframe's kernel vs SDPA').
GROUP_BLOCK_L = 64
GROUP_NUM_WARPS = 2
GROUP_PROGRAMS = 264

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _decode_attn(
        q,
        k,
        v,
        mask,
        out,
        part_m,
        part_l,
        part_acc,
        L,
        SPLIT_L,
        scale,
        S: tl.constexpr,
        NQ: tl.constexpr,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK: tl.constexpr,
        SPLITS: tl.constexpr,
    ):
        """Multi-head attention (kv head h serves query head h)."""
        pid = tl.program_id(0)  # ((row * NQ + head) * S + token): q's and out's row of d values
        split = tl.program_id(1)
        t = pid % S
        h = (pid // S) % NQ
        row = pid // (S * NQ)
        dd = tl.arange(0, BLOCK_D)
        dmask = dd < D
        qv = tl.load(q + pid.to(tl.int64) * D + dd, mask=dmask, other=0.0).to(tl.float32) * scale
        kv_off = (row * NQ + h).to(tl.int64) * L * D
        mrow = mask + (row * S + t).to(tl.int64) * L
        m_i = tl.full((), -1e30, tl.float32)  # a masked score is -1e30, not -inf: no inf - inf
        l_i = tl.zeros((), tl.float32)
        acc = tl.zeros((BLOCK_D,), tl.float32)
        lo = split * SPLIT_L
        hi = tl.minimum(lo + SPLIT_L, L)
        for off in range(lo, hi, BLOCK):
            slots = off + tl.arange(0, BLOCK)
            inside = slots < hi
            both = inside[:, None] & dmask[None, :]
            kt = tl.load(k + kv_off + slots[:, None] * D + dd[None, :], mask=both, other=0.0).to(tl.float32)
            sc = tl.sum(kt * qv[None, :], axis=1)
            sc = tl.maximum(sc + tl.load(mrow + slots, mask=inside, other=0.0).to(tl.float32), -1e30)
            m_new = tl.maximum(m_i, tl.max(tl.where(inside, sc, -1e30), axis=0))
            p = tl.where(inside, tl.exp(sc - m_new), 0.0)
            alpha = tl.exp(m_i - m_new)
            vt = tl.load(v + kv_off + slots[:, None] * D + dd[None, :], mask=both, other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(p[:, None] * vt, axis=0)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            m_i = m_new
        if SPLITS == 1:
            tl.store(out + pid.to(tl.int64) * D + dd, (acc / l_i).to(out.dtype.element_ty), mask=dmask)
        else:
            at = pid.to(tl.int64) * SPLITS + split
            tl.store(part_m + at, m_i)
            tl.store(part_l + at, l_i)
            tl.store(part_acc + at * D + dd, acc, mask=dmask)

    @triton.jit
    def _group_scan(qt, k, v, mrow, lo, hi, scale, dd, D: tl.constexpr, BLOCK: tl.constexpr, BLOCK_G: tl.constexpr):
        """Online softmax of a query group `qt` [BLOCK_G, BLOCK_D] over cache slots lo..hi of one kv head (k, v at
        its first slot, mask row `mrow`): the running max, sum and output, in fp32. The matmuls' "ieee": fp32 inputs
        multiply in full precision (no tf32); it changes nothing for 16-bit ones."""
        m_i = tl.full((BLOCK_G,), -1e30, tl.float32)
        l_i = tl.zeros((BLOCK_G,), tl.float32)
        acc = tl.zeros((BLOCK_G, dd.shape[0]), tl.float32)
        for off in range(lo, hi, BLOCK):
            slots = off + tl.arange(0, BLOCK)
            inside = slots < hi
            both = inside[:, None] & (dd < D)[None, :]
            kt = tl.load(k + slots[:, None] * D + dd[None, :], mask=both, other=0.0)
            sc = tl.dot(qt, tl.trans(kt), input_precision="ieee") * scale
            bias = tl.load(mrow + slots, mask=inside, other=0.0).to(tl.float32)
            sc = tl.maximum(sc + bias[None, :], -1e30)
            sc = tl.where(inside[None, :], sc, -1e30)
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            pr = tl.where(inside[None, :], tl.exp(sc - m_new[:, None]), 0.0)
            alpha = tl.exp(m_i - m_new)
            vt = tl.load(v + slots[:, None] * D + dd[None, :], mask=both, other=0.0)
            pv = tl.dot(pr.to(vt.dtype), vt, input_precision="ieee")
            acc = acc * alpha[:, None] + pv
            l_i = l_i * alpha + tl.sum(pr, axis=1)
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit
    def _decode_attn_group(
        q,
        k,
        v,
        mask,
        out,
        part_m,
        part_l,
        part_acc,
        L,
        SPLIT_L,
        scale,
        S: tl.constexpr,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK: tl.constexpr,
        SPLITS: tl.constexpr,
        NQ: tl.constexpr,
        NKV: tl.constexpr,
        BLOCK_G: tl.constexpr,
    ):
        """Grouped-query attention: one program per (row, kv head, query token, split) serves the kv head's
        G = NQ / NKV query heads at once, reading each cache slot once (two small matmuls per tile)."""
        pid = tl.program_id(0)  # (row * NKV + kv head) * S + token
        split = tl.program_id(1)
        t = pid % S
        kh = (pid // S) % NKV
        row = pid // (S * NKV)
        G: tl.constexpr = NQ // NKV
        gg = tl.arange(0, BLOCK_G)
        dd = tl.arange(0, BLOCK_D)
        qrows = ((row * NQ + kh * G + gg) * S + t).to(tl.int64)  # q's and out's rows of this group
        qmask = (gg < G)[:, None] & (dd < D)[None, :]
        qt = tl.load(q + qrows[:, None] * D + dd[None, :], mask=qmask, other=0.0)
        kv_off = (row * NKV + kh).to(tl.int64) * L * D
        mrow = mask + (row * S + t).to(tl.int64) * L
        lo = split * SPLIT_L
        hi = tl.minimum(lo + SPLIT_L, L)
        m_i, l_i, acc = _group_scan(qt, k + kv_off, v + kv_off, mrow, lo, hi, scale, dd, D, BLOCK, BLOCK_G)
        if SPLITS == 1:
            tl.store(out + qrows[:, None] * D + dd[None, :], (acc / l_i[:, None]).to(out.dtype.element_ty), mask=qmask)
        else:
            at = qrows * SPLITS + split
            tl.store(part_m + at, m_i, mask=gg < G)
            tl.store(part_l + at, l_i, mask=gg < G)
            tl.store(part_acc + at[:, None] * D + dd[None, :], acc, mask=qmask)

    @triton.jit
    def _decode_attn_merge(
        out,
        part_m,
        part_l,
        part_acc,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        SPLITS: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        pid = tl.program_id(0)
        sp = tl.arange(0, BLOCK_S)
        dd = tl.arange(0, BLOCK_D)
        at = pid.to(tl.int64) * SPLITS + sp
        m = tl.load(part_m + at, mask=sp < SPLITS, other=-1e30)
        l_ = tl.load(part_l + at, mask=sp < SPLITS, other=0.0)
        w = tl.where(sp < SPLITS, tl.exp(m - tl.max(m, axis=0)), 0.0)  # a fully masked split weighs exp(-1e30-M) = 0
        acc = tl.load(
            part_acc + at[:, None] * D + dd[None, :], mask=(sp[:, None] < SPLITS) & (dd[None, :] < D), other=0.0
        )
        o = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l_, axis=0)
        tl.store(out + pid.to(tl.int64) * D + dd, o.to(out.dtype.element_ty), mask=dd < D)


def plan_splits(programs: int, slots: int, block: int | None = None, target: int | None = None) -> tuple[int, int]:
    """(splits, slots per split): about `target` programs in all (default PROGRAMS) to fill the GPU, each
    split a multiple of `block` slots (default BLOCK_L)."""
    block, target = block or BLOCK_L, target or PROGRAMS
    want = max(1, min(MAX_SPLITS, -(-target // programs), -(-slots // block)))
    per = -(-slots // want)  # slots per split, then rounded up to whole blocks
    per = -(-per // block) * block
    return -(-slots // per), per


def launch_plan(b: int, nq: int, nkv: int, s: int, slots: int) -> tuple[bool, int, int, int]:
    """(grouped, programs per split, splits, slots per split) of a call: grouped-query heads get one program per
    kv head (and row, token, split), multi-head attention one per query head."""
    grouped = nq != nkv
    programs = b * (nkv if grouped else nq) * s
    if grouped:
        return (grouped, programs, *plan_splits(programs, slots, block=GROUP_BLOCK_L, target=GROUP_PROGRAMS))
    return (grouped, programs, *plan_splits(programs, slots))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    b, nq, s, d = q.shape
    nkv, slots = k.shape[1], k.shape[2]
    q, k, v, mask = q.contiguous(), k.contiguous(), v.contiguous(), mask.contiguous()
    out = torch.empty_like(q)
    rows = b * nq * s  # query rows: what the merge kernel combines
    grouped, programs, splits, per = launch_plan(b, nq, nkv, s, slots)
    block_d = triton.next_power_of_2(d)
    if splits == 1:
        part_m = part_l = part_acc = out  # unused
    else:
        part_m = torch.empty(rows * splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(rows * splits * d, dtype=torch.float32, device=q.device)
    common = dict(S=s, D=d, BLOCK_D=max(16, block_d) if grouped else block_d, SPLITS=splits)
    args = (q, k, v, mask, out, part_m, part_l, part_acc, slots, per, 1.0 / math.sqrt(d))
    if grouped:
        _decode_attn_group[(programs, splits)](
            *args,
            **common,
            NQ=nq,
            NKV=nkv,
            BLOCK=GROUP_BLOCK_L,
            BLOCK_G=max(16, triton.next_power_of_2(nq // nkv)),
            num_warps=GROUP_NUM_WARPS,
        )
    else:
        _decode_attn[(programs, splits)](*args, **common, NQ=nq, BLOCK=BLOCK_L, num_warps=NUM_WARPS)
    if splits > 1:
        _decode_attn_merge[(rows,)](
            out, part_m, part_l, part_acc, D=d, BLOCK_D=block_d, SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits)
        )
    return out


@torch.library.custom_op("tpframe::decode_attention", mutates_args=())
def decode_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return _attend(q, k, v, mask)


@decode_attention_op.register_fake
def _(q, k, v, mask):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v for a few query tokens over a cache; shapes as the module docstring."""
    if not HAVE_TRITON:
        raise RuntimeError("decode_attention needs Triton")
    b, nq, s, d = q.shape
    if (
        k.dim() != 4
        or k.shape[0] != b
        or k.shape[3] != d
        or v.shape != k.shape
        or nq % k.shape[1]
        or tuple(mask.shape) != (b, 1, s, k.shape[2])
    ):
        raise ValueError(
            f"decode_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
            f"mask {tuple(mask.shape)} do not fit [b, nq, s, d], [b, nkv, L, d] (nq a multiple of nkv), "
            "[b, 1, s, L]"
        )
    if torch.compiler.is_compiling():
        return torch.ops.tpframe.decode_attention(q, k, v, mask)
    return _attend(q, k, v, mask)
