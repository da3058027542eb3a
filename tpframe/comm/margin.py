"""GEMMs launched beside a collective in flight: leave `sms` streaming multiprocessors to the collective.

cuBLAS's Hopper GEMMs are persistent: one CTA per SM, each using the whole register file, with tiles assigned
statically. A communication kernel that already holds SMs (NCCL's CTAs, for the collective's whole duration) keeps
those GEMM CTAs from starting until it ends, and the two then slow each other: on one H100, a [8192 x 2048] x
[2048 x 3072] bf16 GEMM (136 us) beside a 16-CTA copy kernel (136 us alone) took 404 us together, more than one
after the other (benchmarks/overlap.py; RESULTS.md). With the GEMM told to use 16 fewer SMs it took 183 us: the
copy ran on the SMs left free. torch exposes that as cuBLASLt's SM count target (`_set_sm_carveout_experimental`,
honoured by the cuBLASLt path only, so the window also routes plain matmuls there).

`comm.overlap_sm_margin` (Communicator.overlap_sm_margin, default 32) sets `sms` for the GEMMs that hide a TP
collective: async TP's ring, and the column ring's weight-gradient GEMM beside the input gradient's reduce-scatter;
0 lets them use every SM. On 2x H200 with NCCL's own kernels (`torchrun --nproc-per-node 2
benchmarks/overlap.py`) the same GEMM beside a 32 MiB send/receive pair (a ring step) took 1.01x of the two one after
the other with no margin, 0.97x / 0.93x / 0.60x with 8 / 16 / 32 SMs left free; beside a 64 MiB reduce-scatter 0.97x,
0.91x, 0.87x, 0.73x. GPT-1.3B at TP=2 + SP with the ring: 157.5 ms per forward+backward at margin 0, 158.4 at 16,
153.6 at 32, against 157.2 for the plain path (RESULTS.md), hence 32. The GEMM alone is ~22% slower with 32 SMs
left free, so only GEMMs with a collective in flight get the margin.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

_C = torch._C


@contextmanager
def gemm_sm_margin(sms: int, device: torch.device | None = None):
    """GEMMs launched inside leave `sms` SMs free (CUDA; a no-op for sms <= 0, on CPU, or when tracing)."""
    if sms <= 0 or device is None or device.type != "cuda" or torch.compiler.is_compiling():
        yield
        return
    backend, carveout = _C._get_blas_preferred_backend(), _C._get_sm_carveout_experimental()
    _C._set_blas_preferred_backend(_C._BlasBackend.Cublaslt)
    _C._set_sm_carveout_experimental(sms)
    try:
        yield
    finally:
        _C._set_sm_carveout_experimental(carveout)
        _C._set_blas_preferred_backend(backend)
