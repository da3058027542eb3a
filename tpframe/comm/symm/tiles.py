"""Tile loops shared by the symmetric-memory kernels: copy tiles, sum a tile over every rank's buffer.

A tile is BLOCK contiguous elements (two 16-byte vectors per thread: 8 KiB at 8 warps). Tile t of a
region belongs to program t % nprog on every rank and in every phase of a kernel, so a program's
barrier only has to cover what the same program does on the peers. A tile is `full` when all its
elements are in range: full tiles move 16-byte vectors without a mask; the one partial tile at the
end of a region takes the masked (element-wise) path. Loads skip L1 (.cg): a source may be a buffer
that peers wrote during this launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tpframe.comm.symm.barrier import peer_ptr


@triton.jit
def copy_tile(src, dst, start, limit, BLOCK: tl.constexpr):
    """dst[start + i] = src[start + i] for i < BLOCK and start + i < limit."""
    offs = start + tl.arange(0, BLOCK)
    if start + BLOCK <= limit:
        tl.store(dst + offs, tl.load(src + offs, cache_modifier=".cg"))
    else:
        mask = offs < limit
        tl.store(dst + offs, tl.load(src + offs, mask=mask, cache_modifier=".cg"), mask=mask)


@triton.jit
def copy_rows(src_rows, dst_rows, start, row_len, row_ok, full, BLOCK: tl.constexpr):
    """For every row r with row_ok[r]: dst_rows[r][start + i] = src_rows[r][start + i], i < BLOCK and
    start + i < row_len[r]. src_rows, dst_rows: [R] pointers; all R rows' loads are issued before any
    store (one 2-D load), so R peers cost one round trip, not R. `full`: every row is in range."""
    cols = start + tl.arange(0, BLOCK)
    src = src_rows[:, None] + cols[None, :]
    dst = dst_rows[:, None] + cols[None, :]
    if full:  # a mask constant along each row: the loads stay 16-byte vectors
        mask = tl.broadcast_to(row_ok[:, None], src.shape)
        tl.store(dst, tl.load(src, mask=mask, cache_modifier=".cg"), mask=mask)
    else:
        mask = row_ok[:, None] & (cols[None, :] < row_len[:, None])
        tl.store(dst, tl.load(src, mask=mask, cache_modifier=".cg"), mask=mask)


@triton.jit
def peer_rows(buf_table, WORLD: tl.constexpr, DT: tl.constexpr):
    """Every rank's symmetric buffer, [WORLD] pointers to DT (buffers are page aligned)."""
    addrs = tl.load(buf_table.to(tl.pointer_type(tl.int64)) + tl.arange(0, WORLD))
    return tl.multiple_of(addrs.to(tl.pointer_type(DT)), [16])


@triton.jit
def load_sum(buf_table, src_off, limit, BLOCK: tl.constexpr, DT: tl.constexpr, WORLD: tl.constexpr):
    """The fp32 sum over ranks p = 0..WORLD-1 (in that order on every rank, so all ranks round alike)
    of buffer_p[src_off + i], i < BLOCK, and the mask of the lanes in range (src_off + i < limit)."""
    offs = src_off + tl.arange(0, BLOCK)
    mask = offs < limit
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    if src_off + BLOCK <= limit:
        for p in tl.static_range(WORLD):
            acc += tl.load(peer_ptr(buf_table, p, DT) + offs, cache_modifier=".cg").to(tl.float32)
    else:
        for p in tl.static_range(WORLD):
            acc += tl.load(peer_ptr(buf_table, p, DT) + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    return acc, mask


@triton.jit
def store_tile(dst, start, value, mask, full):
    """dst[start + i] = value[i]: every lane when `full`, else the lanes in `mask`."""
    offs = start + tl.arange(0, value.shape[0])
    if full:
        tl.store(dst + offs, value)
    else:
        tl.store(dst + offs, value, mask=mask)
