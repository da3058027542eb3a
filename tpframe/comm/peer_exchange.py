"""Tensors pushed into peers' memory by the copy engines, ordered by stream memory operations: the transport of
async TP (tpframe/layers/async_tp.py).

Why: NCCL's kernels (and tpframe's symm kernels) hold SMs while they move bytes, and cuBLAS's Hopper GEMMs are
persistent, so a GEMM beside them either waits or slows them (benchmarks/RESULTS.md, 'GEMMs beside
communication: the SM contention, and the SM margin that cures it'). A copy between GPUs by
`cudaMemcpyAsync` runs on the copy engines (DMA) and holds no SM: the GEMM beside it keeps every SM.

Each rank owns, in memory every peer can write (torch's symmetric memory; CUDA IPC in the one-GPU tests), `SLOTS`
regions of `size` blocks and two int32 flag arrays; block s of a region is where source s writes. For the c-th push
of a tensor t from rank s to rank d (counted on both sides: every rank makes the same pushes in the same order, as
with any collective), in region slot c % SLOTS, a two-flag handshake whose flags are 0 or 1:
  s, push stream:   wait for the compute stream (t is ready); wait FREE[d][slot] == 1 in s's flags (d has read
                    what s pushed into this slot before; 1 from the start), set it to 0; copy t into block s of d's
                    region (copy engine); set ARRIVED[s][slot] = 1 in d's flags;
  d, compute stream (`Incoming.wait`): wait ARRIVED[s][slot] == 1, set it to 0; read the block in place (a GEMM's
                    operand);
  d, compute stream (`Incoming.release`): after the reads, set FREE[d][slot] = 1 in s's flags.
Each flag is set by one side and cleared by the other, in turn, so after every completed exchange the flags are back
where they started: the same stream operations are right every time they run, which is what lets a CUDA graph
capture the layers and replay them (no counter or generation is baked into the graph). Each op ends with its compute
stream waiting for the push stream (`join`), so the pushed tensors' memory is not reused before their copies have
run and a capture's forked stream is joined back.
`gather(t)` pushes t to every peer and copies it into block `rank` of this rank's own region (a local copy-engine
copy), so the region is the whole all-gathered tensor, contiguous: one GEMM can read it (a weight gradient over the
whole sequence, rounded once).
Waits are the GPU front end's (`cuStreamWaitValue32`), never an SM's. Callers push before they wait, and read what
they were pushed before pushing into that slot again (the layers read each push within the same op): then every wait
depends only on work both ranks have already queued, so no order of arrival deadlocks, even where CUDA stalls the
host until the GPU is idle (loading a kernel module the first time it is launched).

Blocks are sized to the largest tensor pushed so far (rounded up to 16 bytes, so a model's fixed-shape pushes
fill them and a gathered region is one contiguous tensor); they grow on the first push larger than them: every
rank makes that push at the same call, so the re-allocation (a collective) happens in step on all ranks.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.distributed as dist

from tpframe.comm.peer_memory import (
    PeerMemory,
    RawEvent,
    copy_engine_available,
    stream_copy,
    stream_take,
    stream_write,
    symmetric_peer_memory,
)

_ALIGN = 16  # bytes: every block starts aligned for any dtype


class Incoming:
    """A tensor a peer pushed (or is pushing) into this rank's region: `wait()` returns it once it has arrived (the
    current stream waits, not the host); `release()` hands the block back once the current stream's reads of it
    are queued. Use it between the two only."""

    __slots__ = ("exchange", "source", "slot", "shape", "dtype", "waited")

    def __init__(self, exchange: PeerExchange, source: int, slot: int, shape, dtype):
        self.exchange, self.source, self.slot, self.shape, self.dtype = exchange, source, slot, shape, dtype
        self.waited = False

    def wait(self) -> torch.Tensor:
        ex = self.exchange
        if not self.waited:  # the wait clears the flag, so it is queued once
            ex._take(ex.current(), ex.memory.flag(ex.rank, ex._arrived(self.source, self.slot)))
            self.waited = True
        return ex._view(self.slot, self.source, self.shape, self.dtype)

    def release(self) -> None:
        if not self.waited:  # its ARRIVED flag would stay set and the next push's be lost: the handshake breaks
            raise RuntimeError("PeerExchange: release() of a block that was never waited for")
        ex = self.exchange
        ex._set(ex.current(), ex.memory.flag(self.source, ex._free(ex.rank, self.slot)), 1)


class Gathered:
    """What `PeerExchange.gather` returns: `wait(peer)` one peer's block; `full()` the whole gathered tensor (every
    block arrived, this rank's own copied in); `release()` after the reads, as for `Incoming`."""

    __slots__ = ("exchange", "incoming", "slot", "own", "shape", "dtype")

    def __init__(self, exchange: PeerExchange, incoming: dict[int, Incoming], slot: int, own: RawEvent, shape, dtype):
        self.exchange, self.incoming, self.slot, self.own = exchange, incoming, slot, own
        self.shape, self.dtype = shape, dtype

    def wait(self, peer: int) -> torch.Tensor:
        return self.incoming[peer].wait()

    def full(self) -> torch.Tensor:
        ex = self.exchange
        for inc in self.incoming.values():
            inc.wait()
        self.own.block(ex.current())
        return ex._view(self.slot, None, self.shape, self.dtype)

    def release(self) -> None:
        for inc in self.incoming.values():
            inc.release()


