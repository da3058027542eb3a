"""Context parallelism (CP): every sequence split over the ranks of a CP group, for sequences too long
for one rank's activation memory.

The S tokens of a sequence are cut into 2*cp chunks of c = S / (2 cp). CP rank r keeps chunks r and
2cp-1-r (the load-balanced split of Megatron-Core and Llama 3: under a causal mask chunk j attends to j+1
chunks, so the pair r, 2cp-1-r costs every rank the same):

    cp=2, S=8:   positions 0 1 | 2 3 | 4 5 | 6 7      rank 0: 0 1 6 7     rank 1: 2 3 4 5

Everything but attention is per token, so the model runs on the local S/cp tokens unchanged (rotary or
learned positions at their global positions). Attention all-gathers the keys and values of the whole
sequence over CP (after rotary; with GQA only the few kv heads travel) and each local chunk attends to the
keys up to its own end, causally (Llama 3's all-gather CP, section 3.3.2 of its paper: simpler than ring
attention and as fast at GQA's kv sizes). The backward of the all-gather reduce-scatters the keys' and
values' gradients back to the ranks that own them.

    ids = shard_sequence(ids, dim=1, rank=r, size=cp)      # the loader: [b, S] -> [b, S/cp]
    pos = local_positions(S // cp, rank=r, size=cp)         # the model: global positions of local tokens
    out = context_parallel_attention(q, k, v, cp_comm)      # attention: [b, n, S/cp, d] for this rank's queries

Parameters are replicated over CP, so gradients are reduced over DP x CP (ParallelState.dp_cp_group),
which with each rank's loss a mean over its own tokens gives the mean over the whole sequence.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tpframe.comm import Communicator
from tpframe.errors import ConfigError
from tpframe.layers.mappings import gather_from_sp
from tpframe.layers.sliding_window import sliding_window_attention
from tpframe.layers.utils import eager

# Below this many queries per chunk the merged kernels lose to one lower-right-masked call (three kernels and a
# merge for little work): benchmarks/cp_attention.py, benchmarks/RESULTS.md, 'Context-parallel attention, one rank's
# share'.
MERGE_MIN_CHUNK = 2048

# parallel.cp_comm, how attention meets the other CP ranks' tokens: "all_gather" (this module: every rank gathers the
# whole sequence's keys and values) or "all_to_all" (tpframe/layers/ulysses.py: heads traded for the sequence)
CP_COMM_MODES = ("all_gather", "all_to_all")


def check_sequence_split(cfg) -> None:
    """train.seq_len split over parallel.cp (2*cp equal chunks, two per CP rank) and, with
    parallel.sequence_parallel, each CP rank's tokens over parallel.tp (`cfg`: the run's Config)."""
    p, t = cfg.parallel, cfg.train
    if p.cp == 1:
        if p.sequence_parallel and t.seq_len % p.tp:
            raise ConfigError(
                f"parallel.sequence_parallel needs train.seq_len={t.seq_len} divisible by parallel.tp={p.tp}"
            )
        return
    if t.seq_len % (2 * p.cp):
        raise ConfigError(
            f"parallel.cp={p.cp} cuts each sequence into 2*cp = {2 * p.cp} equal chunks; "
            f"train.seq_len={t.seq_len} is not divisible by {2 * p.cp}"
        )
    if p.sequence_parallel and (t.seq_len // p.cp) % p.tp:
        raise ConfigError(
            f"parallel.sequence_parallel splits each CP rank's train.seq_len/parallel.cp = "
            f"{t.seq_len // p.cp} tokens over parallel.tp={p.tp}; make train.seq_len a multiple of "
            f"{p.cp * p.tp * 2 // math.gcd(2, p.tp)}"
        )


def check_cp_comm(cfg) -> None:
    """parallel.cp_comm=all_to_all splits each TP rank's query heads over the CP ranks (`cfg`: the run's Config)."""
    p, heads = cfg.parallel, cfg.model.heads
    if p.cp > 1 and p.cp_comm == "all_to_all" and (heads // p.tp) % p.cp:
        raise ConfigError(
            f"parallel.cp_comm=all_to_all splits each TP rank's model.heads/parallel.tp = {heads}/{p.tp} = "
            f"{heads // p.tp} query heads over parallel.cp={p.cp}, which does not divide them; use "
            f"parallel.cp_comm=all_gather or a parallel.cp that divides {heads // p.tp}"
        )


def _check(seq_len: int, size: int) -> int:
    """The chunk length c of a local sequence of `seq_len` tokens (two chunks)."""
    if seq_len % 2:
        raise ValueError(
            f"a context-parallel rank holds two equal chunks, so its {seq_len} tokens must be even "
            f"(the sequence length must be a multiple of 2*cp = {2 * size})"
        )
    return seq_len // 2


def shard_sequence(x: torch.Tensor, *, dim: int, rank: int, size: int) -> torch.Tensor:
    """This CP rank's tokens of `x` along `dim` (the whole sequence): chunks `rank` and `2*size-1-rank`."""
    if size == 1:
        return x
    if x.shape[dim] % (2 * size):
        raise ValueError(
            f"cannot split a sequence of {x.shape[dim]} tokens into 2*cp = {2 * size} equal chunks; "
            f"make the sequence length a multiple of {2 * size}"
        )
    chunks = x.chunk(2 * size, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * size - 1 - rank]], dim=dim)


