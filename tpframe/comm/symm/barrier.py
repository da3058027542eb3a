"""Signal-pad barriers between the same program of every rank, and the small device helpers they share.

Signal pads are the int32 arrays torch allocates next to each symmetric buffer, mapped on every peer.
Slot `pad_r[block * WORLD + p]` counts the signals rank p's program `block` has sent to rank r, minus
the waits rank r's program `block` has started on it:

  - signal: a release atomic add of +1 on the peer's slot (fire and forget: no round trip);
  - wait:   an acquire atomic add of -1 on our own slot; if nothing had arrived yet (the old value
            was < 1), spin with acquire reads until the peer's +1 lands (the value is back to >= 0).

Every signal is matched by one wait, so every slot is zero again once all ranks have passed the
same barriers: the pads need no reset between calls, and a CUDA graph can replay them.
Release is cumulative: `tl.debug_barrier()` (bar.sync) first makes every thread's earlier loads and
stores of this program happen before the signalling thread's release; after the acquire the same
bar.sync makes every thread's later accesses happen after it.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def table_entry(table_addr, idx):
    """Entry `idx` of a device array of int64 (an address in a table of peer addresses)."""
    return tl.load(table_addr.to(tl.pointer_type(tl.int64)) + idx)


@triton.jit
def as_ptr(addr, DT: tl.constexpr, ALIGNED: tl.constexpr):
    """An int64 address as a pointer to DT; ALIGNED tells the compiler it is 16-byte aligned (16-byte loads)."""
    ptr = addr.to(tl.pointer_type(DT))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def peer_ptr(table_addr, peer, DT: tl.constexpr):
    """Rank `peer`'s symmetric buffer, mapped here (buffers are page aligned)."""
    return as_ptr(table_entry(table_addr, peer), DT, True)


@triton.jit
def block_barrier(pad_table, rank, block, WORLD: tl.constexpr):
    """Program `block` of every rank meets here: earlier accesses by this program (release) are
    complete before any peer's program `block` passes, and peers' earlier writes are visible after (acquire)."""
    tl.debug_barrier()
    for p in tl.static_range(WORLD):
        if p != rank:
            peer_pad = table_entry(pad_table, p).to(tl.pointer_type(tl.int32))
            tl.atomic_add(peer_pad + block * WORLD + rank, 1, sem="release", scope="sys")
    own_pad = table_entry(pad_table, rank).to(tl.pointer_type(tl.int32))
    for p in tl.static_range(WORLD):
        if p != rank:
            slot = own_pad + block * WORLD + p
            if tl.atomic_add(slot, -1, sem="acquire", scope="sys") < 1:
                while tl.atomic_add(slot, 0, sem="acquire", scope="sys") < 0:
                    pass
    tl.debug_barrier()


@triton.jit(do_not_specialize=["pad_table", "rank"])
def barrier_kernel(pad_table: tl.int64, rank: tl.int32, WORLD: tl.constexpr):
    """A device barrier over the group, ordered on the launching stream (one program)."""
    block_barrier(pad_table, rank, 0, WORLD)
