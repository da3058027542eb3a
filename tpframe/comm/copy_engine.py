"""Gradient sync by the GPUs' copy engines: DP reduce-scatter / all-reduce that holds no SM while data moves.

Why: cuBLAS's Hopper GEMMs are persistent (one CTA per SM, tiles assigned up front), and NCCL's kernels hold
SMs for a collective's whole duration. Launched beside the backward's GEMMs, a bucket's NCCL all-reduce either
waits for the GEMMs or delays them (comm/margin.py has the measurements), so on 2x H200 `ddp` with overlap was
still 1.057x DP=1's step. Here the bytes move by DMA (cudaMemcpy between peers' memory: the copy engines), the
cross-GPU ordering is done by stream memory operations (cuStreamWriteValue32 / cuStreamWaitValue32: the GPU's
front end, no SM), and the only SM work is one short reduction kernel per bucket, which slots in between the
GEMMs like any other kernel. torch's `_low_contention_*` symmetric-memory collectives use the same idea.

Per bucket b (every rank launches its buckets in the same order, as NCCL requires too), rank r:
  1. signal stream: after the compute stream has finished the bucket's gradients, set READY(b, r) = 1 in every
     peer's flags;
  2. pull stream: take READY(b, p) from every peer p (wait until it is 1, set it to 0), then copy slice r of p's
     bucket into a scratch slot;
  3. reduce stream: slice r of r's own bucket = (own + pulled) * scale (one kernel, tpframe/kernels/scaled_sum.py);
     set REDUCED(b, r) = 1 in the peers' flags;
  4. (all-reduce only) gather stream: take REDUCED(b, p), copy slice p of p's bucket into r's buffer.
After the last bucket every rank sets DONE(r) = 1 in its peers' flags (it has read everything it will read from
them this step), and the compute stream takes every peer's DONE before the buffer is written again. Every flag
is set by one rank and cleared by another, once per step each, and a rank sets a flag again only after the DONE
that follows its clearing: so each step leaves the flags as it found them, and the same stream operations are
right every step. That is what lets a CUDA graph capture the sync inside the training step
(tpframe/parallel/graphed.py): no counter is baked into the graph. Signals never wait on peers, so no order of
arrival deadlocks.

The buffer and the flags must be addressable by every peer: `symmetric_peer_memory` (torch's symmetric
memory: one host, peer access, CUDA) in production; `ipc_peer_memory` (CUDA IPC handles) lets two processes
share one GPU, which is how the protocol is tested on a one-GPU machine.
"""

from __future__ import annotations

import ctypes
import functools
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tpframe.kernels.scaled_sum import scaled_sum_

_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int32)(*addr - value) >= 0
_V2_MEMOPS_DRIVER = 11070  # the driver API version from which the V2 stream memory operations exist (CUDA 11.7)
TIMEOUT_S = 600.0  # how long `CopyEngineSync.finish` waits for its peers when no comm.timeout_s is given


@functools.cache
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    fns = {}
    for name in ("cuStreamWriteValue32_v2", "cuStreamWaitValue32_v2"):
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fn.restype = ctypes.c_int
        fns[name] = fn
    copy = lib.cuMemcpyDtoDAsync_v2
    copy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    copy.restype = ctypes.c_int
    fns["copy"] = copy
    for name, argtypes in (
        ("cuEventCreate", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]),
        ("cuEventRecord", [ctypes.c_void_p, ctypes.c_void_p]),
        ("cuStreamWaitEvent", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]),
    ):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
        fns[name] = fn
    version = lib.cuDriverGetVersion
    version.argtypes, version.restype = [ctypes.POINTER(ctypes.c_int)], ctypes.c_int
    fns["version"] = version
    return fns


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed with CUresult {rc}")


def _handle(stream) -> int:
    return stream if isinstance(stream, int) else stream.cuda_stream


def stream_write(stream, address: int, value: int) -> None:
    """When `stream` (a torch.cuda.Stream or a raw handle) reaches this point, store `value` (32 bits) at device
    address `address` (after a fence)."""
    _check(
        _driver()["cuStreamWriteValue32_v2"](_handle(stream), address, value & 0xFFFFFFFF, 0), "cuStreamWriteValue32"
    )


def stream_wait(stream, address: int, value: int) -> None:
    """Work queued on `stream` (a torch.cuda.Stream or a raw handle) after this waits until the int32 at
    `address` is >= `value` (wrap-safe)."""
    _check(
        _driver()["cuStreamWaitValue32_v2"](_handle(stream), address, value & 0xFFFFFFFF, _WAIT_GEQ),
        "cuStreamWaitValue32",
    )