class PeerExchange:
    """`push({peer: tensor})`: each tensor copied into that peer's region for this rank; returns, per peer, the
    `Incoming` tensor that peer pushes to this rank in its matching call (same shape and dtype: the collectives
    built on it are symmetric). `gather(tensor)`: the all-gather of dim 0 into one of this rank's regions.
    `memory_factory(nbytes=, flags=)` allocates a PeerMemory (tpframe/comm/peer_memory.py; a collective).

    Each layer call makes a few pushes, waits and releases, so their host cost counts at small shapes: they work
    on raw stream handles and addresses (ctypes driver calls), not torch's stream and tensor objects. Every op
    that pushes ends with `join()`."""

    SLOTS = 4  # regions: the column layer's backward has two pushes from each peer in flight

    def __init__(self, memory_factory, *, rank: int, size: int, device: torch.device):
        self.factory, self.rank, self.size, self.device = memory_factory, rank, size, device
        self.peers = [(rank + j) % size for j in range(1, size)]  # nearest first
        self.stream = torch.cuda.Stream(device)
        self._order, self._joined = RawEvent(), RawEvent()
        self._own = [RawEvent() for _ in range(self.SLOTS)]  # per region: `gather`'s local copy done
        self.memory: PeerMemory | None = None
        self.slot_bytes = 0
        self.sent = [0] * size  # per peer, since the slots were last (re)allocated
        self.received = [0] * size
        self.pushes = 0  # tensors pushed in all
        self._views: dict = {}  # (slot, block or None, shape, dtype) -> this rank's memory as a tensor
        self._held: list[torch.Tensor] = []  # pushed since the last join: their copies may not have run yet

    @classmethod
    def for_group(cls, group, device: torch.device) -> PeerExchange | None:
        """Over torch's symmetric memory on `group` where every rank can run it (CUDA, stream memory operations,
        one host, peer access); else None with one warning. A collective."""
        ok, why = copy_engine_available(group, device)
        if not ok:
            warnings.warn(
                f"async TP's copy-engine mode is unavailable ({why}); the layers take the plain path", stacklevel=3
            )
            return None
        factory = functools.partial(symmetric_peer_memory, group, device=device)
        return cls(factory, rank=dist.get_rank(group), size=dist.get_world_size(group), device=device)

    def current(self) -> int:
        """The raw handle of this device's current stream."""
        return torch._C._cuda_getCurrentRawStream(self.device.index)

    def join(self) -> None:
        """The current stream waits for everything queued on the push stream so far: the end of every op that
        pushes (the pushed tensors' memory may then be reused; under CUDA-graph capture, the push stream, forked
        into the capture by the first push, is joined back)."""
        self._joined.after(self.current(), self.stream.cuda_stream)
        self._held.clear()

    # -- flags (two stream memory operations; a stand-in exchange may point them elsewhere)
    def _take(self, stream: int, address: int) -> None:
        """Queue on `stream`: wait until the flag at `address` is 1, then set it to 0."""
        stream_take(stream, address)

    def _set(self, stream: int, address: int, value: int) -> None:
        stream_write(stream, address, value)

    # -- layout: per rank SLOTS regions of `size` blocks (block s: from source s); ARRIVED flags by (source, slot),
    # FREE by (reader, slot)
    def _arrived(self, source: int, slot: int) -> int:
        return source * self.SLOTS + slot

    def _free(self, reader: int, slot: int) -> int:
        return (self.size + reader) * self.SLOTS + slot

    def _offset(self, slot: int, block: int) -> int:
        return (slot * self.size + block) * self.slot_bytes

    def _view(self, slot: int, block: int | None, shape, dtype) -> torch.Tensor:
        """Block `block` of this rank's region `slot` as a tensor of `shape`; block None: the region's blocks as one
        tensor of `size * shape[0]` rows, in place where the blocks fill their slots (the layers' pushes all have
        the one shape of a sequence block), else a copy."""
        key = (slot, block, shape, dtype)
        view = self._views.get(key)
        if view is None:
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            if block is None and nbytes != self.slot_bytes:
                return torch.cat([self._view(slot, b, shape, dtype) for b in range(self.size)])
            if block is None:
                shape = (self.size * shape[0],) + tuple(shape[1:])
                block, nbytes = 0, self.size * nbytes
            start = self._offset(slot, block)
            view = self.memory.buffers[self.rank][start : start + nbytes].view(dtype).view(shape)
            self._views[key] = view
        return view

    def _ensure(self, nbytes: int) -> None:
        """Blocks of at least `nbytes` (a collective, reached by every rank at the same push)."""
        if nbytes <= self.slot_bytes:
            return
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"PeerExchange: a push of {nbytes} bytes under CUDA-graph capture outgrows the slots "
                f"({self.slot_bytes} bytes), which cannot be re-allocated there: run the captured "
                "step once eagerly before capturing it"
            )
        if self.memory is not None:  # every earlier push was read: the compute streams waited for them
            torch.cuda.synchronize(self.device)
            self.memory, self._views = None, {}
        self.slot_bytes = -(-nbytes // _ALIGN) * _ALIGN
        self.memory = self.factory(nbytes=self.SLOTS * self.size * self.slot_bytes, flags=2 * self.size * self.SLOTS)
        # every slot starts free: FREE = 1 (peers set it only after this rank's first push, queued after this)
        self.memory.flags[self.rank][self._free(0, 0) :].fill_(1)
        self.sent, self.received = [0] * self.size, [0] * self.size

    def push(self, sends: dict[int, torch.Tensor]) -> dict[int, Incoming]:
        """Copy each `sends[peer]` (contiguous, on this device) into `peer`'s region for this rank, on the push
        stream after the current stream's work so far; return what each of those peers pushes here in return."""
        for t in sends.values():
            if not t.is_contiguous():
                raise ValueError("PeerExchange.push needs contiguous tensors")
        self._ensure(max(t.numel() * t.element_size() for t in sends.values()))
        return self._send(sends)

    def _send(self, sends: dict[int, torch.Tensor]) -> dict[int, Incoming]:
        push = self.stream.cuda_stream
        self._order.after(push, self.current())
        incoming = {}
        for peer, t in sends.items():
            slot = self.sent[peer] % self.SLOTS
            self.sent[peer] += 1
            self._take(push, self.memory.flag(self.rank, self._free(peer, slot)))
            stream_copy(
                push, self.memory.base[peer] + self._offset(slot, self.rank), t.data_ptr(), t.numel() * t.element_size()
            )
            self._set(push, self.memory.flag(peer, self._arrived(self.rank, slot)), 1)
            self._held.append(t)
            self.pushes += 1
            incoming[peer] = Incoming(self, peer, self.received[peer] % self.SLOTS, t.shape, t.dtype)
            self.received[peer] += 1
        return incoming

    def gather(self, t: torch.Tensor) -> Gathered:
        """All-gather of `t` (contiguous) over dim 0: pushed to every peer, and copied (copy engine) into block
        `rank` of the region the peers' blocks land in, so that `full()` reads the gathered tensor in place."""
        if not t.is_contiguous():
            raise ValueError("PeerExchange.gather needs a contiguous tensor")
        nbytes = t.numel() * t.element_size()
        self._ensure(nbytes)
        incoming = self._send({p: t for p in self.peers})
        slots = {inc.slot for inc in incoming.values()}
        if len(slots) != 1:
            raise RuntimeError(
                f"PeerExchange.gather: peers' blocks in different regions {sorted(slots)} "
                "(pushes to some peers only, between gathers)"
            )
        slot = slots.pop()
        push = self.stream.cuda_stream  # after the compute stream's reads of this region's last use
        stream_copy(push, self.memory.base[self.rank] + self._offset(slot, self.rank), t.data_ptr(), nbytes)
        self._own[slot].record(push)
        return Gathered(self, incoming, slot, self._own[slot], t.shape, t.dtype)
