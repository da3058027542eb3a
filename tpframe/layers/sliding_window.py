"""Sliding-window attention: each query sees itself and the `window - 1` tokens before it.

    key j is visible to query i  iff  0 <= i - j < window

This is Mistral's and Phi-3's attention (Hugging Face's `sliding_window`; Megatron-Core's `window_size=(window-1, 0)`,
FlashAttention's left window window-1). On sequences of up to `window` tokens it equals full causal attention.

Two ways to compute it, the same numbers:
- on CUDA (no attention dropout, head dims of 16..256 in powers of two): `flex_attention` with a block mask, compiled
  once. Blocks wholly outside the band are skipped, so the work grows as s*window rather than s^2/2.
- elsewhere (the CPU, other head dims, dropout): SDPA with the dense [s, s] band mask.
Packed documents combine the band with their own mask (`tpframe/layers/documents.py`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from tpframe.layers.utils import eager

# flex_attention is imported where it runs: its module loads Dynamo, a second of every process's start


def band(q_len: int, k_len: int, window: int, *, device=None) -> torch.Tensor:
    """[q_len, k_len] bool, True where a query may attend a key; the queries are the last q_len of the k_len
    positions (so a chunk of queries over all earlier keys is right-aligned, as in generation)."""
    i = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    j = torch.arange(k_len, device=device)[None, :]
    return (j <= i) & (i - j < window)


def flex_usable(q: torch.Tensor, dropout_p: float) -> bool:
    """Whether `sliding_window_attention` takes flex_attention for q [b, n, s, d]."""
    d = q.shape[-1]
    return (
        q.is_cuda
        and dropout_p == 0
        and 16 <= d <= 256
        and d & (d - 1) == 0
        and q.dtype in (torch.bfloat16, torch.float16, torch.float32)
    )


def sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    *,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
    flex: bool = True,
) -> torch.Tensor:
    """Causal attention within `window`: q [b, nq, sq, d] over k and v [b, nkv, sk, d] -> [b, nq, sq, d]. The
    queries are the last sq of the sk positions (sq < sk: a context-parallel chunk over the keys before it).
    `flex=False`: the dense band mask even where flex_attention could run."""
    sq, sk = q.shape[-2], k.shape[-2]
    if sq == sk <= window:  # the window holds the whole row: plain causal attention (Flash, no mask)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=enable_gqa)
    if flex and flex_usable(q, dropout_p):
        return _flex_window(q, k, v, window, enable_gqa)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=band(sq, sk, window, device=q.device), dropout_p=dropout_p, enable_gqa=enable_gqa
    )


@eager  # eager inside a compiled block (as documents' varlen call): flex runs its own compiled kernel
def _flex_window(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, enable_gqa: bool) -> torch.Tensor:
    block_mask = _block_mask(q.shape[-2], k.shape[-2], window, str(q.device))
    return _compiled_flex()(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=16)
def _block_mask(sq: int, sk: int, window: int, device: str):
    """The band as flex_attention's block mask for sq queries at the last of sk positions (one per shape: every
    layer shares it)."""
    from torch.nn.attention.flex_attention import create_block_mask

    offset = sk - sq

    def in_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + offset) & (q_idx + offset - kv_idx < window)

    return create_block_mask(in_window, None, None, sq, sk, device=device)
