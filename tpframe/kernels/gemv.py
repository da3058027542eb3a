"""One token's linear layer, y = x W^T + b for x of one row: the batch-1 decode step's GEMMs, streaming the weight.

At one row a linear layer is a matrix-vector product bound by reading W once. cuBLAS's kernels for it leave much of
the HBM bandwidth unused at the decode shapes of a 1.3B model; here each program reads BLOCK_N whole weight rows in
[BLOCK_N, BLOCK_K] tiles along K (coalesced), multiplies with x on CUDA cores and sums in fp32, so thousands of
small programs keep the memory system busy. Inside CUDA graphs it takes less time than cuBLAS at every layer shape
measured; at 8 rows cuBLAS wins, so only one row takes it (benchmarks/RESULTS.md, 'One-row linear layers: tpframe's
kernel vs cuBLAS').

It runs only while a CUDA graph is being captured (the decode step's graph): an eager Triton launch costs more host
time than cuBLAS's, and an eager decode step is host-bound. For an MLP's first layer it also applies the activation
(SwiGLU's silu(gate) * up, GELU, ReLU) before its one store, which saves the activation's kernels. Plain-torch
twin: F.linear (then the activation).
"""

from __future__ import annotations

import torch

from tpframe.kernels import HAVE_TRITON, use_triton

BLOCK_N, BLOCK_K, WARPS, STAGES = 2, 1024, 4, 4  # the best of a sweep at every decode shape measured
SWIGLU_BLOCK_N = 1  # outputs per program with SwiGLU inside: each reads a gate and an up row per output
DTYPES = (torch.bfloat16, torch.float16, torch.float32)

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _row_linear(
        x,
        w,
        b,
        y,
        N,
        K,
        stride_w,
        HAS_BIAS: tl.constexpr,
        ACT: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """y[n] = act(sum_k w[n, k] x[k] + b[n]) for N outputs; ACT 1 (SwiGLU): the weight holds 2N rows, gate
        then up, and y[n] = silu(gate_n) * up_n."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + cols
            xv = tl.load(x + k, mask=k < K, other=0.0).to(tl.float32)
            inside = (rows[:, None] < N) & (k[None, :] < K)
            wv = tl.load(w + rows[:, None].to(tl.int64) * stride_w + k[None, :], mask=inside, other=0.0)
            acc += wv.to(tl.float32) * xv[None, :]
            if ACT == 1:
                uv = tl.load(w + (rows[:, None] + N).to(tl.int64) * stride_w + k[None, :], mask=inside, other=0.0)
                acc_up += uv.to(tl.float32) * xv[None, :]
        out = tl.sum(acc, axis=1)
        if HAS_BIAS:
            out += tl.load(b + rows, mask=rows < N, other=0.0).to(tl.float32)
        if ACT == 1:
            up = tl.sum(acc_up, axis=1)
            if HAS_BIAS:
                up += tl.load(b + N + rows, mask=rows < N, other=0.0).to(tl.float32)
            out = out * tl.sigmoid(out) * up
        elif ACT == 2:  # GELU, tanh approximation (tanh z = 2 sigmoid(2z) - 1)
            z = 0.7978845608028654 * (out + 0.044715 * out * out * out)
            out = out * tl.sigmoid(2.0 * z)
        elif ACT == 3:
            out = tl.maximum(out, 0.0)
        tl.store(y + rows, out.to(y.dtype.element_ty), mask=rows < N)


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `x @ weight.T` goes to the one-row kernel: one row, inference inside a CUDA-graph capture, weight
    rows contiguous, one of the kernel's dtypes (x's and the weight's)."""
    return (
        use_triton(x)
        and x.numel() == x.shape[-1]
        and not torch.is_grad_enabled()
        and x.dtype == weight.dtype
        and x.dtype in DTYPES
        and weight.stride(-1) == 1
        and torch.cuda.is_current_stream_capturing()
    )


ACTIVATIONS = {None: 0, "swiglu": 1, "gelu": 2, "relu": 3}


def row_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, activation: str | None = None
) -> torch.Tensor:
    """F.linear(x, weight, bias) for x holding one row ([..., K], every leading dim 1); weight [N, K].
    `activation` applies the MLP's activation in the same kernel: "gelu" (tanh approximation), "relu", or
    "swiglu", where the weight holds the gate rows then the up rows and the result is silu(gate) * up [..., N/2]."""
    n, k = weight.shape
    if x.numel() != k or x.shape[-1] != k:
        raise ValueError(
            f"row_linear: x {tuple(x.shape)} must hold one row of {k} features (weight {tuple(weight.shape)})"
        )
    if activation not in ACTIVATIONS:
        raise ValueError(f"row_linear: activation must be one of {list(ACTIVATIONS)}, got {activation!r}")
    if not HAVE_TRITON:
        raise RuntimeError("row_linear needs Triton")
    if activation == "swiglu":
        if n % 2:
            raise ValueError(f"row_linear: a SwiGLU weight holds gate and up rows, an even count, got {n}")
        n //= 2
    x1 = x.reshape(k)
    if not x1.is_contiguous():
        x1 = x1.contiguous()
    y = torch.empty(x.shape[:-1] + (n,), dtype=x.dtype, device=x.device)
    block_n = SWIGLU_BLOCK_N if activation == "swiglu" else BLOCK_N
    _row_linear[(triton.cdiv(n, block_n),)](
        x1,
        weight,
        bias if bias is not None else y,
        y,
        n,
        k,
        weight.stride(0),
        HAS_BIAS=bias is not None,
        ACT=ACTIVATIONS[activation],
        BLOCK_N=block_n,
        BLOCK_K=min(BLOCK_K, triton.next_power_of_2(k)),
        num_warps=WARPS,
        num_stages=STAGES,
    )
    return y
