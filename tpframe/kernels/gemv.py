"""One token's linear layer, y = x W^T + b for x of one row: the batch-1 decode step's GEMMs, streaming the weight.

At one row a linear layer is a matrix-vector product bound by reading W once. cuBLAS's kernels for it reach ~60-70%
of HBM bandwidth at the decode shapes of a 1.3B model; here each program reads BLOCK_N whole weight rows in
[BLOCK_N, BLOCK_K] tiles along K (coalesced), multiplies with x on CUDA cores and sums in fp32, so thousands of
small programs keep the memory system busy. Measured on an H100 inside CUDA graphs (benchmarks/RESULTS.md,
"One-row linear layers"): 0.67-0.89x of cuBLAS's time per layer; at 8 rows cuBLAS wins, so only one row takes it.

It runs only while a CUDA graph is being captured (the decode step's graph): an eager Triton launch costs more host
time than cuBLAS's, and an eager decode step is host-bound. Plain-torch twin: F.linear.
"""

from __future__ import annotations

import torch

from tpframe.kernels import HAVE_TRITON, use_triton

BLOCK_N, BLOCK_K, WARPS, STAGES = 2, 1024, 4, 4  # the best of a sweep at every decode shape measured
DTYPES = (torch.bfloat16, torch.float16, torch.float32)

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _row_linear(x, w, b, y, N, K, stride_w, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + cols
            xv = tl.load(x + k, mask=k < K, other=0.0).to(tl.float32)
            wv = tl.load(w + rows[:, None].to(tl.int64) * stride_w + k[None, :],
                         mask=(rows[:, None] < N) & (k[None, :] < K), other=0.0)
            acc += wv.to(tl.float32) * xv[None, :]
        out = tl.sum(acc, axis=1)
        if HAS_BIAS:
            out += tl.load(b + rows, mask=rows < N, other=0.0).to(tl.float32)
        tl.store(y + rows, out.to(y.dtype.element_ty), mask=rows < N)


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `x @ weight.T` goes to the one-row kernel: one row, inference inside a CUDA-graph capture, weight
    rows contiguous, one of the kernel's dtypes (x's and the weight's)."""
    return (use_triton(x) and x.numel() == x.shape[-1] and not torch.is_grad_enabled()
            and x.dtype == weight.dtype and x.dtype in DTYPES and weight.stride(-1) == 1
            and torch.cuda.is_current_stream_capturing())


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x holding one row ([..., K], every leading dim 1); weight [N, K]."""
    n, k = weight.shape
    if x.numel() != k or x.shape[-1] != k:
        raise ValueError(f"row_linear: x {tuple(x.shape)} must hold one row of {k} features "
                         f"(weight {tuple(weight.shape)})")
    if not HAVE_TRITON:
        raise RuntimeError("row_linear needs Triton")
    x1 = x.reshape(k)
    if not x1.is_contiguous():
        x1 = x1.contiguous()
    y = torch.empty(x.shape[:-1] + (n,), dtype=x.dtype, device=x.device)
    _row_linear[(triton.cdiv(n, BLOCK_N),)](
        x1, weight, bias if bias is not None else y, y, n, k, weight.stride(0), HAS_BIAS=bias is not None,
        BLOCK_N=BLOCK_N, BLOCK_K=min(BLOCK_K, triton.next_power_of_2(k)), num_warps=WARPS, num_stages=STAGES)
    return y
