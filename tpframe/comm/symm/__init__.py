"""Symmetric-memory collectives: Triton kernels over torch.distributed._symmetric_memory buffers.

Importing this package needs neither Triton nor a GPU; `SymmBackend` (and the kernels) load on
first use, so CPU-only installs can still read the measured thresholds (thresholds.json).
"""

from __future__ import annotations

__all__ = ["SymmBackend", "symmetric_memory"]


def symmetric_memory(group, device):
    """torch's symmetric-memory module, set up for `group` on `device`: the CUDA (peer-pointer) backend, not
    NVSHMEM, and the group enabled where this torch still needs that (newer ones warn that it is unneeded)."""
    import warnings

    import torch.distributed._symmetric_memory as symm_mem

    try:
        if symm_mem.get_backend(device) is None:
            symm_mem.set_backend("CUDA")
    except (AttributeError, RuntimeError):
        pass
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group.group_name)
    return symm_mem


def __getattr__(name: str):
    if name == "SymmBackend":
        from tpframe.comm.symm.backend import SymmBackend

        return SymmBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
