"""Memory every GPU of a group can address, and the driver's stream operations that order access to it: the
primitives of async TP's copy-engine transport (tpframe/comm/peer_exchange.py).

A copy into a peer's mapped memory (`stream_copy`) runs on the copy engines (DMA) and holds no SM; its ordering
across GPUs is done by 32-bit flags written and waited on by the GPU's front end (`stream_write` / `stream_wait`,
cuStreamWriteValue32 / cuStreamWaitValue32: no SM either). The calls go to the driver through ctypes, on raw
stream handles and addresses, at a fraction of torch's host cost per operation.

The memory: `symmetric_peer_memory` (torch's symmetric memory: one host, peer access, CUDA); the one-GPU tests share
`PeerMemory` between processes by CUDA IPC handles instead (tests/test_async_tp_ce_gpu.py).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int32)(*addr - value) >= 0
_V2_MEMOPS_DRIVER = 11070  # the driver API version from which the V2 stream memory operations exist (CUDA 11.7)


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


def stream_write(stream: int, address: int, value: int) -> None:
    """When `stream` (a raw stream handle) reaches this point, store `value` (32 bits) at device address `address`
    (after a fence)."""
    _check(_driver()["cuStreamWriteValue32_v2"](stream, address, value & 0xFFFFFFFF, 0), "cuStreamWriteValue32")


def stream_wait(stream: int, address: int, value: int) -> None:
    """Work queued on `stream` (a raw stream handle) after this waits until the int32 at `address` is >= `value`
    (wrap-safe)."""
    _check(_driver()["cuStreamWaitValue32_v2"](stream, address, value & 0xFFFFFFFF, _WAIT_GEQ), "cuStreamWaitValue32")


def stream_take(stream: int, address: int) -> None:
    """Work queued on `stream` after this waits until the int32 flag at `address` is 1, which it then resets to 0
    (one side of a handshake whose other side sets the flag to 1 with `stream_write`)."""
    stream_wait(stream, address, 1)
    stream_write(stream, address, 0)


def stream_copy(stream: int, dst: int, src: int, nbytes: int) -> None:
    """Queue a device-to-device copy of `nbytes` on `stream` (raw handle and addresses: what torch's same-device
    `copy_` calls, without its host cost; a peer's mapped memory as `dst` makes it a copy engine's transfer)."""
    _check(_driver()["copy"](dst, src, nbytes, stream), "cuMemcpyDtoDAsync")


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
    """One byte buffer and one int32 flag array per rank, each visible to every rank.

    `buffers[r]` / `flags[r]` are rank r's, as tensors this process can read (r == rank: its own)."""

    rank: int
    size: int
    buffers: list[torch.Tensor]
    flags: list[torch.Tensor]
    keepalive: list = field(default_factory=list)

    def __post_init__(self):
        # device addresses, taken once: the transport computes a few per stream operation, on the host's hot path
        self.base = [b.data_ptr() for b in self.buffers]  # of each rank's buffer (for stream_copy)
        self._flag_base = [f.data_ptr() for f in self.flags]

    def flag(self, owner: int, index: int) -> int:
        """The device address of int32 flag `index` of rank `owner`'s array (for stream_write / stream_wait)."""
        return self._flag_base[owner] + 4 * index


def symmetric_peer_memory(group, *, nbytes: int, flags: int, device: torch.device) -> PeerMemory:
    """Buffers of `nbytes` bytes and `flags` int32 flags from torch's symmetric memory on `group` (a collective).
    Raises where it is unavailable."""
    from tpframe.comm.symm import symmetric_memory

    symm_mem = symmetric_memory(group, device)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    out: dict[str, list[torch.Tensor]] = {}
    handles = []
    for key, n, kind in (("buffers", nbytes, torch.uint8), ("flags", flags, torch.int32)):
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
    return PeerMemory(rank, size, out["buffers"], out["flags"], handles)


def copy_engine_available(group, device: torch.device) -> tuple[bool, str]:
    """(True, "") where every rank of `group` can run the copy-engine transport over symmetric memory: CUDA, stream
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
