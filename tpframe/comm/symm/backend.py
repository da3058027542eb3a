"""`SymmBackend`: tpframe's collectives as Triton kernels over one symmetric-memory buffer per group.

Set-up (collective over the group, all ranks agree or all raise): the group must be one host with
peer-to-peer access between its GPUs and 2, 4 or 8 ranks; a buffer from
`torch.distributed._symmetric_memory` is rendezvoused and every rank's buffer and signal pad
address is put in a device table; a small all-reduce is checked against NCCL before use. A second,
smaller buffer serves the barrier-free Lamport all-reduce (lamport.py), chosen by `auto` for the sizes
where it was measured fastest (its own self-test must pass, or it is left out).
Calls: out-of-place, dim-0 contract of `Communicator`. Inputs are staged into the symmetric buffer
inside the kernel; a caller that writes its input into `input_buffer(...)` skips that copy.
All calls on one backend must be ordered on one stream (they share the buffer).
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

from tpframe.comm import select
from tpframe.comm.symm.ops import TRITON_DTYPES, WORLD_SIZES, SymmKernels
from tpframe.comm.topology import local_report, nvlink_verdict

BUFFER_ENV = "TPFRAME_SYMM_BUFFER_MB"
DEFAULT_BUFFER_BYTES = 128 << 20


class SymmBackend:
    """all_reduce (sum) / all_gather / reduce_scatter / barrier through symm kernels on one group."""

    name = "symm"

    def __init__(
        self,
        group,
        size: int,
        device: torch.device,
        buffer: torch.Tensor,
        handle,
        kernels: SymmKernels,
        nvlink: bool | None,
    ):
        self.group, self.size, self.device = group, size, device
        self.rank = dist.get_rank(group)
        self.buffer, self.handle, self.kernels = buffer, handle, kernels
        self.nvlink = nvlink  # from NVML; None when it could not tell
        self.lamport = None  # the barrier-free all-reduce (lamport.py), when set up
        self._algos: dict = {}  # (numel, dtype) -> all-reduce algorithm
        self._callers: dict = {}  # (op, numel, dtype) -> eager fast path

    # -- set-up ---------------------------------------------------------------------------------
    @classmethod
    def create(cls, group, size: int, device: torch.device, buffer_bytes: int | None = None) -> SymmBackend:
        """Set up on every rank of `group` (a collective); raises on every rank if any rank cannot."""
        if device.type != "cuda":
            raise ValueError(f"symm needs CUDA devices, got {device}")
        if size not in WORLD_SIZES:
            raise ValueError(f"symm supports groups of {WORLD_SIZES} ranks, got {size}")
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        if buffer_bytes is None:
            buffer_bytes = int(float(os.environ.get(BUFFER_ENV, DEFAULT_BUFFER_BYTES >> 20)) * (1 << 20))
        if buffer_bytes < 4096 or buffer_bytes % 4096:
            raise ValueError(f"symm buffer must be a positive multiple of 4096 bytes, got {buffer_bytes}")
        with torch.cuda.device(device):
            reports = _gather(group, size, local_report(device))
            hosts = sorted({rep["host"] for rep in reports})
            if len(hosts) > 1:
                raise RuntimeError(f"the group spans hosts {hosts}; symm needs one NVLink node")
            nvlink = nvlink_verdict(reports)
            backend = cls._rendezvous(group, size, device, buffer_bytes, nvlink)
            from tpframe.comm.symm.lamport import LamportAllReduce

            sms = torch.cuda.get_device_properties(device).multi_processor_count
            backend.lamport = LamportAllReduce.create(group, backend.rank, size, device, sms)
            backend._self_test()
        return backend

    @classmethod
    def _rendezvous(cls, group, size, device, buffer_bytes, nvlink):
        from tpframe.comm.symm import symmetric_memory

        symm_mem = symmetric_memory(group, device)
        buffer = symm_mem.empty(buffer_bytes, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(buffer, group.group_name)
        rank = dist.get_rank(group)
        offset = buffer.data_ptr() - handle.buffer_ptrs[rank]
        offsets = _gather(group, size, offset)
        if len(set(offsets)) != 1 or offset < 0 or offset + buffer_bytes > handle.buffer_size:
            raise RuntimeError(f"symmetric buffer offsets differ between ranks or overflow: {offsets}")
        pad_bytes = getattr(handle, "signal_pad_size", None) or getattr(symm_mem, "get_signal_pad_size", lambda: None)()
        if not pad_bytes:
            raise RuntimeError("cannot tell the signal pad size of this torch's symmetric memory")
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        max_programs = min(sms, pad_bytes // 4 // size)
        buf_table = torch.tensor([p + offset for p in handle.buffer_ptrs], dtype=torch.int64, device=device)
        pad_table = torch.tensor(list(handle.signal_pad_ptrs), dtype=torch.int64, device=device)
        kernels = SymmKernels(buf_table, pad_table, buffer.data_ptr(), buffer_bytes, rank, size, max_programs, device)
        return cls(group, size, device, buffer, handle, kernels, nvlink)

    def _self_test(self) -> None:
        """A one-shot all-reduce of random data against NCCL; every rank learns every rank's verdict."""
        x = torch.randn(4096 + 3, device=self.device).to(torch.bfloat16)
        ours = self.kernels.all_reduce(x, torch.empty_like(x), "one_shot")
        ref = x.float()
        dist.all_reduce(ref, group=self.group)
        ok = bool(torch.allclose(ours.float(), ref, rtol=2e-2, atol=2e-2))
        lamport_ok = self.lamport is not None
        if lamport_ok:
            lamport_ok = all(
                bool(torch.allclose(self.lamport.all_reduce(x, torch.empty_like(x)).float(), ref, rtol=2e-2, atol=2e-2))
                for _ in range(4)
            )  # four calls: slots rotate
        verdicts = _gather(self.group, self.size, (ok, lamport_ok))
        if not all(v[0] for v in verdicts):
            bad = [r for r, v in enumerate(verdicts) if not v[0]]
            raise RuntimeError(f"symm self-test disagreed with NCCL on ranks {bad}")
        if not all(v[1] for v in verdicts):
            if self.lamport is not None:
                warnings.warn(
                    "the Lamport all-reduce disagreed with NCCL in its self-test; it will not be used", stacklevel=3
                )
            self.lamport = None

    # -- the Communicator interface -------------------------------------------------------------
    def supports(self, op: str, x: torch.Tensor) -> bool:
        """Whether this backend can run `op` on `x` (dtype, device, size within the buffer)."""
        return x.device == self.device and self.kernels.fits(op, x.numel(), x.dtype)

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if op != "sum":
            raise ValueError(f"symm all_reduce supports op 'sum' only, got {op!r}")
        algo = self._algorithm(x.numel(), x.dtype)
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        if algo == "lamport":
            return self.lamport.all_reduce(x, out)
        return self.kernels.all_reduce(x, out, algo)

    def _algorithm(self, numel: int, dtype: torch.dtype) -> str:
        algo = self._algos.get((numel, dtype))
        if algo is None:
            algo = self._algos[(numel, dtype)] = self._pick_algorithm(numel, dtype)
        return algo

    def caller(self, op: str, numel: int, dtype: torch.dtype):
        """The eager fast path for `op` on contiguous inputs of `numel` elements of `dtype`: a closure
        x -> out that allocates the output and launches a prepared plan (anything unusual, such as
        a non-contiguous or unaligned input or one inside the symmetric buffer, takes the general path)."""
        key = (op, numel, dtype)
        call = self._callers.get(key)
        if call is None:
            if len(self._callers) > 4096:
                self._callers.clear()
            call = self._callers[key] = self._make_caller(op, numel, dtype)
        return call

    def _make_caller(self, op: str, numel: int, dtype: torch.dtype):
        k, size = self.kernels, self.size
        lo, hi = k.own_addr, k.own_addr + k.own_bytes
        contiguous = torch.contiguous_format
        if op == "all_reduce" and self._algorithm(numel, dtype) == "lamport":
            plan, lamport = self.lamport.plan(numel, dtype), self.lamport

            def all_reduce_lamport(x):  # reads x wherever it is: no staging, no symmetric-buffer check
                out = torch.empty_like(x, memory_format=contiguous)
                if x.data_ptr() & 15 or not x.is_contiguous():
                    return lamport.all_reduce(x, out)
                plan(x.data_ptr(), out.data_ptr())
                return out

            return all_reduce_lamport
        if op == "all_reduce":
            algo = self._algorithm(numel, dtype)
            plan = k.plan(algo, numel, dtype)

            def all_reduce(x):
                out = torch.empty_like(x, memory_format=contiguous)
                xa = x.data_ptr()
                if xa & 15 or lo <= xa < hi or not x.is_contiguous():
                    return k.all_reduce(x, out, algo)
                plan(xa, out.data_ptr())
                return out

            return all_reduce
        if op == "all_gather":
            plan = k.plan("all_gather", numel, dtype)

            def all_gather(x):
                out = x.new_empty((size * x.shape[0],) + x.shape[1:])
                xa = x.data_ptr()
                if xa & 15 or lo <= xa < hi or not x.is_contiguous():
                    return k.all_gather(x, out)
                plan(xa, out.data_ptr())
                return out

            return all_gather
        if op == "reduce_scatter":
            plan = k.plan("reduce_scatter", numel, dtype)

            def reduce_scatter(x):
                if x.shape[0] % size:
                    raise ValueError(
                        f"reduce_scatter needs dim 0 of {tuple(x.shape)} divisible by the group size {size}"
                    )
                out = x.new_empty((x.shape[0] // size,) + x.shape[1:])
                xa = x.data_ptr()
                if xa & 15 or lo <= xa < hi or not x.is_contiguous():
                    return k.reduce_scatter(x, out)
                plan(xa, out.data_ptr())
                return out

            return reduce_scatter
        raise ValueError(f"op must be all_reduce, all_gather or reduce_scatter, got {op!r}")

    def _pick_algorithm(self, numel: int, dtype: torch.dtype) -> str:
        """The measured fastest all-reduce kernel for this size that fits the buffer (two-shot always fits
        where `supports` said yes). Compiles every algorithm for `dtype` on first use: a CUDA graph
        capture may choose one that eager calls never did, and must not compile."""
        if len(self._algos) > 4096:
            self._algos.clear()
        self.kernels.warm_up(dtype)
        if self.lamport is not None:
            self.lamport.warm_up(dtype)
        algo = select.all_reduce_algorithm(numel * dtype.itemsize, dtype, self.size)
        if algo == "lamport":
            if self.lamport is not None and self.lamport.fits(numel, dtype):
                return algo
            algo = "push"  # the measured pick for small messages before the Lamport kernel existed
        return algo if self.kernels.fits("all_reduce", numel, dtype, algo) else "two_shot"

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[n, ...] -> [size * n, ...], rank r's rows at r*n."""
        return self.kernels.all_gather(x, x.new_empty((self.size * x.shape[0],) + tuple(x.shape[1:])))

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """[size * n, ...] -> [n, ...]: the sum over ranks of rank r's rows."""
        if x.shape[0] % self.size:
            raise ValueError(f"reduce_scatter needs dim 0 of {tuple(x.shape)} divisible by the group size {self.size}")
        return self.kernels.reduce_scatter(x, x.new_empty((x.shape[0] // self.size,) + tuple(x.shape[1:])))

    def barrier(self) -> None:
        """A device-side barrier on the current stream (no host synchronization)."""
        self.kernels.barrier()

    def input_buffer(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A tensor inside this rank's symmetric buffer: write the next collective's input here and the
        kernel skips its staging copy. Valid until the next collective on this backend."""
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if dtype not in TRITON_DTYPES or nbytes > self.kernels.own_bytes:
            raise ValueError(
                f"input_buffer {tuple(shape)} {dtype} does not fit the {self.kernels.own_bytes}-byte "
                f"symmetric buffer (dtypes {sorted(map(str, TRITON_DTYPES))})"
            )
        return self.buffer[:nbytes].view(dtype).view(tuple(shape))

    def close(self) -> None:
        self.lamport = None
        self.kernels = None
        self.handle = None
        self.buffer = None


def _gather(group, size: int, obj) -> list:
    out = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out
