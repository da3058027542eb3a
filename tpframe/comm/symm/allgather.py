"""All-gather kernel over symmetric buffers: out[p*n : (p+1)*n] = rank p's x[:n].

stage x into our buffer -> barrier -> pull every rank's buffer (one 2-D load per tile, all peers in
flight together) into `out` -> barrier (peers are done reading our buffer before our next call may
overwrite it). Reads (WORLD-1)*n per rank from peers, only through peer addresses.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tpframe.comm.symm.allreduce import RUNTIME_ARGS
from tpframe.comm.symm.barrier import as_ptr, block_barrier, peer_ptr
from tpframe.comm.symm.tiles import copy_rows, copy_tile, peer_rows


@triton.jit(do_not_specialize=RUNTIME_ARGS)
def all_gather_kernel(
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
    """x: n elements, out: WORLD*n elements (N_ALIGNED: n is a multiple of VEC; `chunk` unused)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if N_ALIGNED:
        n = n // VEC * VEC  # == n; tells the compiler rows start 16-byte aligned
    tiles = tl.cdiv(n, BLOCK)
    if COPY_IN:
        x = as_ptr(x_addr, DT, X_ALIGNED)
        own = peer_ptr(buf_table, rank, DT)
        for t in range(pid, tiles, nprog):
            copy_tile(x, own, t * BLOCK, n, BLOCK)
    block_barrier(pad_table, rank, pid, WORLD)
    rows = tl.arange(0, WORLD)
    src_rows = peer_rows(buf_table, WORLD, DT)
    dst_rows = as_ptr(out_addr, DT, True) + rows * n
    row_len = rows * 0 + n
    for t in range(pid, tiles, nprog):
        copy_rows(src_rows, dst_rows, t * BLOCK, row_len, rows >= 0, t * BLOCK + BLOCK <= n, BLOCK)
    block_barrier(pad_table, rank, pid, WORLD)
