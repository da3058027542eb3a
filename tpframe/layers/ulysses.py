"""Context parallelism by all-to-all (DeepSpeed-Ulysses; Megatron-Core's cp_comm_type a2a): `parallel.cp_comm=
all_to_all`, beside the all-gather of tpframe/layers/context.py.

A CP rank holds its two chunks of each sequence (context.py's load-balanced split) for all of its TP rank's heads.
Around attention one all-to-all trades the split: afterwards the rank holds the whole sequence for 1/cp of those
heads and attends exactly as one process would (causal, sliding window, packed documents: no chunk bookkeeping);
a second all-to-all hands each query's output back to the rank that owns its token:

    q [b, nq, S/cp, d], k, v [b, nkv, S/cp, d] --all-to-all--> [b, nq/cp, S, d], [b, nkv/cp, S, d]
      --attention over the whole sequence--> [b, nq/cp, S, d] --all-to-all--> [b, nq, S/cp, d]

Per layer a rank sends about (S/cp)(2 nq + 2 nkv) d elements (q, k, v, then the output) where the all-gather
receives 2 S nkv d: fewer bytes with many kv heads (MHA at cp >= 2), more under strong GQA. Backward sends the
gradients back the same ways. The query heads per TP rank must divide by cp (`check_all_to_all`); kv heads that
cp does not divide are repeated first (the fewest copies that make it divide), their gradients summed back.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from tpframe.comm import Communicator
from tpframe.layers.context import order_chunks
from tpframe.layers.mappings import all_to_all
from tpframe.layers.utils import eager


def kv_copies(kv_heads: int, cp: int) -> int:
    """Copies of each kv head for the exchange: the fewest f with cp dividing kv_heads*f (with cp dividing the
    query heads, f divides the group size, so every query head still meets its own kv head)."""
    return cp // math.gcd(kv_heads, cp)


@eager  # eager inside a compiled block, as the all-gather CP attention
def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    comm: Communicator,
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """This CP rank's q [b, nq, 2c, d], k and v [b, nkv, 2c, d] (its chunks, rotary applied at their global
    positions) -> [b, nq, 2c, d]: `attend(q, k, v)` runs on the whole sequence [b, n/cp, S, d] of this rank's
    share of the heads (rank j: query heads j*nq/cp ..., and the kv heads they read)."""
    cp = comm.size
    if q.shape[1] % cp:
        raise ValueError(f"cp_comm all_to_all: {q.shape[1]} query heads (per TP rank) do not split over cp={cp}")
    if (f := kv_copies(k.shape[1], cp)) > 1:
        k, v = (t.repeat_interleave(f, dim=1) for t in (k, v))
    nq, nkv = q.shape[1] // cp, k.shape[1] // cp
    # [cp, b, nq/cp + 2 nkv/cp, 2c, d]: block j (rank j's heads of q, k and v) goes to rank j
    send = torch.cat([t.unflatten(1, (cp, -1)) for t in (q, k, v)], dim=2).movedim(1, 0)
    got = all_to_all(send.contiguous(), comm, [1] * cp, [1] * cp)  # block i: rank i's tokens of my heads
    whole = order_chunks(got)  # [b, nq/cp + 2 nkv/cp, S, d], the sequence in order
    out = attend(*whole.split([nq, nkv, nkv], dim=1))  # [b, nq/cp, S, d]
    c = out.shape[-2] // (2 * cp)
    owners = [j for pair in zip(range(cp), range(2 * cp - 1, cp - 1, -1)) for j in pair]  # 0, 2cp-1, 1, 2cp-2 ...
    back = out.unflatten(-2, (2 * cp, c))[:, :, owners]  # [b, nq/cp, 2cp, c, d]: rank j's chunks at 2j, 2j+1
    back = back.unflatten(2, (cp, 2)).flatten(3, 4).movedim(2, 0)  # [cp, b, nq/cp, 2c, d]
    mine = all_to_all(back.contiguous(), comm, [1] * cp, [1] * cp)  # block i: my tokens of rank i's heads
    return mine.movedim(0, 1).flatten(1, 2)  # [b, nq, 2c, d]