def stream_take(stream, address: int) -> None:
    """Work queued on `stream` after this waits until the int32 flag at `address` is 1, which it then resets to 0
    (one side of a handshake whose other side sets the flag to 1 with `stream_write`)."""
    stream_wait(stream, address, 1)
    stream_write(stream, address, 0)


def stream_copy(stream, dst: int, src: int, nbytes: int) -> None:
    """Queue a device-to-device copy of `nbytes` on `stream` (raw addresses: what torch's same-device `copy_`
    calls, without its host cost; a peer's mapped memory as `dst` makes it a copy engine's transfer)."""
    _check(_driver()["copy"](dst, src, nbytes, _handle(stream)), "cuMemcpyDtoDAsync")


class RawEvent:
    """A CUDA event on raw stream handles (ctypes driver calls: a fraction of torch.cuda.Event's host cost):
    `record(stream)`, then `block(other)` makes work queued on `other` from then on wait for what `stream` had
    queued at the record."""

    def __init__(self):
        event = ctypes.c_void_p()
        _check(_driver()["cuEventCreate"](ctypes.byref(event), 0x2), "cuEventCreate")  # CU_EVENT_DISABLE_TIMING
        self.event = event

    def record(self, stream: int) -> None:
        _check(_driver()["cuEventRecord"](self.event, stream), "cuEventRecord")

    def block(self, stream: int) -> None:
        _check(_driver()["cuStreamWaitEvent"](stream, self.event, 0), "cuStreamWaitEvent")

    def after(self, later: int, earlier: int) -> None:
        """Work queued on `later` from now on waits for what `earlier` has queued so far."""
        self.record(earlier)
        self.block(later)


def stream_memops_supported(device: torch.device) -> bool:
    """Whether this driver runs the V2 stream memory operations: "available by default on all platforms" from
    CUDA 11.7 on (the driver API's docs). The V1 attribute, CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1, says
    nothing about them: CUDA 12 deprecated it, and newer drivers answer 0 while the V2 operations work."""
    del device  # a property of the driver, the same for every GPU it runs
    try:
        value = ctypes.c_int(0)
        return _driver()["version"](ctypes.byref(value)) == 0 and value.value >= _V2_MEMOPS_DRIVER
    except (OSError, AttributeError):  # no libcuda, or one without the V2 symbols
        return False


@dataclass
class PeerMemory:
    """One buffer (fp32 unless asked otherwise) and one int32 flag array per rank, each visible to every rank.

    `buffers[r]` / `flags[r]` are rank r's, as tensors this process can read (r == rank: its own)."""

    rank: int
    size: int
    buffers: list[torch.Tensor]
    flags: list[torch.Tensor]
    keepalive: list = field(default_factory=list)
    timeout_s: float = TIMEOUT_S  # how long `CopyEngineSync.finish` waits for the peers before it raises

    def __post_init__(self):
        # device addresses, taken once: the transports compute a few per stream operation, on the host's hot path
        self.base = [b.data_ptr() for b in self.buffers]  # of each rank's buffer (for stream_copy)
        self._flag_base = [f.data_ptr() for f in self.flags]

    @property
    def buffer(self) -> torch.Tensor:
        return self.buffers[self.rank]

    def flag(self, owner: int, index: int) -> int:
        """The device address of int32 flag `index` of rank `owner`'s array (for stream_write / stream_wait)."""
        return self._flag_base[owner] + 4 * index


