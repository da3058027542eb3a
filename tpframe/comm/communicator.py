"""`Communicator`: the one interface every collective in tpframe goes through.

A Communicator wraps one process group and one backend choice:
  - "nccl": torch.distributed (NCCL on GPU, gloo on CPU);
  - "symm": Triton kernels over symmetric memory (single NVLink node, CUDA only);
  - "auto": per call, symm where it is measured to be faster, else nccl.
The env var TPFRAME_COMM_BACKEND overrides the constructor's choice.
All methods are out-of-place: inputs are never modified (autograd may have saved them), except where
the caller donates its input (`all_reduce(x, donate=True)`, for a fresh tensor nobody else reads).
Under torch.compile the collectives become the custom ops of tpframe.comm.ops (traced, no graph breaks);
eager calls take the direct path below.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

from tpframe.comm import ops as comm_ops
from tpframe.comm.nccl import REDUCE_OPS, NcclBackend
from tpframe.comm.select import choose, message_bytes

BACKENDS = ("auto", "nccl", "symm")
_UNSET = object()
_compiling = torch.compiler.is_compiling
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

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        backend: str = "auto",
        device: torch.device | None = None,
    ):
        self.group = group if group is not None else dist.group.WORLD
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.device = device if device is not None else _default_device()
        self.requested = resolve_backend_name(backend)
        self.nccl = NcclBackend(self.group, self.size)
        self.symm = None
        self._plans: dict = {}
        if self.requested in ("symm", "auto") and self.size > 1:
            self.symm = _try_symm(self.group, self.size, self.device, self.requested)
        self.name = comm_ops.register(self)  # the key of this communicator in the compile-visible ops
        self._exchange = _UNSET  # async TP's copy-engine transport (peer_exchange), set up at its first use

    def peer_exchange(self):
        """The copy-engine transport between this group's GPUs (tpframe/comm/peer_exchange.py), or None where it
        cannot run (one warning). Set up at the first call: a collective, which every rank reaches at the same
        layer call."""
        if self._exchange is _UNSET:
            self._exchange = None
            if self.size > 1 and self.device.type == "cuda":
                from tpframe.comm.peer_exchange import PeerExchange

                self._exchange = PeerExchange.for_group(self.group, self.device)
        return self._exchange

    @property
    def has_peer_exchange(self) -> bool:
        """Whether the copy-engine transport is set up (what compiled code checks: it cannot set one up)."""
        return self._exchange is not _UNSET and self._exchange is not None

    def use_peer_exchange(self, exchange) -> None:
        """Use `exchange` as this group's copy-engine transport (the one-GPU tests share memory by CUDA IPC)."""
        self._exchange = exchange

    # -- dispatch -------------------------------------------------------------------------------
    def backend_for(self, op: str, x: torch.Tensor):
        """The backend that runs collective `op` on `x` (symm only where it supports the call).

        "auto" asks `select.choose` (measured thresholds, keyed on size, dtype, world size and whether a
        CUDA graph is being captured), and never picks symm for a group NVML reports as not NVLink."""
        return self._route(op, x)[0] if self.symm is not None else self.nccl

    def _route(self, op: str, x: torch.Tensor):
        """(backend, call) for dim-0 `op` on `x`; call(x) runs it. Decided once per (op, size, dtype,
        device) for eager and for graph capture, so the eager hot path is one dict hit."""
        key = (op, x.numel(), x.dtype, x.get_device())
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > 4096:
                self._plans.clear()
            eager, graph = (self._decide(op, x, graph=g) for g in (False, True))
            calls = {
                b: (self.symm.caller(op, x.numel(), x.dtype) if b is self.symm else getattr(self.nccl, op))
                for b in {eager, graph}
            }
            plan = self._plans[key] = ((eager, calls[eager]), (graph, calls[graph]))
        eager, graph = plan
        if eager[0] is graph[0]:
            return eager
        return graph if torch.cuda.is_current_stream_capturing() else eager

    def _decide(self, op: str, x: torch.Tensor, graph: bool):
        if self.requested == "nccl" or not self.symm.supports(op, x):
            return self.nccl
        if self.requested == "symm":
            return self.symm
        if self.symm.nvlink is False:
            return self.nccl
        return (
            self.symm if choose(op, message_bytes(op, x, self.size), x.dtype, self.size, graph) == "symm" else self.nccl
        )

    def input_buffer(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A tensor to write the next collective's input into. With symmetric memory set up (and room for
        `shape`) it lives in the symmetric buffer, so the symm kernels skip their staging copy; it is
        only valid until the next collective on this communicator. Otherwise a plain new tensor."""
        if self.symm is not None:
            try:
                return self.symm.input_buffer(shape, dtype)
            except ValueError:
                pass
        return torch.empty(tuple(shape), dtype=dtype, device=self.device)

    # -- collectives ----------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor, op: str = "sum", *, donate: bool = False) -> torch.Tensor:
        """Elementwise reduction over the group; same shape as `x`.

        `donate=True`: the caller gives `x` up (a fresh tensor nobody else reads, e.g. a GEMM output),
        so the NCCL path reduces it in place instead of copying it first; the result may be `x` itself."""
        if op not in REDUCE_OPS:
            raise ValueError(f"all_reduce op must be one of {sorted(REDUCE_OPS)}, got {op!r}")
        if self.size == 1:
            return x
        if _compiling():
            return torch.ops.tpframe.all_reduce(x, self.name, op)
        if op != "sum" or self.symm is None:
            return self.nccl.all_reduce(x, op, donate)
        backend, call = self._route("all_reduce", x)
        return self.nccl.all_reduce(x, op, donate) if backend is self.nccl else call(x)

    def all_reduce_(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce of a buffer the caller owns (gradient buffers); returns `x`."""
        if op not in REDUCE_OPS:
            raise ValueError(f"all_reduce op must be one of {sorted(REDUCE_OPS)}, got {op!r}")
        if self.size > 1:
            if not x.is_contiguous():
                raise ValueError("all_reduce_ needs a contiguous tensor")
            self.nccl.all_reduce_(x, op)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim` (rank order)."""
        if self.size == 1:
            return x
        if dim == 0 or dim == -x.dim():
            if _compiling():
                return torch.ops.tpframe.all_gather(x, self.name)
            return self._route("all_gather", x)[1](x) if self.symm is not None else self.nccl.all_gather(x)
        moved = x.movedim(dim, 0).contiguous()
        return self.all_gather(moved, 0).movedim(0, dim).contiguous()

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Sum over ranks, then keep this rank's 1/size slice of `dim`."""
        _check_split(x, dim, self.size)
        if self.size == 1:
            return x
        if dim == 0 or dim == -x.dim():
            if _compiling():
                return torch.ops.tpframe.reduce_scatter(x, self.name)
            return self._route("reduce_scatter", x)[1](x) if self.symm is not None else self.nccl.reduce_scatter(x)
        moved = x.movedim(dim, 0).contiguous()
        return self.reduce_scatter(moved, 0).movedim(0, dim).contiguous()

    def start(self, op: str, x: torch.Tensor):
        """Dim-0 "all_gather" or "reduce_scatter" started beside what the caller launches next (NCCL's own stream;
        gloo's thread): returns (output, wait); call wait() before reading the output. Always torch.distributed's
        backend: the symm kernels run on the caller's stream. Eager only."""
        if self.size == 1:
            return x, _no_wait
        if op == "reduce_scatter":
            _check_split(x, 0, self.size)
        out, work = getattr(self.nccl, f"{op}_start")(x)
        return out, work.wait

    def all_to_all(self, x: torch.Tensor, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
        """Rows of `x` split by `input_splits` (one count per rank, in rank order) sent to the ranks; returns
        the rows received, `output_splits[j]` of them from rank j, in rank order (expert parallelism)."""
        if len(input_splits) != self.size or len(output_splits) != self.size or sum(input_splits) != x.shape[0]:
            raise ValueError(
                f"all_to_all: {self.size} ranks, but input_splits={input_splits} (for {x.shape[0]} rows) "
                f"and output_splits={output_splits}"
            )
        if self.size == 1:
            return x
        return self.nccl.all_to_all(x, output_splits, input_splits)

    def barrier(self) -> None:
        (self.symm or self.nccl).barrier()

    def close(self, *, release_group: bool = False) -> None:
        """Free symmetric memory (the NCCL path stays usable). `release_group=True` also lets go of the
        group, once it is destroyed: a ProcessGroup still referenced at interpreter shutdown is freed
        there, which now and then aborts the process; the communicator cannot be used after that."""
        comm_ops.unregister(self.name)
        if self.symm is not None:
            self.symm.close()
            self.symm = None
        self._plans.clear()
        self._exchange = _UNSET
        if release_group:
            self.group = self.nccl = None

    def __repr__(self) -> str:
        active = "symm+nccl" if self.symm is not None else "nccl"
        return f"Communicator(size={self.size}, rank={self.rank}, requested={self.requested}, active={active})"


def _no_wait() -> None:
    pass


def _check_split(x: torch.Tensor, dim: int, size: int) -> None:
    if x.shape[dim] % size:
        raise ValueError(
            f"reduce_scatter needs dim {dim % x.dim()} of shape {tuple(x.shape)} divisible by the group size "
            f"{size} (with sequence parallelism: make the sequence length a multiple of tp)"
        )


def _default_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _try_symm(group, size, device, requested: str):
    """Set up the symmetric-memory backend, or None (with one warning when it was asked for)."""
    if device.type != "cuda":
        if requested == "symm":
            warnings.warn("comm backend 'symm' needs CUDA devices; falling back to nccl", stacklevel=3)
        return None
    try:
        from tpframe.comm.symm import SymmBackend

        return SymmBackend.create(group, size, device)
    except Exception as exc:  # noqa: BLE001 - any set-up failure means: use NCCL
        warnings.warn(f"symmetric-memory communication unavailable ({exc}); falling back to nccl", stacklevel=3)
        return None
