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
attention and as fast at GQA's kv sizes), in the blocks of `_CausalBlocks`: the first needs only the rank's
own keys and runs while the all-gather is in flight. Backward reduce-scatters the keys' and values' gradients
back to the ranks that own them.

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
    sequence. With the fused kernels (`_fused`) the keys' all-gather runs beside the rank's own block
    (`_CausalBlocks`); otherwise it comes first and `attend_local_chunks` takes the gathered keys."""
    if window is None and _fused(q, _check(q.shape[-2], comm.size), dropout_p):
        return _CausalBlocks.apply(q, k, v, comm, comm.rank, comm.size)
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


def _fused(q: torch.Tensor, c: int, dropout_p: float) -> bool:
    """Whether `_CausalBlocks` computes this rank's attention: no dropout, a kernel that returns the log-sum-exp
    (`_backend`), and on CUDA at least MERGE_MIN_CHUNK queries a chunk."""
    return dropout_p == 0 and (c >= MERGE_MIN_CHUNK or not q.is_cuda) and _backend(q) is not None


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
    """CP rank `rank`'s queries q [b, nq, 2c, d] over the whole sequence's k, v [b, nkv, S, d]: the fused kernels'
    blocks merged into one softmax (`_CausalBlocks`, where `_fused`). Otherwise (dropout, head dim > 128, other
    dtypes, CUDA chunks under MERGE_MIN_CHUNK queries, or `fused=False`) two SDPA calls, one a chunk, with the
    causal mask aligned to the last key (torch's lower-right causal bias). Eager only: torch.compile does not
    reliably trace the bias (a tensor subclass) or this module's kernel calls, so `context_parallel_attention` is
    excluded from it (train.compile with parallel.cp > 1 compiles the rest of each block, around one graph break).
    With a sliding `window` each chunk attends to the window's keys alone, from window-1 before its first query to
    its end (`sliding_window_attention`: flex's block mask on CUDA, where `flex`, else the dense band mask)."""
    c = _check(q.shape[-2], size)
    if window is None and fused and _fused(q, c, dropout_p):
        return _CausalBlocks.apply(q, k, v, None, rank, size)
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
        else:
            from torch.nn.attention.bias import causal_lower_right  # here: its import loads Dynamo (1 s)

            mask = causal_lower_right(c, end)
            outs.append(F.scaled_dot_product_attention(qc, k[..., :end, :], v[..., :end, :], attn_mask=mask, **sdpa))
    return torch.cat(outs, dim=-2)


def _backend(q: torch.Tensor):
    """The fused SDPA ops that return the softmax's log-sum-exp (for `_CausalBlocks`): cuDNN's on Hopper and
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


class _CausalBlocks(torch.autograd.Function):
    """CP rank r's queries q = [chunk r; chunk s] (s = 2cp-1-r, chunks of c tokens) over the keys before them,
    causally, in at most three kernel calls merged into one softmax (FlashAttention's rescaling, across calls):

        A  q x [k_r; k_s]            square causal mask: the rank's own keys, in its own order
        B  q x k[0 : r c]            no mask: the chunks before r        (r > 0)
        C  q_s x k[(r+1)c : s c]     no mask: the chunks between r and s (r < cp-1)
        out = sum of each block's out * exp(its log-sum-exp - L),  L = logaddexp of the blocks' log-sum-exps

    (torch's ring attention splits the same way). A needs only the rank's own keys, so with `comm` given (k, v the
    rank's own [b, nkv, 2c, d]) the keys' and values' all-gather runs beside it; with comm None, k and v are the
    whole sequence's [b, nkv, S, d]. Backward runs each block's kernel with the merged `out` and L (each block's
    share of the whole softmax's gradient), B and C first, so that the reduce-scatter of the gathered keys'
    gradients runs beside A's. GQA: the kernels take the kv heads as they are (cuDNN's, FlashAttention's and the
    CPU kernel all accept fewer kv heads than query heads)."""

    @staticmethod
    def forward(ctx, q, k, v, comm, rank: int, size: int):
        (fwd, _), c = _backend(q), q.shape[-2] // 2
        if comm is not None:  # every rank's [k; v], gathered as they are: [size, 2, b, nkv, 2c, d]
            gathered, wait = comm.start("all_gather", torch.stack([k, v]).unsqueeze(0))
            own = (k, v)
        else:
            gathered, wait = _unorder_chunks(torch.stack([k, v]), size), (lambda: None)
            own = tuple(gathered[rank])
        blocks = [(0, 2 * c, None)]  # (first query row, rows, the key chunks; None: the rank's own, causal)
        if rank > 0:
            blocks.append((0, 2 * c, range(rank)))
        if rank < size - 1:
            blocks.append((c, c, range(rank + 1, 2 * size - 1 - rank)))
        results = [fwd(q, *(t.contiguous() for t in own), True)]
        wait()
        for first, rows, chunks in blocks[1:]:
            kb, vb = _chunks(gathered, chunks, size)
            results.append(fwd(q[..., first : first + rows, :], kb, vb, False))
        out, lse = _merge(q, [(first, o, block_lse) for (first, *_), (o, block_lse, _) in zip(blocks, results)])
        ctx.save_for_backward(q, gathered, out, lse)  # the rank's own keys: gathered[rank]
        ctx.blocks, ctx.aux, ctx.comm, ctx.rank, ctx.size = blocks, [r[2] for r in results], comm, rank, size
        ctx.lse_shape, ctx.lse_dtype = results[0][1].shape, results[0][1].dtype
        return out

    @staticmethod
    def backward(ctx, dout):
        q, gathered, out, lse = ctx.saved_tensors
        (_, bwd), c, size = _backend(q), q.shape[-2] // 2, ctx.size
        dout, dq = dout.contiguous(), torch.zeros_like(q, dtype=torch.float32)
        dkv = torch.zeros_like(gathered)  # the keys' and values' gradients, laid out as gathered
        native = lambda t: t.reshape(*t.shape[:3], *ctx.lse_shape[3:]).to(ctx.lse_dtype).contiguous()  # noqa: E731
        for (first, rows, chunks), aux in zip(ctx.blocks[1:], ctx.aux[1:]):
            part = slice(first, first + rows)
            kb, vb = _chunks(gathered, chunks, size)
            gq, gk, gv = bwd(
                dout[..., part, :].contiguous(), q[..., part, :].contiguous(), kb, vb,
                out[..., part, :].contiguous(), native(lse[..., part]), False, aux,
            )  # fmt: skip
            dq[..., part, :] += gq
            for n, chunk in enumerate(chunks):
                j, half = _slot(chunk, size)
                for i, g in enumerate((gk, gv)):
                    dkv[j, i, ..., half * c : (half + 1) * c, :] = g[..., n * c : (n + 1) * c, :]
        if ctx.comm is not None:  # every rank's share of each key's gradient, summed at its owner
            theirs, wait = ctx.comm.start("reduce_scatter", dkv)
        gq, gk, gv = bwd(dout, q, *gathered[ctx.rank], out, native(lse), True, ctx.aux[0])
        dq += gq
        mine = torch.stack([gk, gv])
        if ctx.comm is not None:
            wait()
            mine += theirs[0]
        else:  # the whole sequence's gradients: this rank's own chunks' shares added where they sit
            dkv[ctx.rank] += mine
            mine = order_chunks(dkv)
        return dq.to(q.dtype), mine[0], mine[1], None, None, None


def _slot(chunk: int, size: int) -> tuple[int, int]:
    """(owner rank, which of its two halves) of sequence chunk `chunk` of 2*size."""
    return (chunk, 0) if chunk < size else (2 * size - 1 - chunk, 1)


def _chunks(gathered: torch.Tensor, chunks, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v of the sequence chunks `chunks` (consecutive, in order) from gathered [size, 2, b, nkv, 2c, d]."""
    c = gathered.shape[-2] // 2
    parts = [gathered[j, :, ..., half * c : (half + 1) * c, :] for j, half in (_slot(i, size) for i in chunks)]
    kv = torch.cat(parts, dim=-2)
    return kv[0], kv[1]


def _unorder_chunks(t: torch.Tensor, size: int) -> torch.Tensor:
    """`order_chunks` inverted: [..., S, d] in order -> [size, ..., 2c, d], rank j's tokens (`shard_sequence`)."""
    return torch.stack([shard_sequence(t, dim=-2, rank=j, size=size) for j in range(size)])


def _merge(q: torch.Tensor, parts) -> tuple[torch.Tensor, torch.Tensor]:
    """One softmax from blocks over disjoint keys: parts = (first query row, out [b, h, n, d], its log-sum-exp
    [b, h, n] or [b, h, n, 1]). Returns out [b, h, rows, d] in q's dtype and L [b, h, rows] (fp32); the blocks are
    accumulated in place in fp32 (no fp32 copy of each block)."""
    lse = q.new_full(q.shape[:-1], float("-inf"), dtype=torch.float32)
    for first, o, block_lse in parts:
        rows = slice(first, first + o.shape[-2])
        lse[..., rows] = torch.logaddexp(lse[..., rows], block_lse.reshape(o.shape[:-1]).float())
    out = torch.zeros_like(q, dtype=torch.float32)
    for first, o, block_lse in parts:
        rows = slice(first, first + o.shape[-2])
        weight = torch.exp(block_lse.reshape(o.shape[:-1]).float() - lse[..., rows])
        out[..., rows, :].addcmul_(o, weight.unsqueeze(-1))
    return out.to(q.dtype), lse
