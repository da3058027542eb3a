"""`Communicator`: the one interface every collective in tpframe goes through.

A Communicator wraps one process group and one backend choice:
  - "nccl": torch.distributed (NCCL on GPU, gloo on CPU);
  - "symm": Triton kernels over symmetric memory (single NVLink node, CUDA only);
  - "auto": per call, symm where it is measured to be faster, else nccl.
The env var TPFRAME_COMM_BACKEND overrides the constructor's choice.
All methods are out-of-place: inputs are never modified (autograd may have saved them).
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

from tpframe.comm.nccl import REDUCE_OPS, NcclBackend

BACKENDS = ("auto", "nccl", "symm")
ENV_VAR = "TPFRAME_COMM_BACKEND"


def resolve_backend_name(requested: str) -> str:
    """The backend asked for, after the env override; a clear error for an unknown name."""
    name = os.environ.get(ENV_VAR) or requested
    if name not in BACKENDS:
        source = f"env var {ENV_VAR}" if os.environ.get(ENV_VAR) else "comm.backend"
        raise ValueError(f"{source}={name!r} is not a communication backend; choose one of {', '.join(BACKENDS)}")
    return name


class Communicator:
    """all_reduce / all_gather / reduce_scatter / barrier over `group`, by the chosen backend."""

    def __init__(self, group: dist.ProcessGroup | None = None, backend: str = "auto", device: torch.device | None = None):
        self.group = group if group is not None else dist.group.WORLD
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.device = device if device is not None else _default_device()
        self.requested = resolve_backend_name(backend)
        self.nccl = NcclBackend(self.group, self.size)
        self.symm = None
        if self.requested in ("symm", "auto") and self.size > 1:
            self.symm = _try_symm(self.group, self.size, self.device, strict=False, requested=self.requested)

    # -- dispatch -------------------------------------------------------------------------------
    def backend_for(self, op: str, x: torch.Tensor):
        """The backend that runs collective `op` on `x` (symm only where it supports the call)."""
        if self.symm is None or not self.symm.supports(op, x):
            return self.nccl
        if self.requested == "symm":
            return self.symm
        from tpframe.comm.select import choose

        return self.symm if choose(op, x.numel() * x.element_size(), x.dtype, self.size) == "symm" else self.nccl

    # -- collectives ----------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Elementwise reduction over the group; same shape as `x`."""
        if op not in REDUCE_OPS:
            raise ValueError(f"all_reduce op must be one of {sorted(REDUCE_OPS)}, got {op!r}")
        if self.size == 1:
            return x
        backend = self.backend_for("all_reduce", x) if op == "sum" else self.nccl
        return backend.all_reduce(x, op)

    def all_reduce_(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce of a buffer the caller owns (gradient buffers); returns `x`."""
        if op not in REDUCE_OPS:
            raise ValueError(f"all_reduce op must be one of {sorted(REDUCE_OPS)}, got {op!r}")
        if self.size > 1:
            if not x.is_contiguous():
                raise ValueError("all_reduce_ needs a contiguous tensor")
            dist.all_reduce(x, op=REDUCE_OPS[op], group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim` (rank order)."""
        if self.size == 1:
            return x
        dim = dim % x.dim()
        if dim == 0:
            return self.backend_for("all_gather", x).all_gather(x)
        moved = x.movedim(dim, 0)
        return self.backend_for("all_gather", x).all_gather(moved.contiguous()).movedim(0, dim).contiguous()

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Sum over ranks, then keep this rank's 1/size slice of `dim`."""
        dim = dim % x.dim()
        if x.shape[dim] % self.size:
            raise ValueError(
                f"reduce_scatter needs dim {dim} of shape {tuple(x.shape)} divisible by the group size {self.size} "
                "(with sequence parallelism: make the sequence length a multiple of tp)"
            )
        if self.size == 1:
            return x
        if dim == 0:
            return self.backend_for("reduce_scatter", x).reduce_scatter(x)
        moved = x.movedim(dim, 0).contiguous()
        return self.backend_for("reduce_scatter", x).reduce_scatter(moved).movedim(0, dim).contiguous()

    def barrier(self) -> None:
        (self.symm or self.nccl).barrier()

    def close(self) -> None:
        if self.symm is not None:
            self.symm.close()
            self.symm = None

    def __repr__(self) -> str:
        active = "symm+nccl" if self.symm is not None else "nccl"
        return f"Communicator(size={self.size}, rank={self.rank}, requested={self.requested}, active={active})"


def _default_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _try_symm(group, size, device, strict: bool, requested: str):
    """Set up the symmetric-memory backend, or None (with one warning when it was asked for)."""
    if device.type != "cuda":
        if requested == "symm":
            warnings.warn("comm backend 'symm' needs CUDA devices; falling back to nccl", stacklevel=3)
        return None
    try:
        from tpframe.comm.symm import SymmBackend

        return SymmBackend.create(group, size, device)
    except Exception as exc:  # noqa: BLE001 - any set-up failure means: use NCCL
        if strict:
            raise
        warnings.warn(f"symmetric-memory communication unavailable ({exc}); falling back to nccl", stacklevel=3)
        return None
