"""Packed documents: attention that stays inside each document, positions that restart at each.

A training row of `s` tokens is cut from a stream of documents, each ended by an end-of-document token
(EOD), so one row holds the tail of one document, several whole ones and the head of another. With
`model.attention_mask=document` each token attends only to the earlier tokens of its own document and sits
at its position within it, so a packed row computes exactly what each document would alone (Megatron's
`--reset-attention-mask --reset-position-ids`; torchtitan's block-causal mask). An EOD belongs to the
document it ends; the token after it starts the next.

    input ids   a b c EOD d e EOD f
    documents   0 0 0  0  1 1  1  2
    positions   0 1 2  3  0 1  2  0

`Documents.from_tokens` computes this once per micro-batch; attention then runs one of two ways:
- on CUDA in bf16/fp16, Flash attention over variable-length sequences (`torch.nn.attention.varlen`):
  every document of every row is one sequence of the flattened batch, and no mask is materialized;
- elsewhere (the CPU, fp32, attention dropout), SDPA with the dense mask [b, 1, s, s].
A sliding window (`window`, tpframe/layers/sliding_window.py) narrows each document's causal mask to its band: the
varlen kernel's left window where this torch's varlen_attn takes one, else the dense mask.
Under context parallelism a rank's queries are two chunks of each row over the all-gathered keys:
`Documents.for_cp_rank` makes each chunk's pieces of documents variable-length sequences (`ChunkSequences`), or
the dense mask of the rank's rows is used.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tpframe.layers.context import gather_sequence, local_positions
from tpframe.layers.sliding_window import band
from tpframe.layers.utils import eager

try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # pragma: no cover - older torch
    _varlen_attn = None

_VARLEN_ARGS = set(inspect.signature(_varlen_attn).parameters) if _varlen_attn is not None else set()
VARLEN_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True, eq=False)
class Documents:
    """Where the documents of a micro-batch [b, s] begin (module docstring).

    ids [b, s]: each token's document within its row; positions [b, s]: its position within its document;
    cu_seqlens [n+1] int32 and max_len: the n documents of the flattened b*s tokens (CUDA only, else None)."""

    ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    max_len: int = 0
    # context parallelism on CUDA: this CP rank's two query chunks as variable-length sequences (`for_cp_rank`)
    chunks: tuple[ChunkSequences, ChunkSequences] | None = None

    @classmethod
    def from_tokens(cls, input_ids: torch.Tensor, eod_id: int, *, varlen: bool | None = None) -> Documents:
        """From input ids [b, s]. `varlen` (default: on CUDA) also finds cu_seqlens and max_len; their
        boundaries are read back to the host (the varlen kernel sizes its grid by them): one device-to-host
        copy of b*s booleans per micro-batch."""
        b, s = input_ids.shape
        eod = input_ids == eod_id
        ids = torch.cumsum(eod, dim=1) - eod.long()  # EODs strictly before each token
        starts = torch.ones_like(eod)
        starts[:, 1:] = eod[:, :-1]  # a row's first token, and every token after an EOD
        index = torch.arange(s, device=input_ids.device).expand(b, s)
        first = torch.cummax(torch.where(starts, index, 0), dim=1).values  # where each token's document began
        positions = index - first
        if not (input_ids.is_cuda if varlen is None else varlen):
            return cls(ids, positions)
        bounds = torch.cat([starts.flatten().cpu().nonzero().flatten(), torch.tensor([b * s])])
        cu = bounds.to(torch.int32).to(input_ids.device, non_blocking=True)
        return cls(ids, positions, cu, int((bounds[1:] - bounds[:-1]).max()))

    @classmethod
    def for_cp_rank(
        cls, input_ids: torch.Tensor, eod_id: int, *, rank: int, size: int, varlen: bool | None = None
    ) -> Documents:
        """The documents of whole rows [b, S] (every CP rank's tokens, gathered) for CP rank `rank` of `size`,
        whose queries are chunks `rank` and `2*size-1-rank` of c = S / (2 size) tokens. `varlen` (default: on
        CUDA) also describes each chunk's documents as variable-length sequences (`ChunkSequences`), from one
        device-to-host copy of the rows' document starts."""
        docs = cls.from_tokens(input_ids, eod_id, varlen=False)
        if not (input_ids.is_cuda if varlen is None else varlen):
            return docs
        b, s = input_ids.shape
        c = s // (2 * size)
        starts = (docs.positions == 0).cpu()  # each row's document starts (position 0 also starts a row)
        rows = [row.nonzero().flatten().tolist() + [s] for row in starts]
        chunks = tuple(
            ChunkSequences.of_chunk(rows, start, c, s, input_ids.device)
            for start in (rank * c, (2 * size - 1 - rank) * c)
        )
        return cls(docs.ids, docs.positions, chunks=chunks)

    def mask(self) -> torch.Tensor:
        """[b, 1, s, s] bool, True where a query may attend a key: an earlier (or the same) token of its document."""
        s = self.ids.shape[1]
        causal = torch.ones(s, s, dtype=torch.bool, device=self.ids.device).tril()
        return ((self.ids[:, :, None] == self.ids[:, None, :]) & causal)[:, None]


def document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    docs: Documents,
    *,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention inside each document (within `window` tokens, if given): q [b, nq, s, d], k and v
    [b, nkv, s, d] -> [b, nq, s, d]."""
    if uses_varlen(q, docs, dropout_p, window=window):
        return _varlen(q, k, v, docs, enable_gqa, window)
    mask = docs.mask()
    s = q.shape[-2]
    if window is not None and window < s:
        mask = mask & band(s, s, window, device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=enable_gqa)


@eager  # eager inside a compiled block, as the causal CP attention (tpframe/layers/context.py)
def context_parallel_document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    comm,
    docs: Documents,
    *,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
    window: int | None = None,
) -> torch.Tensor:
    """This CP rank's queries q [b, nq, 2c, d] (its chunks r and 2cp-1-r) over the whole sequence's keys, inside
    each document: k and v [b, nkv, 2c, d] are all-gathered over `comm` as for causal CP attention, and `docs`
    describes the whole rows ([b, S]). On CUDA (bf16, no dropout) with `docs.chunks` (`Documents.for_cp_rank`):
    variable-length Flash attention per chunk; elsewhere SDPA with the [b, 1, 2c, S] mask of these queries' rows.
    A sliding `window` narrows it (varlen's left window where this torch takes one, else the mask)."""
    kv = gather_sequence(torch.stack([k, v]), comm)  # [2, b, nkv, S, d]
    if docs.chunks is not None and varlen_runs(q.device.type, q.dtype, dropout_p, head_dim=q.shape[-1], window=window):
        return _varlen_chunks(q, kv, docs.chunks, enable_gqa, window)
    s = kv.shape[-2]
    rows = local_positions(q.shape[-2], rank=comm.rank, size=comm.size, device=q.device)  # global positions
    keys = torch.arange(s, device=q.device)
    ids = docs.ids
    mask = (ids[:, rows, None] == ids[:, None, :]) & (rows[:, None] >= keys[None, :])
    if window is not None:
        mask = mask & (rows[:, None] - keys[None, :] < window)
    return F.scaled_dot_product_attention(
        q, kv[0], kv[1], attn_mask=mask[:, None], dropout_p=dropout_p, enable_gqa=enable_gqa
    )


def uses_varlen(
    q: torch.Tensor, docs: Documents, dropout_p: float = 0.0, *, head_dim: int | None = None, window: int | None = None
) -> bool:
    """Whether `document_attention` runs the variable-length Flash kernel for these inputs (q, or any tensor of
    its device and dtype with `head_dim`; with a sliding `window`, where this torch's varlen_attn takes one)."""
    return docs.cu_seqlens is not None and varlen_runs(
        q.device.type, q.dtype, dropout_p, head_dim=head_dim or q.shape[-1], window=window
    )


def varlen_runs(device_type: str, dtype: torch.dtype, dropout_p: float, *, head_dim: int, window: int | None) -> bool:
    """Whether the variable-length Flash kernel runs documents' attention on this device type and dtype (the
    memory estimate asks too: its output is written token-major, so the layer keeps an [s, b, h] copy as well)."""
    return (
        _varlen_attn is not None
        and dropout_p == 0
        and device_type == "cuda"
        and dtype in VARLEN_DTYPES
        and head_dim <= 256
        and (window is None or "window_size" in _VARLEN_ARGS)
    )


@eager  # eager inside a compiled block: the documents' count and longest length vary per batch
def _varlen(q, k, v, docs: Documents, enable_gqa: bool, window: int | None = None) -> torch.Tensor:
    b, nq, s, d = q.shape
    flat = [t.transpose(1, 2).reshape(b * s, t.shape[1], d) for t in (q, k, v)]  # [b*s, n, d]
    out = _varlen_causal(*flat, docs.cu_seqlens, docs.cu_seqlens, docs.max_len, docs.max_len, enable_gqa, window)
    return out.view(b, s, nq, d).transpose(1, 2)


def _varlen_causal(q, k, v, cu_q, cu_k, max_q, max_k, enable_gqa: bool, window: int | None = None) -> torch.Tensor:
    """varlen_attn over [total, n, d] rows, causal with the mask aligned to each sequence's last key (Flash's
    bottom-right alignment: a sequence of fewer queries than keys holds the last queries); a sliding `window`
    (torch versions whose varlen_attn takes window_size) is Flash's left window of window-1 keys."""
    if enable_gqa and "enable_gqa" not in _VARLEN_ARGS:  # torch versions without GQA in varlen_attn
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        enable_gqa = False
    extra = {"enable_gqa": True} if enable_gqa else {}
    if window is not None:
        extra["window_size"] = (window - 1, 0)
    elif "is_causal" in _VARLEN_ARGS:
        extra["is_causal"] = True
    else:
        extra["window_size"] = (-1, 0)  # causal
    return _varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **extra)


def _varlen_chunks(
    q: torch.Tensor, kv: torch.Tensor, chunks, enable_gqa: bool, window: int | None = None
) -> torch.Tensor:
    """q [b, nq, 2c, d] (this CP rank's two chunks) over kv [2, b, nkv, S, d], one varlen call per chunk."""
    b, nq, two_c, d = q.shape
    c, nkv, s = two_c // 2, kv.shape[2], kv.shape[3]
    flat = kv.transpose(2, 3).reshape(2, b * s, nkv, d)  # rows in (row, position) order
    outs = []
    for i, seqs in enumerate(chunks):
        qc = q[:, :, i * c : (i + 1) * c].transpose(1, 2).reshape(b * c, nq, d)
        keys = flat.index_select(1, seqs.keys)  # the keys each sequence reads, back to back
        out = _varlen_causal(qc, keys[0], keys[1], seqs.cu_q, seqs.cu_k, seqs.max_q, seqs.max_k, enable_gqa, window)
        outs.append(out.view(b, c, nq, d))
    return torch.cat(outs, dim=1).transpose(1, 2)


@dataclass(frozen=True, eq=False)
class ChunkSequences:
    """One CP query chunk (c tokens from `start` of each row) as variable-length sequences: one per piece of a
    document inside the chunk, its queries the piece's tokens, its keys the document's tokens from its first up
    to the piece's last (so the causal mask aligned to the last key is the document's). In a row the pieces'
    key ranges follow each other from the first piece's document start to the chunk's end, so `keys` (rows of
    the flattened [b*S] keys) lists them back to back without repeats."""

    keys: torch.Tensor  # [total keys] int64
    cu_q: torch.Tensor  # [n+1] int32
    cu_k: torch.Tensor
    max_q: int
    max_k: int

    @classmethod
    def of_chunk(cls, rows: list[list[int]], start: int, c: int, s: int, device) -> ChunkSequences:
        """`rows[i]`: row i's document starts (ascending, with s appended)."""
        q_lens, k_lens, keys = [], [], []
        for i, bounds in enumerate(rows):
            first = None
            for ds, de in zip(bounds[:-1], bounds[1:]):
                if de <= start or ds >= start + c:
                    continue
                qs, qe = max(ds, start), min(de, start + c)
                first = ds if first is None else first
                q_lens.append(qe - qs)
                k_lens.append(qe - ds)
            keys.append(torch.arange(i * s + first, i * s + start + c))
        cu = lambda lens: torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)  # noqa: E731
        return cls(
            torch.cat(keys).to(device, non_blocking=True),
            cu(q_lens).to(device, non_blocking=True),
            cu(k_lens).to(device, non_blocking=True),
            max(q_lens),
            max(k_lens),
        )
