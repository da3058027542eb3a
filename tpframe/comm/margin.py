"""GEMMs launched beside a collective in flight: leave `sms` streaming multiprocessors to the collective.

cuBLAS's Hopper GEMMs are persistent: one CTA per SM, each using the whole register file, with tiles assigned
statically. A communication kernel that already holds SMs (NCCL's CTAs, for the collective's whole duration) keeps
those GEMM CTAs from starting until it ends, and the two then slow each other: a GEMM beside a copy kernel that
holds a few SMs took longer than the two one after the other; with the GEMM told to use fewer SMs the copy ran on
the SMs left free and the two overlapped (benchmarks/RESULTS.md, 'GEMMs beside communication: the SM contention,
and the SM margin that cures it'). torch exposes that as cuBLASLt's SM count target (`_set_sm_carveout_experimental`,
honoured by the cuBLASLt path only, so the window also routes plain matmuls there).

`comm.overlap_sm_margin` (Communicator.overlap_sm_margin, default 32) sets `sms` for the GEMMs that hide a TP
collective: async TP's ring, and the column ring's weight-gradient GEMM beside the input gradient's reduce-scatter;
0 lets them use every SM. With NCCL's own kernels on two GPUs a ring step's send/receive pair overlapped the GEMM
only with 32 SMs left free (with fewer it barely did), and GPT-1.3B at TP=2 + SP with the ring beat the plain path
only at margin 32, hence the default (benchmarks/RESULTS.md, 'Async TP over the NCCL ring, the SM margin, and the
DTensor peer'). The GEMM alone is slower with SMs left free, so only GEMMs with a collective in flight get the
margin.
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
