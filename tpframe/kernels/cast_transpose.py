"""The rowwise float8 copy of a tensor's transpose in two passes over it, for the GEMMs that contract over tokens:

    t8, inv = torch.ops.tpframe.cast_transpose(t)   # t [M, K] bf16 -> float8 e4m3 of t^T [K, M] row-major,
                                                    # and its fp32 inverse scales [K, 1] (CUDA; `usable(t)`)

Each row of t^T (a column of t) gets a power-of-two scale that maps its absolute maximum to e4m3's largest value,
as `tpframe.layers.fp8.quantize(t.t(), "rowwise")` computes it (the plain-torch twin: the CPU path and the tests'
oracle): the same bytes. The first pass takes every column's maximum (programs over column strips and row chunks,
combined with atomic maxima); the second reads t in tiles, scales and casts them, and writes each tile transposed,
so both the reads and the writes are whole rows of memory. It is a triton_op: under torch.compile Inductor launches
both kernels from its own code: as a plain custom op their Python launches (two per transposed operand, three
operands per GEMM) left the 7B-class TP=4 step host-bound and slower than Inductor's own code for the same
expression; as a triton_op the step is faster than with Inductor's code (benchmarks/RESULTS.md, "float8 beside
torchao's").
"""

from __future__ import annotations

import torch

from tpframe.kernels import HAVE_TRITON

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max
BLOCK_M, BLOCK_K = 64, 64  # the second pass's tile (bf16: 8 KiB); the first pass's is AMAX_BLOCK_M x BLOCK_K
AMAX_BLOCK_M = 128  # 46 against 55 us at 8192x4096 on an H200; the second pass's tile mattered less than 10%
ROW_CHUNKS = 32  # programs along M in the first pass: enough to fill the GPU for narrow tensors

if HAVE_TRITON:
    import triton
    import triton.language as tl
    from torch.library import wrap_triton

    @triton.jit
    def _column_amax(t, amax, M, K, rows_per_program, BM: tl.constexpr, BK: tl.constexpr):
        cols = tl.program_id(0) * BK + tl.arange(0, BK)
        first = tl.program_id(1) * rows_per_program
        acc = tl.zeros([BK], dtype=tl.float32)
        for m in range(0, rows_per_program, BM):  # rows_per_program: a multiple of BM
            rows = first + m + tl.arange(0, BM)
            inside = (rows[:, None] < M) & (cols[None, :] < K)
            v = tl.load(t + rows[:, None].to(tl.int64) * K + cols[None, :], mask=inside, other=0.0)
            acc = tl.maximum(acc, tl.max(tl.abs(v.to(tl.float32)), axis=0))
        tl.atomic_max(amax + cols, acc, mask=cols < K)

    @triton.jit
    def _scaled_transpose(t, amax, out, inv, M, K, LIMIT: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BK + tl.arange(0, BK)
        # scale = 2^floor(log2(LIMIT / amax)), from the exponent bits: exact, as torch's log2/floor/exp2 on a float
        ratio = LIMIT / tl.maximum(tl.load(amax + cols, mask=cols < K, other=1.0), 1e-12)
        exponent = ((ratio.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        scale = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
        if tl.program_id(0) == 0:
            tl.store(inv + cols, 1.0 / scale, mask=cols < K)
        inside = (rows[:, None] < M) & (cols[None, :] < K)
        v = tl.load(t + rows[:, None].to(tl.int64) * K + cols[None, :], mask=inside, other=0.0)
        q = v.to(tl.float32) * scale[None, :]  # a power of two: exact, as the twin's product in t's dtype
        q = tl.minimum(tl.maximum(q, -LIMIT), LIMIT).to(out.dtype.element_ty)
        inside_t = (cols[:, None] < K) & (rows[None, :] < M)
        tl.store(out + cols[:, None].to(tl.int64) * M + rows[None, :], tl.trans(q), mask=inside_t)  # along M

    @torch.library.triton_op("tpframe::cast_transpose", mutates_args=())
    def cast_transpose_op(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A triton_op, so that under torch.compile Inductor launches both kernels from its own code (a custom op's
        Python launches, 72 pairs a step at the 7B-class TP=4 rank, made that step host-bound)."""
        t = t.contiguous()
        m, k = t.shape
        amax = torch.zeros(k, dtype=torch.float32, device=t.device)
        rows_per_program = triton.cdiv(triton.cdiv(m, ROW_CHUNKS), AMAX_BLOCK_M) * AMAX_BLOCK_M
        wrap_triton(_column_amax)[(triton.cdiv(k, BLOCK_K), triton.cdiv(m, rows_per_program))](
            t, amax, m, k, rows_per_program, BM=AMAX_BLOCK_M, BK=BLOCK_K
        )
        out = torch.empty(k, m, dtype=torch.float8_e4m3fn, device=t.device)
        inv = torch.empty(k, 1, dtype=torch.float32, device=t.device)
        wrap_triton(_scaled_transpose)[(triton.cdiv(m, BLOCK_M), triton.cdiv(k, BLOCK_K))](
            t, amax, out, inv, m, k, LIMIT=E4M3_MAX, BM=BLOCK_M, BK=BLOCK_K
        )
        return out, inv


def usable(t: torch.Tensor) -> bool:
    """Whether the kernels can take `t`: a 2-D CUDA tensor with Triton importable (else callers take the twin)."""
    return HAVE_TRITON and t.is_cuda and t.dim() == 2
