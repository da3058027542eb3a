"""All-reduce (sum) kernels over symmetric buffers: one-shot for small messages, two-shot for large.

Both read and write peers' buffers only through the peer addresses in `buf_table` (no multicast) and
stage the input into this rank's buffer inside the same launch (skipped when COPY_IN is False: the
caller wrote the input straight into the symmetric buffer). `out` is an ordinary tensor of n elements.

one-shot:  stage -> barrier -> every rank sums all WORLD buffers itself -> barrier (peers are done
           reading our buffer before our next call may overwrite it). Reads (WORLD-1)*n per rank.
push:      write x into a slot of every peer's buffer (NVLink writes are posted: no round trip) ->
           barrier -> sum the WORLD slots of our own buffer (local reads) -> barrier. Writes
           (WORLD-1)*n per rank; needs a buffer of WORLD slots.
two-shot:  stage -> barrier -> rank r sums chunk r of every buffer and pushes the sum into chunk r
           of every peer's buffer -> barrier -> copy the other chunks out of our own buffer -> barrier.
           Moves 2*(WORLD-1)/WORLD*n per rank.
Every kernel ends with a barrier after its last access to any buffer, so when a kernel returns no peer
still touches this call's data, and the next kernel may write into peers' buffers from its start.
Kernel signature (shared by every data kernel, see launch.py): runtime int args
(x_addr, out_addr, buf_table, pad_table, n, chunk, rank), then the constexprs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tpframe.comm.symm.barrier import as_ptr, block_barrier, peer_ptr
from tpframe.comm.symm.tiles import copy_rows, copy_tile, load_sum, store_tile

RUNTIME_ARGS = ("x_addr", "out_addr", "buf_table", "pad_table", "n", "chunk", "rank")


@triton.jit(do_not_specialize=RUNTIME_ARGS)
def one_shot_all_reduce_kernel(
    x_addr: tl.int64,
    out_addr: tl.int64,
    buf_table: tl.int64,
    pad_table: tl.int64,
    n: tl.int32,
    chunk: tl.int32,
    rank: tl.int32,
    DT: tl.constexpr,
    VEC: tl.constexpr,
    WORLD: tl.constexpr,
    BLOCK: tl.constexpr,
    COPY_IN: tl.constexpr,
    X_ALIGNED: tl.constexpr,
    N_ALIGNED: tl.constexpr,
):
    """out[:n] = sum over ranks of x[:n]  (x, out: n elements of DT; `chunk` unused)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    own = peer_ptr(buf_table, rank, DT)
    if COPY_IN:
        x = as_ptr(x_addr, DT, X_ALIGNED)
        for t in range(pid, tl.cdiv(n, BLOCK), nprog):
            copy_tile(x, own, t * BLOCK, n, BLOCK)
    block_barrier(pad_table, rank, pid, WORLD)
    out = as_ptr(out_addr, DT, True)
    for t in range(pid, tl.cdiv(n, BLOCK), nprog):
        acc, mask = load_sum(buf_table, t * BLOCK, n, BLOCK, DT, WORLD)
        store_tile(out, t * BLOCK, acc.to(DT), mask, t * BLOCK + BLOCK <= n)
    block_barrier(pad_table, rank, pid, WORLD)


