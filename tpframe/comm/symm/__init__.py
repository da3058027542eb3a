"""Symmetric-memory collectives: Triton kernels over torch.distributed._symmetric_memory buffers.

Importing this package needs neither Triton nor a GPU; `SymmBackend` (and the kernels) load on
first use, so CPU-only installs can still read the measured thresholds (thresholds.json).
"""

from __future__ import annotations

__all__ = ["SymmBackend"]


def __getattr__(name: str):
    if name == "SymmBackend":
        from tpframe.comm.symm.backend import SymmBackend

        return SymmBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
