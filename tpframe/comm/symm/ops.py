"""Host side of the symm kernels: from tensors to one launch per collective.

`SymmKernels` knows only raw addresses: the device tables of every rank's symmetric buffer and
signal pad, this rank's own buffer, rank and world size. `backend.py` builds it from torch's
symmetric memory; the kernel tests build it from shared CPU memory under the Triton interpreter.
"""

from __future__ import annotations

import torch
import triton.language as tl

from tpframe.comm.symm.allgather import all_gather_kernel
from tpframe.comm.symm.allreduce import one_shot_all_reduce_kernel, two_shot_all_reduce_kernel
from tpframe.comm.symm.barrier import barrier_kernel
from tpframe.comm.symm.launch import KernelLauncher
from tpframe.comm.symm.reduce_scatter import reduce_scatter_kernel

TRITON_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
WORLD_SIZES = (2, 4, 8)
NUM_WARPS = 8
KERNELS = {
    "one_shot": one_shot_all_reduce_kernel,
    "two_shot": two_shot_all_reduce_kernel,
    "all_gather": all_gather_kernel,
    "reduce_scatter": reduce_scatter_kernel,
}
MAX_INDEX = 2**31 - 1  # kernels index with int32
ALL_REDUCE_ALGOS = ("one_shot", "two_shot")


def vec_elems(dtype: torch.dtype) -> int:
    """Elements in one 16-byte vector."""
    return 16 // dtype.itemsize


def block_elems(dtype: torch.dtype) -> int:
    """Elements in one tile: two 16-byte vectors per thread."""
    return 2 * vec_elems(dtype) * 32 * NUM_WARPS


def two_shot_chunk(n: int, world: int, dtype: torch.dtype) -> int:
    """Elements each rank reduces in the two-shot all-reduce: ceil(n / world), rounded up to 16 bytes."""
    vec = vec_elems(dtype)
    per_rank = -(-n // world)
    return -(-per_rank // vec) * vec


class SymmKernels:
    """all_reduce / all_gather / reduce_scatter / barrier as single kernel launches on raw symmetric buffers.

    buf_table, pad_table: int64 device tensors [world] of every rank's buffer / signal-pad address (as
    mapped in this process); own_addr, own_bytes: this rank's buffer. max_programs: the grid cap (each
    program owns `world` int32 slots of the signal pad, and all programs must fit on the GPU at once).
    """

    def __init__(self, buf_table: torch.Tensor, pad_table: torch.Tensor, own_addr: int, own_bytes: int,
                 rank: int, world: int, max_programs: int, device: torch.device):
        if world not in WORLD_SIZES:
            raise ValueError(f"symm kernels support world sizes {WORLD_SIZES}, got {world}")
        if max_programs < 1:
            raise ValueError(f"max_programs must be >= 1, got {max_programs}")
        self.buf_table, self.pad_table = buf_table, pad_table  # kept alive: the kernels read them
        self._buf, self._pad = buf_table.data_ptr(), pad_table.data_ptr()
        self.own_addr, self.own_bytes = own_addr, own_bytes
        self.rank, self.world, self.max_programs, self.device = rank, world, max_programs, device
        self._launchers: dict = {}
        self._barrier = None

    # -- capacity -------------------------------------------------------------------------------
    def fits(self, op: str, numel: int, dtype: torch.dtype) -> bool:
        """Whether `op` on `numel` input elements fits the buffer and int32 indexing."""
        if dtype not in TRITON_DTYPES or numel <= 0:
            return False
        slack = self.world * vec_elems(dtype)  # two-shot rounds its chunks up to 16 bytes
        staged = numel + slack
        total = numel * self.world if op == "all_gather" else numel
        if op == "reduce_scatter" and numel % self.world:
            return False
        return staged * dtype.itemsize <= self.own_bytes and total + slack + block_elems(dtype) * self.world <= MAX_INDEX

    # -- collectives ----------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor, out: torch.Tensor, algo: str) -> torch.Tensor:
        """out[:] = sum over ranks of x (both n contiguous elements); algo 'one_shot' or 'two_shot'."""
        x = self._input(x)
        n = x.numel()
        if algo == "one_shot":
            chunk, tiles = 0, -(-n // block_elems(x.dtype))
        elif algo == "two_shot":
            chunk = two_shot_chunk(n, self.world, x.dtype)
            tiles = -(-chunk // block_elems(x.dtype))
        else:
            raise ValueError(f"all_reduce algo must be 'one_shot' or 'two_shot', got {algo!r}")
        self._launch(algo, x, out, n, chunk, tiles, n_aligned=False)
        return out

    def all_gather(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out[p*n:(p+1)*n] = rank p's x (n elements)."""
        x = self._input(x)
        n = x.numel()
        self._launch("all_gather", x, out, n, 0, -(-n // block_elems(x.dtype)), n_aligned=n % vec_elems(x.dtype) == 0)
        return out

    def reduce_scatter(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out[:m] = sum over ranks of x[rank*m:(rank+1)*m], x: world*m elements."""
        x = self._input(x)
        m = x.numel() // self.world
        self._launch("reduce_scatter", x, out, m, 0, -(-m // block_elems(x.dtype)), n_aligned=m % vec_elems(x.dtype) == 0)
        return out

    def barrier(self) -> None:
        """Every rank's stream reaches this point before any continues (one tiny kernel)."""
        if self._barrier is None:
            self._barrier = KernelLauncher(barrier_kernel, {"WORLD": self.world}, 1, self.device)
        self._barrier(1, self._pad, self.rank)

    # -- internals ------------------------------------------------------------------------------
    def _input(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_contiguous():
            return x.contiguous()
        addr = x.data_ptr()
        if addr != self.own_addr and self.own_addr <= addr < self.own_addr + self.own_bytes:
            return x.clone()  # a view inside our own buffer would overlap the staging copy
        return x

    def _launch(self, kind: str, x: torch.Tensor, out: torch.Tensor, n: int, chunk: int, tiles: int, n_aligned: bool):
        xa = x.data_ptr()
        copy_in = xa != self.own_addr
        key = (kind, x.dtype, copy_in, xa % 16 == 0, n_aligned)
        launcher = self._launchers.get(key)
        if launcher is None:
            launcher = self._launchers[key] = self._build(key)
            other = (ALL_REDUCE_ALGOS[1 - ALL_REDUCE_ALGOS.index(kind)],) + key[1:] if kind in ALL_REDUCE_ALGOS else None
            if other is not None and other not in self._launchers:  # compile the other algorithm now: a CUDA
                self._launchers[other] = self._build(other)  # graph capture may pick it, and must not compile
        grid = min(max(tiles, 1), self.max_programs)
        launcher(grid, xa, out.data_ptr(), self._buf, self._pad, n, chunk, self.rank)

    def _build(self, key) -> KernelLauncher:
        kind, dtype, copy_in, x_aligned, n_aligned = key
        constexprs = dict(DT=TRITON_DTYPES[dtype], VEC=vec_elems(dtype), WORLD=self.world, BLOCK=block_elems(dtype),
                          COPY_IN=copy_in, X_ALIGNED=x_aligned, N_ALIGNED=n_aligned)
        return KernelLauncher(KERNELS[kind], constexprs, NUM_WARPS, self.device)
