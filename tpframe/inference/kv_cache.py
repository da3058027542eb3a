"""A preallocated KV cache for a batch of sequences, sharded by TP heads like the attention it serves.

    cache = KVCache(layer_ids, batch=b, kv_heads=nkv/tp, head_dim=d, max_len=L, dtype=..., device=...)
    cache.reset(start)         # start [b]: first real slot of each (left-padded) row
    cache.begin(s)             # slots, positions and mask of the next s tokens of every row
    logits = model(ids, cache=cache)   # attention appends to cache.layer(i) and reads every slot
    cache.advance(s)

Rows are left-padded to one length, so every row writes the same slot at each step: row i's token in
slot t has position t - start[i], and its queries see the slots start[i]..t (a pad query sees only
itself, so no row of the softmax is empty). Slots past the write position hold stale or zero values
that the mask hides. A layer with a sliding window asks for `window_mask(w)`: the mask also hiding slots w
or more behind each query (made once per step and window). All state is in device tensors updated in place, so a
CUDA graph of a decode step (`begin(1)`, forward, `advance(1)`) replays correctly at every position.
"""

from __future__ import annotations

import torch

from tpframe.kernels import kv_write


class LayerCache:
    """One layer's keys and values [b, nkv/tp, L, d]; `append` writes this step's slots."""

    def __init__(self, owner: KVCache, k: torch.Tensor, v: torch.Tensor):
        self.owner, self.k, self.v = owner, k, v

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [b, nkv/tp, s, d] into the slots of `begin(s)`; returns the whole cache [b, nkv/tp, L, d].
        Inside a decode step's CUDA graph one kernel writes both (tpframe/kernels/kv_write.py)."""
        if kv_write.takes(k, v, self.k):
            kv_write.kv_write(k, v, self.k, self.v, self.owner.index)
        else:
            self.k.index_copy_(2, self.owner.index, k.to(self.k.dtype))
            self.v.index_copy_(2, self.owner.index, v.to(self.v.dtype))
        return self.k, self.v

    @property
    def mask(self) -> torch.Tensor:
        return self.owner.mask

    def window_mask(self, window: int) -> torch.Tensor:
        return self.owner.window_mask(window)


class KVCache:
    """Keys and values of every layer for `batch` sequences of up to `max_len` slots."""

    def __init__(
        self,
        layer_ids,
        *,
        batch: int,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        if batch < 1 or max_len < 1:
            raise ValueError(f"a KV cache needs batch >= 1 and max_len >= 1, got batch={batch}, max_len={max_len}")
        self.batch, self.max_len = batch, max_len
        shape = (batch, kv_heads, max_len, head_dim)
        self.layers = {
            str(i): LayerCache(
                self, torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
            )
            for i in layer_ids
        }
        self.dtype = dtype
        self.slot = torch.zeros((), dtype=torch.long, device=device)  # the next slot to write
        self.start = torch.zeros(batch, dtype=torch.long, device=device)
        self._slots = torch.arange(max_len, device=device)
        self.index = self.positions = self.mask = None
        self._windowed: dict[int, torch.Tensor] = {}

    def reset(self, start: torch.Tensor) -> None:
        """A new batch: row i's real tokens begin at slot start[i] (in place: graphs keep their pointers)."""
        self.slot.zero_()
        self.start.copy_(start)

    def begin(self, seq_len: int) -> None:
        """Prepare the next `seq_len` tokens of every row: their slots `index` [s], positions [b, s]
        and the attention mask [b, 1, s, L], additive in the cache's dtype (0 where the query may attend,
        -inf elsewhere): made once per step, not converted from booleans by every layer's SDPA."""
        index = self.slot + self._slots[:seq_len]
        keys = self._slots.view(1, 1, -1)
        causal = keys <= index.view(1, -1, 1)
        real = keys >= self.start.view(-1, 1, 1)
        itself = keys == index.view(1, -1, 1)
        self.index = index
        self.positions = (index.view(1, -1) - self.start.view(-1, 1)).clamp_(min=0)
        visible = (causal & (real | itself)).unsqueeze(1)
        self.mask = torch.zeros(visible.shape, dtype=self.dtype, device=visible.device)
        self.mask.masked_fill_(~visible, float("-inf"))
        self._windowed = {}

    def window_mask(self, window: int) -> torch.Tensor:
        """This step's mask [b, 1, s, L] for a sliding window of `window` tokens: the slots at least `window`
        behind a query hidden too (a query always keeps itself). One per window and step, shared by the layers."""
        if window not in self._windowed:
            far = self._slots.view(1, 1, 1, -1) <= self.index.view(1, 1, -1, 1) - window
            self._windowed[window] = self.mask.masked_fill(far, float("-inf"))
        return self._windowed[window]

    def advance(self, seq_len: int) -> None:
        self.slot += seq_len

    def layer(self, i) -> LayerCache:
        return self.layers[str(i)]
