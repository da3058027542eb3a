"""Host side of the symm kernels: from tensors to one launch per collective.

`SymmKernels` knows only raw addresses: the device tables of every rank's symmetric buffer and
signal pad, this rank's own buffer, rank and world size. `backend.py` builds it from torch's
symmetric memory; the kernel tests build it from shared CPU memory under the Triton interpreter.
A call is a cached plan per (kernel, size, dtype, input placement): a closure that launches the
compiled kernel with two fresh addresses, so the eager path spends microseconds, not tens of them.
"""

from __future__ import annotations

import torch
import triton.language as tl

from tpframe.comm.symm.allgather import all_gather_kernel
from tpframe.comm.symm.allreduce import one_shot_all_reduce_kernel, push_all_reduce_kernel, two_shot_all_reduce_kernel
from tpframe.comm.symm.barrier import barrier_kernel
from tpframe.comm.symm.launch import KernelLauncher
from tpframe.comm.symm.reduce_scatter import reduce_scatter_kernel

TRITON_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
WORLD_SIZES = (2, 4, 8)
NUM_WARPS = 8
ALL_REDUCE_ALGOS = ("one_shot", "push", "two_shot")
KERNELS = {
    "one_shot": one_shot_all_reduce_kernel,
    "push": push_all_reduce_kernel,
    "two_shot": two_shot_all_reduce_kernel,
    "all_gather": all_gather_kernel,
    "reduce_scatter": reduce_scatter_kernel,
}
MAX_INDEX = 2**31 - 1  # kernels index with int32


def vec_elems(dtype: torch.dtype) -> int:
    """Elements in one 16-byte vector."""
    return 16 // dtype.itemsize