def local_positions(seq_len: int, *, rank: int, size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions [seq_len] of this CP rank's `seq_len` local tokens."""
    if size == 1:
        return torch.arange(seq_len, device=device)
    c = _check(seq_len, size)
    return torch.cat(
        [
            torch.arange(rank * c, (rank + 1) * c, device=device),
            torch.arange((2 * size - 1 - rank) * c, (2 * size - rank) * c, device=device),
        ]
    )


def gather_sequence(t: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Every CP rank's local [..., S/cp, d] (dim -2 the sequence, in `shard_sequence`'s order) -> the whole
    sequence [..., S, d] in order. Backward: the gradient's slices reduce-scattered to their owners."""
    _check(t.shape[-2], comm.size)
    return order_chunks(gather_from_sp(t.unsqueeze(0).contiguous(), comm))


def gather_token_ids(ids: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Every CP rank's token ids [b, S/cp] -> the whole sequences [b, S], in order (packed documents: where a
    local token's document began may lie in another rank's chunk). No gradient: ids."""
    parts = [torch.empty_like(ids) for _ in range(comm.size)]
    dist.all_gather(parts, ids.contiguous(), group=comm.group)
    return order_chunks(torch.stack(parts).unsqueeze(-1)).squeeze(-1)


def order_chunks(g: torch.Tensor) -> torch.Tensor:
    """Every rank's local tokens stacked, [cp, ..., 2c, d] -> the sequence in order, [..., 2 cp c, d]."""
    g = g.unflatten(-2, (2, g.shape[-2] // 2))  # [cp, ..., 2, c, d]
    first = g.select(-3, 0).unbind(0)  # chunks 0 .. cp-1, from ranks 0 .. cp-1
    second = g.select(-3, 1).unbind(0)[::-1]  # chunks cp .. 2cp-1, from ranks cp-1 .. 0
    return torch.cat([*first, *second], dim=-2)


@eager  # eager inside a compiled block (a graph break): torch.compile traces no lower-right mask
def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    comm: Communicator,
    *,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
    window: int | None = None,
    flex: bool = True,
) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole sequence's keys (within a sliding `window`, if
    given).

    q [b, nq, 2c, d], k and v [b, nkv, 2c, d]: this rank's tokens (chunks r and 2cp-1-r, rotary applied at
    their global positions). Returns [b, nq, 2c, d], equal to those rows of causal attention over the whole
    sequence."""
    kv = gather_sequence(torch.stack([k, v]), comm)  # one all-gather for both: [2, b, nkv, S, d]
    return attend_local_chunks(
        q,
        kv[0],
        kv[1],
        rank=comm.rank,
        size=comm.size,
        dropout_p=dropout_p,
        enable_gqa=enable_gqa,
        window=window,
        flex=flex,
    )


def attend_local_chunks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    rank: int,
    size: int,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
    fused: bool = True,
    window: int | None = None,
    flex: bool = True,
) -> torch.Tensor:
    """CP rank `rank`'s queries q [b, nq, 2c, d] over the whole sequence's k, v [b, nkv, S, d]: each local chunk
    attends to the keys before it (no mask) and to its own keys (the square causal mask), merged into one softmax
    (`_ChunkAttention`). Where the fused kernels do not apply (dropout, head dim > 128, other dtypes) or do not pay
    (CUDA chunks under MERGE_MIN_CHUNK queries) two SDPA calls
    with the causal mask aligned to the last key (torch's lower-right causal bias) compute the same (`fused=False`
    forces that path). Eager only: torch.compile does not reliably trace the bias (a tensor subclass) or this
    module's kernel calls, so `context_parallel_attention` is excluded from it (train.compile with parallel.cp > 1
    compiles the rest of each block, around one graph break). With a sliding `window` each chunk attends to the
    window's keys alone, from window-1 before its first query to its end (`sliding_window_attention`: flex's
    block mask on CUDA, where `flex`, else the dense band mask)."""
    c = _check(q.shape[-2], size)
    fused = fused and dropout_p == 0 and (c >= MERGE_MIN_CHUNK or not q.is_cuda) and _backend(q) is not None
    sdpa = dict(dropout_p=dropout_p, enable_gqa=enable_gqa)
    outs = []
    for chunk, start in ((0, rank * c), (1, (2 * size - 1 - rank) * c)):  # the chunk's first global position
        qc, end = q[..., chunk * c : (chunk + 1) * c, :], start + c
        if window is not None:
            first = max(0, start - window + 1)
            outs.append(
                sliding_window_attention(qc, k[..., first:end, :], v[..., first:end, :], window, **sdpa, flex=flex)
            )
        elif start == 0:  # the sequence's first chunk: a square causal mask
            outs.append(F.scaled_dot_product_attention(qc, k[..., :c, :], v[..., :c, :], is_causal=True, **sdpa))
        elif fused:
            outs.append(_ChunkAttention.apply(qc, k[..., :end, :], v[..., :end, :], start))
        else:
            from torch.nn.attention.bias import causal_lower_right  # here: its import loads Dynamo (1 s)

            mask = causal_lower_right(c, end)
            outs.append(F.scaled_dot_product_attention(qc, k[..., :end, :], v[..., :end, :], attn_mask=mask, **sdpa))
    return torch.cat(outs, dim=-2)


def _backend(q: torch.Tensor):
    """The fused SDPA ops that return the softmax's log-sum-exp (for `_ChunkAttention`): cuDNN's on Hopper and
    later (SDPA's own first choice there, and faster than FlashAttention-2 at these shapes: benchmarks/RESULTS.md,
    'Context-parallel attention, one rank's share'), else FlashAttention's on CUDA, the CPU kernel on CPU; None where
    they do not apply."""
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64) or q.shape[-1] > 128:
        return None
    if q.is_cuda:
        if q.dtype not in (torch.bfloat16, torch.float16):
            return None
        major = torch.cuda.get_device_capability(q.device)[0]
        return _CUDNN if major >= 9 and torch.backends.cuda.cudnn_sdp_enabled() else _FLASH
    return _CPU if q.device.type == "cpu" else None


def _cudnn_forward(q, k, v, causal):
    out, lse, cq, ck, mq, mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False
    )
    return out, lse, (seed, offset, cq, ck, mq, mk)


def _cudnn_backward(dout, q, k, v, out, lse, causal, aux):
    seed, offset, cq, ck, mq, mk = aux
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, seed, offset, None, cq, ck, mq, mk, 0.0, causal
    )


def _flash_forward(q, k, v, causal):
    out, lse, cq, ck, mq, mk, rng, unused, _ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
    return out, lse, (cq, ck, mq, mk, rng, unused)


def _flash_backward(dout, q, k, v, out, lse, causal, aux):
    cq, ck, mq, mk, rng, unused = aux
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, cq, ck, mq, mk, 0.0, causal, rng, unused
    )


def _cpu_forward(q, k, v, causal):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    return out, lse, ()


def _cpu_backward(dout, q, k, v, out, lse, causal, aux):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal)


_CUDNN, _FLASH, _CPU = (
    (_cudnn_forward, _cudnn_backward),
    (_flash_forward, _flash_backward),
    (_cpu_forward, _cpu_backward),
)


class _ChunkAttention(torch.autograd.Function):
    """q [b, nq, c, d] at positions start..start+c-1 over keys k, v [b, nkv, start+c, d], causally:

        past = attention(q, k[:start], v[:start])        no mask, and its log-sum-exp L1
        own  = attention(q, k[start:], v[start:])        square causal mask, and L2
        out  = past * exp(L1 - L) + own * exp(L2 - L),   L = logaddexp(L1, L2)

    (one softmax over both key blocks: FlashAttention's rescaling, across two kernel calls). Backward runs each
    block's backward kernel with the merged `out` and `L`, which yields that block's share of the gradient of the
    whole softmax (torch's ring attention does the same). GQA: the kv heads are repeated for the kernels and
    their gradients summed back."""

    @staticmethod
    def forward(ctx, q, k, v, start: int):
        (fwd, _), groups = _backend(q), q.shape[1] // k.shape[1]
        kr, vr = (t.repeat_interleave(groups, dim=1) if groups > 1 else t for t in (k, v))
        blocks = ((kr[..., :start, :], vr[..., :start, :], False), (kr[..., start:, :], vr[..., start:, :], True))
        results = [fwd(q, kb.contiguous(), vb.contiguous(), causal) for kb, vb, causal in blocks]
        (past, l1, aux1), (own, l2, aux2) = results
        lse = torch.logaddexp(l1.float(), l2.float())
        out = _merge(past, l1, own, l2, lse).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse.to(l1.dtype))
        ctx.start, ctx.aux = start, (aux1, aux2)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        (_, bwd), groups, start = _backend(q), q.shape[1] // k.shape[1], ctx.start
        kr, vr = (t.repeat_interleave(groups, dim=1) if groups > 1 else t for t in (k, v))
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        dk, dv = torch.empty_like(kr), torch.empty_like(vr)
        for (lo, hi), causal, aux in (((0, start), False, ctx.aux[0]), ((start, kr.shape[-2]), True, ctx.aux[1])):
            gq, gk, gv = bwd(
                dout, q, kr[..., lo:hi, :].contiguous(), vr[..., lo:hi, :].contiguous(), out, lse, causal, aux
            )
            dq += gq
            dk[..., lo:hi, :], dv[..., lo:hi, :] = gk, gv
        if groups > 1:  # the repeated heads' gradients, summed into their kv head
            dk, dv = (t.unflatten(1, (k.shape[1], groups)).sum(2) for t in (dk, dv))
        return dq.to(q.dtype), dk, dv, None


def _merge(past, l1, own, l2, lse):
    """past * exp(l1 - lse) + own * exp(l2 - lse) in fp32; the log-sum-exps [b, h, c] (or [b, h, c, 1])."""
    w1, w2 = torch.exp(l1.float() - lse), torch.exp(l2.float() - lse)
    if w1.dim() == past.dim() - 1:
        w1, w2 = w1.unsqueeze(-1), w2.unsqueeze(-1)
    return past.float() * w1 + own.float() * w2