@triton.jit(do_not_specialize=RUNTIME_ARGS)
def two_shot_all_reduce_kernel(
    x_addr: tl.int64,
    out_addr: tl.int64,
    buf_table: tl.int64,
    pad_table: tl.int64,
    n: tl.int32,
    chunk: tl.int32,
    rank: tl.int32,
    DT: tl.constexpr,
    VEC: tl.constexpr,
    WORLD: tl.constexpr,
    BLOCK: tl.constexpr,
    COPY_IN: tl.constexpr,
    X_ALIGNED: tl.constexpr,
    N_ALIGNED: tl.constexpr,
):
    """out[:n] = sum over ranks of x[:n]; rank r reduces chunk r = [r*chunk, (r+1)*chunk) (chunk: a
    multiple of VEC, 16 bytes of DT, with WORLD*chunk >= n)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    chunk = chunk // VEC * VEC  # == chunk; tells the compiler it is a multiple of VEC (16-byte vectors)
    tiles = tl.cdiv(chunk, BLOCK)
    rows = tl.arange(0, WORLD)
    row_start = rows * chunk
    row_len = tl.minimum(n - row_start, chunk)
    last_len = n - (WORLD - 1) * chunk  # the shortest chunk; a tile is full in every chunk below it
    own = peer_ptr(buf_table, rank, DT)
    out = as_ptr(out_addr, DT, True)
    if COPY_IN:
        x = as_ptr(x_addr, DT, X_ALIGNED)
        for t in range(pid, tiles, nprog):
            copy_rows(
                x + row_start, own + row_start, t * BLOCK, row_len, rows >= 0, t * BLOCK + BLOCK <= last_len, BLOCK
            )
    block_barrier(pad_table, rank, pid, WORLD)
    end = tl.minimum(rank * chunk + chunk, n)
    for t in range(pid, tiles, nprog):
        start = rank * chunk + t * BLOCK
        acc, mask = load_sum(buf_table, start, end, BLOCK, DT, WORLD)
        total = acc.to(DT)
        full = start + BLOCK <= end
        store_tile(out, start, total, mask, full)
        for p in tl.static_range(WORLD):
            if p != rank:
                store_tile(peer_ptr(buf_table, p, DT), start, total, mask, full)
    block_barrier(pad_table, rank, pid, WORLD)
    for t in range(pid, tiles, nprog):
        copy_rows(
            own + row_start, out + row_start, t * BLOCK, row_len, rows != rank, t * BLOCK + BLOCK <= last_len, BLOCK
        )
    block_barrier(pad_table, rank, pid, WORLD)


@triton.jit(do_not_specialize=RUNTIME_ARGS)
def push_all_reduce_kernel(
    x_addr: tl.int64,
    out_addr: tl.int64,
    buf_table: tl.int64,
    pad_table: tl.int64,
    n: tl.int32,
    chunk: tl.int32,
    rank: tl.int32,
    DT: tl.constexpr,
    VEC: tl.constexpr,
    WORLD: tl.constexpr,
    BLOCK: tl.constexpr,
    COPY_IN: tl.constexpr,
    X_ALIGNED: tl.constexpr,
    N_ALIGNED: tl.constexpr,
):
    """out[:n] = sum over ranks of x[:n]. Rank q's buffer holds WORLD slots of `chunk` elements (a multiple
    of VEC, >= n): slot s holds the input of rank (q - s) mod WORLD, so slot 0 is q's own input (where a
    zero-copy caller wrote it) and rank r writes into slot (q - r) mod WORLD of peer q."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    chunk = chunk // VEC * VEC  # == chunk; tells the compiler slots start 16-byte aligned
    own = peer_ptr(buf_table, rank, DT)
    for t in range(pid, tl.cdiv(n, BLOCK), nprog):
        offs = t * BLOCK + tl.arange(0, BLOCK)
        full = t * BLOCK + BLOCK <= n
        mask = offs < n
        if COPY_IN:
            x = as_ptr(x_addr, DT, X_ALIGNED)
            if full:
                vals = tl.load(x + offs)
            else:
                vals = tl.load(x + offs, mask=mask)
            store_tile(own, t * BLOCK, vals, mask, full)
        else:
            if full:
                vals = tl.load(own + offs)
            else:
                vals = tl.load(own + offs, mask=mask)
        for q in tl.static_range(WORLD):
            if q != rank:
                slot = (q - rank + WORLD) % WORLD
                store_tile(peer_ptr(buf_table, q, DT) + slot * chunk, t * BLOCK, vals, mask, full)
    block_barrier(pad_table, rank, pid, WORLD)
    out = as_ptr(out_addr, DT, True)
    for t in range(pid, tl.cdiv(n, BLOCK), nprog):
        offs = t * BLOCK + tl.arange(0, BLOCK)
        full = t * BLOCK + BLOCK <= n
        mask = offs < n
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for p in tl.static_range(WORLD):  # in rank order, like every other kernel: all ranks round alike
            src = own + ((rank - p + WORLD) % WORLD) * chunk
            if full:
                acc += tl.load(src + offs, cache_modifier=".cg").to(tl.float32)
            else:
                acc += tl.load(src + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        store_tile(out, t * BLOCK, acc.to(DT), mask, full)
    block_barrier(pad_table, rank, pid, WORLD)