def symmetric_peer_memory(
    group,
    *,
    numel: int,
    flags: int,
    device: torch.device,
    timeout_s: float = TIMEOUT_S,
    dtype: torch.dtype = torch.float32,
) -> PeerMemory:
    """Buffers (`numel` of `dtype`) from torch's symmetric memory on `group` (a collective). Raises where it is
    unavailable."""
    from tpframe.comm.symm import symmetric_memory

    symm_mem = symmetric_memory(group, device)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    out: dict[str, list[torch.Tensor]] = {}
    handles = []
    for key, n, kind in (("buffers", numel, dtype), ("flags", flags, torch.int32)):
        local = symm_mem.empty(n, dtype=kind, device=device)
        local.zero_()
        handle = symm_mem.rendezvous(local, group.group_name)
        offset = local.data_ptr() - handle.buffer_ptrs[rank]
        offsets = [None] * size
        dist.all_gather_object(offsets, offset, group=group)
        if len(set(offsets)) != 1 or offset % local.element_size():
            raise RuntimeError(f"symmetric buffer offsets differ between ranks: {offsets}")
        out[key] = [
            local if r == rank else handle.get_buffer(r, (n,), kind, offset // local.element_size())
            for r in range(size)
        ]
        handles.append(handle)
    torch.cuda.synchronize(device)
    dist.barrier(group)  # every rank's zeros are in place before anyone signals
    return PeerMemory(rank, size, out["buffers"], out["flags"], handles, timeout_s)


def ipc_peer_memory(
    group,
    *,
    numel: int,
    flags: int,
    device: torch.device,
    timeout_s: float = TIMEOUT_S,
    dtype: torch.dtype = torch.float32,
) -> PeerMemory:
    """Buffers shared by CUDA IPC handles exchanged over `group` (a collective): for ranks sharing one GPU
    (the one-GPU tests). Ranks on different GPUs use `symmetric_peer_memory`."""
    from torch.multiprocessing.reductions import reduce_tensor

    rank, size = dist.get_rank(group), dist.get_world_size(group)
    local = (torch.zeros(numel, dtype=dtype, device=device), torch.zeros(flags, dtype=torch.int32, device=device))
    shared = [None] * size
    dist.all_gather_object(shared, [reduce_tensor(t) for t in local], group=group)
    views = [list(local) if r == rank else [fn(*args) for fn, args in shared[r]] for r in range(size)]
    if any(v.device != device for row in views for v in row):
        raise RuntimeError("ipc_peer_memory shares buffers between ranks on one GPU only")
    torch.cuda.synchronize(device)
    dist.barrier(group)
    return PeerMemory(rank, size, [v[0] for v in views], [v[1] for v in views], views, timeout_s)


class CopyEngineSync:
    """The DP collective of a bucketed gradient buffer, by copy engines (module docstring).

    `ranges[b]` = [start, stop) of bucket b in the flat buffer, a multiple of `size` long; `scatter_only`:
    reduce-scatter (zero1: rank r's slice r of each bucket gets the result) instead of all-reduce; `scale`
    multiplies the sum (1 / ranks averaged over). Per step: `launch(b)` for every bucket, then `finish()`. Both may
    be captured into a CUDA graph; a replayed `finish` is then waited for by a later eager `finish()`."""

    SLOTS = 2  # scratch slots: the pull of bucket b+1 need not wait for the reduction of bucket b

    def __init__(
        self,
        memory: PeerMemory,
        ranges: list[tuple[int, int]],
        *,
        scatter_only: bool,
        scale: float,
        high_priority: bool = False,
    ):
        if any((stop - start) % memory.size for start, stop in ranges):
            raise ValueError("every bucket must split evenly over the ranks")
        self.memory, self.ranges, self.scatter_only, self.scale = memory, list(ranges), scatter_only, scale
        self.rank, self.size = memory.rank, memory.size
        self.peers = [r for r in range(self.size) if r != self.rank]
        self.device = memory.buffer.device
        # high_priority (parallel.dp_high_priority): the reductions' CTAs go ahead of the backward's queued ones
        priority = torch.cuda.Stream.priority_range()[1] if high_priority else 0
        self.signal, self.pull, self.reduce, self.gather = (
            torch.cuda.Stream(self.device, priority=priority) for _ in range(4)
        )
        self._raw = {name: getattr(self, name).cuda_stream for name in ("signal", "pull", "reduce", "gather")}
        widest = max((stop - start) // self.size for start, stop in self.ranges)
        self.scratch = [
            torch.empty(len(self.peers) * widest, dtype=torch.float32, device=self.device) for _ in range(self.SLOTS)
        ]
        # Each bucket's launch is a dozen stream operations: raw handles, addresses and reused events (ctypes
        # driver calls) keep its host cost a fraction of torch's stream contexts, views and new events.
        self._ready, self._pulled = RawEvent(), RawEvent()
        self._slot_free = [RawEvent() for _ in range(self.SLOTS)]
        self._views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (bucket, slot) -> operands
        self._item = memory.buffer.element_size()
        # Load the reduction kernel now: loading a GPU module waits for the device to go idle, and once a stream
        # waits on a peer's flag it is not idle until the peer signals (a peer that never does would then hang
        # the host inside the load, before `finish` could time out and say so).
        scaled_sum_(torch.zeros(8, device=self.device), torch.zeros(1, 8, device=self.device), 0.5)
        torch.cuda.synchronize(self.device)
        self.steps = 0  # syncs queued (eagerly or by a capture)
        self.launched: list[int] = []  # buckets launched this step, in order
        self.unwaited = False  # a finished sync the host has not yet waited for (bounded: `finish`)

    @staticmethod
    def flags_needed(buckets: int, size: int) -> int:
        return (2 * buckets + 1) * size

    @property
    def buffer(self) -> torch.Tensor:
        return self.memory.buffer

    # flag indices in each rank's array: what rank `src` says about bucket b
    def _ready_flag(self, b: int, src: int) -> int:
        return b * self.size + src

    def _reduced(self, b: int, src: int) -> int:
        return (len(self.ranges) + b) * self.size + src

    def _done(self, src: int) -> int:
        return 2 * len(self.ranges) * self.size + src

    def _slice(self, b: int, r: int) -> tuple[int, int]:
        start, stop = self.ranges[b]
        width = (stop - start) // self.size
        return start + r * width, start + (r + 1) * width

    def launch(self, b: int) -> None:
        """Start bucket b's collective; its gradients are complete on the current stream."""
        me, raw = self.rank, self._raw
        self._ready.record(torch._C._cuda_getCurrentRawStream(self.device.index))
        self._ready.block(raw["signal"])
        for p in self.peers:
            stream_write(raw["signal"], self.memory.flag(p, self._ready_flag(b, me)), 1)
        lo, hi = self._slice(b, me)
        slot = len(self.launched) % self.SLOTS
        own, scratch = self._operands(b, slot, lo, hi)
        # the pull stream joins the current stream's order (a capture forks it from there) and, from the third
        # bucket of a step on, waits until the reduction that last read this scratch slot is done (the previous
        # step's were waited for by its `finish`)
        self._ready.block(raw["pull"])
        if len(self.launched) >= self.SLOTS:
            self._slot_free[slot].block(raw["pull"])
        for p in self.peers:
            stream_take(raw["pull"], self.memory.flag(me, self._ready_flag(b, p)))
        width = (hi - lo) * self._item
        for j, p in enumerate(self.peers):
            stream_copy(raw["pull"], scratch.data_ptr() + j * width, self.memory.base[p] + lo * self._item, width)
        self._pulled.record(raw["pull"])
        self._ready.block(raw["reduce"])
        self._pulled.block(raw["reduce"])
        with torch.cuda.stream(self.reduce):
            scaled_sum_(own, scratch, self.scale)
        self._slot_free[slot].record(raw["reduce"])
        if not self.scatter_only:
            for p in self.peers:
                stream_write(raw["reduce"], self.memory.flag(p, self._reduced(b, me)), 1)
            self._ready.block(raw["gather"])
            for p in self.peers:
                stream_take(raw["gather"], self.memory.flag(me, self._reduced(b, p)))
                plo, phi = self._slice(b, p)
                offset, nbytes = plo * self._item, (phi - plo) * self._item
                stream_copy(raw["gather"], self.memory.base[me] + offset, self.memory.base[p] + offset, nbytes)
        self.launched.append(b)

    def _operands(self, b: int, slot: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of bucket b, and the scratch rows its peers' slices are pulled into (cached views)."""
        views = self._views.get((b, slot))
        if views is None:
            scratch = self.scratch[slot][: len(self.peers) * (hi - lo)].view(len(self.peers), hi - lo)
            views = self._views[(b, slot)] = (self.buffer[lo:hi], scratch)
        return views

    def finish(self) -> None:
        """The current stream waits until every launched bucket is synced here and every peer is done reading
        this rank's buffer (so the next backward may write it); then, outside a capture, the host waits for that,
        bounded by the memory's `timeout_s` (also for a sync a replayed graph queued: `unwaited`)."""
        if self.launched:
            if len(self.launched) != len(self.ranges):
                raise RuntimeError(
                    f"copy-engine sync finished with {len(self.launched)} of {len(self.ranges)} "
                    "buckets launched; every rank must launch every bucket each step"
                )
            self._queue_done()
            self.launched = []
            self.unwaited = True
        if self.unwaited and not torch.cuda.is_current_stream_capturing():
            self.steps += 1
            self._wait_bounded()
            self.unwaited = False

    def _queue_done(self) -> None:
        me = self.rank
        last = self.reduce if self.scatter_only else self.gather
        if last is not self.reduce:
            last.wait_stream(self.reduce)
        for p in self.peers:
            stream_write(last, self.memory.flag(p, self._done(me)), 1)
        compute = torch.cuda.current_stream(self.device)
        for side in (last, self.pull, self.signal):  # every stream the step forked is joined back
            compute.wait_stream(side)
        # wait for every peer's DONE before clearing any: while the wait lasts, the missing peers' flags are the 0s
        for p in self.peers:
            stream_wait(compute, self.memory.flag(me, self._done(p)), 1)
        for p in self.peers:
            stream_write(compute, self.memory.flag(me, self._done(p)), 0)

    def _wait_bounded(self) -> None:
        """Wait on the host for the current stream's work so far (the queued sync), at most `timeout_s`. A peer
        that never syncs would leave the GPU waiting and the host silent at its next read of the GPU: bound it here
        (the step reads the gradient norm right after this anyway, so the host waits either way)."""
        me = self.rank
        synced = torch.cuda.Event()
        synced.record(torch.cuda.current_stream(self.device))
        deadline, pause = time.monotonic() + self.memory.timeout_s, 0.0
        while not synced.query():
            if time.monotonic() > deadline:
                side = torch.cuda.Stream(self.device)  # the current stream is the one waiting: read beside it
                flags = torch.empty(self.memory.flags[me].shape, dtype=torch.int32, pin_memory=True)
                with torch.cuda.stream(side):
                    flags.copy_(self.memory.flags[me], non_blocking=True)
                side.synchronize()
                missing = [p for p in self.peers if int(flags[self._done(p)]) == 0]
                raise RuntimeError(
                    f"copy-engine gradient sync: step {self.steps} not done after "
                    f"{self.memory.timeout_s:.0f} s; DP peer(s) {missing or self.peers} (ranks in the "
                    "DP group) never finished theirs"
                )
            time.sleep(pause)
            pause = min(1e-4, pause + 1e-5)  # the host reacts within 0.1 ms: the clip norm follows at once

    def host_state(self) -> tuple:
        """The host bookkeeping a captured step leaves (a CUDA-graphed schedule restores it after each replay)."""
        return list(self.launched), self.unwaited

    def set_host_state(self, state: tuple) -> None:
        self.launched, self.unwaited = list(state[0]), state[1]


def copy_engine_available(group, device: torch.device) -> tuple[bool, str]:
    """(True, "") where every rank of `group` can run `CopyEngineSync` over symmetric memory: CUDA, stream
    memory operations, one host, and peer-to-peer access between the group's GPUs; else (False, why).
    A collective: every rank gets the same answer."""
    import socket

    from tpframe.comm.topology import local_report, p2p_problem

    why, report = "", None
    if device.type != "cuda":
        why = f"needs CUDA devices, this rank has {device}"
    elif not stream_memops_supported(device):
        why = "this GPU or driver does not run stream memory operations"
    else:
        report = local_report(device)
    reports = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, (socket.gethostname(), why, report), group=group)
    hosts = {h for h, _, _ in reports}
    reasons = sorted({w for _, w, _ in reports if w})
    if reasons:
        return False, reasons[0]
    if len(hosts) > 1:
        return False, f"the group spans hosts {sorted(hosts)}; copy engines reach one host's GPUs only"
    problem = p2p_problem([r for _, _, r in reports])
    return (False, problem) if problem else (True, "")


DP_COMMS = ("nccl", "copy_engine")


def dp_peer_memory(requested: str, group, size: int, device: torch.device, *, timeout_s: float | None = None):
    """The `peer_memory` factory a GradBuffer over `group` gets for parallel.dp_comm=`requested`, or None (NCCL):
    for "copy_engine" where every rank can run it; otherwise one warning, and NCCL. A collective."""
    if requested not in DP_COMMS:
        raise ValueError(f"parallel.dp_comm={requested!r}: choose one of {', '.join(DP_COMMS)}")
    if requested == "nccl" or size == 1:
        return None
    ok, why = copy_engine_available(group, device)
    if not ok:
        import warnings

        warnings.warn(f"parallel.dp_comm=copy_engine is unavailable ({why}); gradients sync over NCCL", stacklevel=2)
        return None
    return functools.partial(symmetric_peer_memory, group, device=device, timeout_s=timeout_s or TIMEOUT_S)