def block_elems(dtype: torch.dtype) -> int:
    """Elements in one tile: two 16-byte vectors per thread."""
    return 2 * vec_elems(dtype) * 32 * NUM_WARPS


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def two_shot_chunk(n: int, world: int, dtype: torch.dtype) -> int:
    """Elements each rank reduces in the two-shot all-reduce: ceil(n / world), rounded up to 16 bytes."""
    return round_up(-(-n // world), vec_elems(dtype))


class SymmKernels:
    """all_reduce / all_gather / reduce_scatter / barrier as single kernel launches on raw symmetric buffers.

    buf_table, pad_table: int64 device tensors [world] of every rank's buffer / signal-pad address (as
    mapped in this process); own_addr, own_bytes: this rank's buffer. max_programs: the grid cap (each
    program owns `world` int32 slots of the signal pad, and all programs must fit on the GPU at once).
    """

    def __init__(
        self,
        buf_table: torch.Tensor,
        pad_table: torch.Tensor,
        own_addr: int,
        own_bytes: int,
        rank: int,
        world: int,
        max_programs: int,
        device: torch.device,
    ):
        if world not in WORLD_SIZES:
            raise ValueError(f"symm kernels support world sizes {WORLD_SIZES}, got {world}")
        if max_programs < 1:
            raise ValueError(f"max_programs must be >= 1, got {max_programs}")
        self.buf_table, self.pad_table = buf_table, pad_table  # kept alive: the kernels read them
        self._buf, self._pad = buf_table.data_ptr(), pad_table.data_ptr()
        self.own_addr, self.own_bytes = own_addr, own_bytes
        self.rank, self.world, self.max_programs, self.device = rank, world, max_programs, device
        self._launchers: dict = {}
        self._plans: dict = {}
        self._barrier = None

    # -- capacity -------------------------------------------------------------------------------
    def needed_bytes(self, kind: str, numel: int, dtype: torch.dtype) -> int:
        """Symmetric-buffer bytes `kind` needs for an input of `numel` elements."""
        vec = vec_elems(dtype)
        if kind == "push":
            return self.world * round_up(numel, vec) * dtype.itemsize
        if kind == "two_shot":
            return self.world * two_shot_chunk(numel, self.world, dtype) * dtype.itemsize
        return numel * dtype.itemsize

    def fits(self, op: str, numel: int, dtype: torch.dtype, kind: str | None = None) -> bool:
        """Whether `op` (kernel `kind`; for all_reduce by default the two-shot, the smallest footprint)
        on `numel` input elements fits the buffer and int32 indexing."""
        if dtype not in TRITON_DTYPES or numel <= 0:
            return False
        if op == "reduce_scatter" and numel % self.world:
            return False
        kind = kind or ("two_shot" if op == "all_reduce" else op)
        total = numel * self.world if op == "all_gather" else numel
        index_limit = max(total, self.needed_bytes(kind, numel, dtype) // dtype.itemsize) + self.world * block_elems(
            dtype
        )
        return self.needed_bytes(kind, numel, dtype) <= self.own_bytes and index_limit <= MAX_INDEX

    # -- collectives ----------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor, out: torch.Tensor, algo: str) -> torch.Tensor:
        """out[:] = sum over ranks of x (both n contiguous elements); algo: one of ALL_REDUCE_ALGOS."""
        if algo not in ALL_REDUCE_ALGOS:
            raise ValueError(f"all_reduce algo must be one of {ALL_REDUCE_ALGOS}, got {algo!r}")
        return self._run(algo, x, out)

    def all_gather(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out[p*n:(p+1)*n] = rank p's x (n elements)."""
        return self._run("all_gather", x, out)

    def reduce_scatter(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out[:m] = sum over ranks of x[rank*m:(rank+1)*m], x: world*m elements."""
        return self._run("reduce_scatter", x, out)

    def barrier(self) -> None:
        """Every rank's stream reaches this point before any continues (one tiny kernel)."""
        if self._barrier is None:
            self._barrier = KernelLauncher(barrier_kernel, {"WORLD": self.world}, 1, self.device).bind(1)
        self._barrier(self._pad, self.rank)

    # -- plans ----------------------------------------------------------------------------------
    def _run(self, kind: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if not x.is_contiguous():
            x = x.contiguous()
        xa = x.data_ptr()
        if xa != self.own_addr and self.own_addr <= xa < self.own_addr + self.own_bytes:
            x = x.clone()  # a view elsewhere inside our own buffer would overlap the staging
            xa = x.data_ptr()
        self.plan(kind, x.numel(), x.dtype, xa != self.own_addr, xa % 16 == 0)(xa, out.data_ptr())
        return out

    def plan(self, kind: str, numel: int, dtype: torch.dtype, copy_in: bool = True, x_aligned: bool = True):
        """A closure (x_addr, out_addr) -> one launch of `kind` for this size, dtype and input placement
        (copy_in False: the input is this rank's buffer itself). Cached."""
        key = (kind, numel, dtype, copy_in, x_aligned)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > 4096:
                self._plans.clear()
            plan = self._plans[key] = self._plan(*key)
        return plan

    def _plan(self, kind: str, numel: int, dtype: torch.dtype, copy_in: bool, x_aligned: bool):
        if not self.fits("all_reduce" if kind in ALL_REDUCE_ALGOS else kind, numel, dtype, kind):
            raise ValueError(
                f"{kind} of {numel} {dtype} elements does not fit the {self.own_bytes}-byte symmetric buffer"
            )
        block, vec = block_elems(dtype), vec_elems(dtype)
        n, chunk, n_aligned = numel, 0, False
        if kind == "two_shot":
            chunk = two_shot_chunk(numel, self.world, dtype)
            tiles = -(-chunk // block)
        elif kind == "push":
            chunk = round_up(numel, vec)
            tiles = -(-numel // block)
        elif kind == "reduce_scatter":
            n = numel // self.world
            n_aligned = n % vec == 0
            tiles = -(-n // block)
        else:
            n_aligned = kind == "all_gather" and n % vec == 0
            tiles = -(-n // block)
        constexprs = dict(
            DT=TRITON_DTYPES[dtype],
            VEC=vec,
            WORLD=self.world,
            BLOCK=block,
            COPY_IN=copy_in,
            X_ALIGNED=x_aligned,
            N_ALIGNED=n_aligned,
        )
        variant = (kind, dtype, copy_in, x_aligned, n_aligned)
        launcher = self._launchers.get(variant)
        if launcher is None:
            launcher = self._launchers[variant] = KernelLauncher(KERNELS[kind], constexprs, NUM_WARPS, self.device)
        grid = min(max(tiles, 1), self.max_programs)
        return launcher.bind(grid, self._buf, self._pad, n, chunk, self.rank)

    def warm_up(self, dtype: torch.dtype) -> None:
        """Compile every all-reduce algorithm for `dtype` now (a CUDA graph capture must not compile)."""
        for kind in ALL_REDUCE_ALGOS:
            variant = (kind, dtype, True, True, False)
            if variant not in self._launchers:
                constexprs = dict(
                    DT=TRITON_DTYPES[dtype],
                    VEC=vec_elems(dtype),
                    WORLD=self.world,
                    BLOCK=block_elems(dtype),
                    COPY_IN=True,
                    X_ALIGNED=True,
                    N_ALIGNED=False,
                )
                self._launchers[variant] = KernelLauncher(KERNELS[kind], constexprs, NUM_WARPS, self.device)
