"""Tensors pushed into peers' memory by the copy engines, ordered by stream memory operations: the transport of
async TP's "copy_engine" mode (tpframe/layers/async_tp_ce.py).

Why: NCCL's kernels (and tpframe's symm kernels) hold SMs while they move bytes, and cuBLAS's Hopper GEMMs are
persistent, so a GEMM beside them either waits or slows them (tpframe/comm/margin.py). A copy between GPUs by
`cudaMemcpyAsync` runs on the copy engines (DMA) and holds no SM: the GEMM beside it keeps every SM.

Each rank owns, in memory every peer can write (torch's symmetric memory; CUDA IPC in the one-GPU tests), `SLOTS`
slots per peer it receives from and two int32 flag arrays. For a push of tensor t from rank s to rank d, the c-th from s
to d (counted on both sides: every rank makes the same pushes in the same order, as with any collective), in slot
c % SLOTS, generation g = c // SLOTS + 1:
  s, push stream:   wait for the compute stream (t is ready); wait FREED[d][slot] >= g - 1 in s's flags (d has
                    read the slot's previous generation); copy t into d's slot (copy engine); write ARRIVED[s][slot] = g
                    into d's flags;
  d, compute stream (`Incoming.wait`): wait ARRIVED[s][slot] >= g; read the slot in place (a GEMM's operand);
  d, compute stream (`Incoming.release`): after the reads, write FREED[d][slot] = g into s's flags.
Waits are the GPU front end's (`cuStreamWaitValue32`), never an SM's, and compare `>=` wrap-safely: no flag is
ever reset. Callers push before they wait, and read what they were pushed before pushing into that slot again
(the layers read each push within the same op): then every wait depends only on work both ranks have already
queued, so no order of arrival deadlocks, even where CUDA stalls the host until the GPU is idle (loading a kernel
module the first time it is launched). Not under CUDA-graph capture (a replay would repeat the generations).

Slots grow on the first push larger than them: every rank makes that push at the same call, so the re-allocation
(a collective) happens in step on all ranks.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.distributed as dist

from tpframe.comm.copy_engine import (PeerMemory, StreamOrder, copy_engine_available, stream_copy, stream_wait,
                                     stream_write)

_ALIGN = 1 << 20  # slot sizes are rounded up to whole MiB


class Incoming:
    """A tensor a peer pushed (or is pushing) into this rank's slot: `wait()` returns it once it has arrived (the
    current stream waits, not the host); `release()` hands the slot back once the current stream's reads of it
    are queued. Use it between the two only."""

    __slots__ = ("exchange", "source", "slot", "gen", "shape", "dtype")

    def __init__(self, exchange: "PeerExchange", source: int, slot: int, gen: int, shape, dtype):
        self.exchange, self.source, self.slot, self.gen = exchange, source, slot, gen
        self.shape, self.dtype = shape, dtype

    def wait(self) -> torch.Tensor:
        ex = self.exchange
        stream_wait(ex.current(), ex.flag(ex.rank, ex._arrived(self.source, self.slot)), self.gen)
        return ex._incoming_view(self.source, self.slot, self.shape, self.dtype)

    def release(self) -> None:
        ex = self.exchange
        stream_write(ex.current(), ex.flag(self.source, ex._freed(ex.rank, self.slot)), self.gen)


class PeerExchange:
    """`push({peer: tensor})`: each tensor copied into that peer's slot for this rank; returns, per peer, the
    `Incoming` tensor that peer pushes to this rank in its matching call (same shape and dtype: the collectives
    built on it are symmetric). `memory_factory(numel=, flags=)` allocates a PeerMemory of bytes (a collective).

    Each layer call makes a few pushes, waits and releases, so their host cost counts at small shapes: they work
    on raw stream handles and addresses (ctypes driver calls), not torch's stream and tensor objects."""

    SLOTS = 4  # per source: the column layer's backward has two pushes from each peer in flight

    def __init__(self, memory_factory, *, rank: int, size: int, device: torch.device):
        self.factory, self.rank, self.size, self.device = memory_factory, rank, size, device
        self.peers = [(rank + j) % size for j in range(1, size)]  # nearest first
        self.stream = torch.cuda.Stream(device)
        self._order = StreamOrder()
        self.memory: PeerMemory | None = None
        self.slot_bytes = 0
        self.sent = [0] * size
        self.received = [0] * size
        self._views: dict = {}  # (source, slot, shape, dtype) -> this rank's slot as a tensor

    @classmethod
    def for_group(cls, group, device: torch.device) -> "PeerExchange | None":
        """Over torch's symmetric memory on `group` where every rank can run it (CUDA, stream memory operations,
        one host, peer access); else None with one warning. A collective."""
        ok, why = copy_engine_available(group, device)
        if not ok:
            warnings.warn(f"async TP's copy-engine mode is unavailable ({why}); the layers take the plain path",
                          stacklevel=3)
            return None
        from tpframe.comm.copy_engine import symmetric_peer_memory

        factory = functools.partial(symmetric_peer_memory, group, device=device, dtype=torch.uint8)
        return cls(factory, rank=dist.get_rank(group), size=dist.get_world_size(group), device=device)

    def current(self) -> int:
        """The raw handle of this device's current stream."""
        return torch._C._cuda_getCurrentRawStream(self.device.index)

    # -- layout: per rank, (size - 1) * SLOTS slots (by source, this rank's own excluded), ARRIVED flags by
    # (source, slot), FREED by (reader, slot)
    def _arrived(self, source: int, slot: int) -> int:
        return source * self.SLOTS + slot

    def _freed(self, reader: int, slot: int) -> int:
        return (self.size + reader) * self.SLOTS + slot

    def flag(self, owner: int, index: int) -> int:
        return self._flag_base[owner] + 4 * index

    def _offset(self, owner: int, source: int, slot: int) -> int:
        return (((source - owner - 1) % self.size) * self.SLOTS + slot) * self.slot_bytes

    def _incoming_view(self, source: int, slot: int, shape, dtype) -> torch.Tensor:
        key = (source, slot, shape, dtype)
        view = self._views.get(key)
        if view is None:
            start = self._offset(self.rank, source, slot)
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            view = self._views[key] = self.memory.buffers[self.rank][start : start + nbytes].view(dtype).view(shape)
        return view

    def _ensure(self, nbytes: int) -> None:
        """Slots of at least `nbytes` (a collective, reached by every rank at the same push)."""
        if nbytes <= self.slot_bytes:
            return
        if self.memory is not None:  # every earlier push was read: the compute streams waited for them
            torch.cuda.synchronize(self.device)
            self.memory, self._views = None, {}
        self.slot_bytes = -(-nbytes // _ALIGN) * _ALIGN
        self.memory = self.factory(numel=(self.size - 1) * self.SLOTS * self.slot_bytes,
                                   flags=2 * self.size * self.SLOTS)
        self._flag_base = [f.data_ptr() for f in self.memory.flags]
        self._buffer_base = [b.data_ptr() for b in self.memory.buffers]
        self.sent, self.received = [0] * self.size, [0] * self.size

    def push(self, sends: dict[int, torch.Tensor]) -> dict[int, Incoming]:
        """Copy each `sends[peer]` (contiguous, on this device) into `peer`'s slot for this rank, on the push stream
        after the current stream's work so far; return what each of those peers pushes here in return."""
        for t in sends.values():
            if not t.is_contiguous():
                raise ValueError("PeerExchange.push needs contiguous tensors")
        self._ensure(max(t.numel() * t.element_size() for t in sends.values()))
        push = self.stream.cuda_stream
        self._order.after(push, self.current())
        incoming = {}
        for peer, t in sends.items():
            count = self.sent[peer]
            self.sent[peer] += 1
            slot, gen = count % self.SLOTS, count // self.SLOTS + 1
            if gen > 1:
                stream_wait(push, self.flag(self.rank, self._freed(peer, slot)), gen - 1)
            nbytes = t.numel() * t.element_size()
            stream_copy(push, self._buffer_base[peer] + self._offset(peer, self.rank, slot), t.data_ptr(), nbytes)
            stream_write(push, self.flag(peer, self._arrived(self.rank, slot)), gen)
            t.record_stream(self.stream)  # the allocator must not hand t's memory out before the copy has run
            count = self.received[peer]
            self.received[peer] += 1
            incoming[peer] = Incoming(self, peer, count % self.SLOTS, count // self.SLOTS + 1, t.shape, t.dtype)
        return incoming
