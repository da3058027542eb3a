"""Reduce-scatter (sum) kernel over symmetric buffers: out[i] = sum over ranks p of x_p[rank*n + i].

stage all WORLD*n elements of x into our buffer -> barrier -> sum our chunk of every rank's buffer
(fixed rank order, so the result does not depend on who computes it) -> barrier (peers are done
reading our buffer). Reads (WORLD-1)*n per rank from peers, only through peer addresses.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tpframe.comm.symm.allreduce import RUNTIME_ARGS
from tpframe.comm.symm.barrier import as_ptr, block_barrier, peer_ptr
from tpframe.comm.symm.tiles import copy_rows, load_sum, store_tile


@triton.jit(do_not_specialize=RUNTIME_ARGS)
def reduce_scatter_kernel(
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
    """x: WORLD*n elements, out: n elements (N_ALIGNED: n is a multiple of VEC; `chunk` unused)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if N_ALIGNED:
        n = n // VEC * VEC  # == n; tells the compiler rows start 16-byte aligned
    tiles = tl.cdiv(n, BLOCK)
    if COPY_IN:
        x = as_ptr(x_addr, DT, X_ALIGNED)
        own = peer_ptr(buf_table, rank, DT)
        rows = tl.arange(0, WORLD)
        row_start = rows * n
        for t in range(pid, tiles, nprog):
            copy_rows(x + row_start, own + row_start, t * BLOCK, rows * 0 + n, rows >= 0, t * BLOCK + BLOCK <= n, BLOCK)
    block_barrier(pad_table, rank, pid, WORLD)
    out = as_ptr(out_addr, DT, True)
    for t in range(pid, tiles, nprog):
        acc, mask = load_sum(buf_table, rank * n + t * BLOCK, rank * n + n, BLOCK, DT, WORLD)
        store_tile(out, t * BLOCK, acc.to(DT), mask, t * BLOCK + BLOCK <= n)
    block_barrier(pad_table, rank, pid, WORLD)
