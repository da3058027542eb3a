"""A barrier-free one-shot all-reduce for decode-sized messages (the protocol TensorRT-LLM calls Lamport).

Each rank pushes its input into a segment of every peer's receive buffer, and each reader polls its own
buffer until every peer's data has arrived, recognising arrival by the data itself: the buffer is filled
with a sentinel that no input element carries, so there is no signal, no barrier and no second round trip.

    buffer (every rank, symmetric): 3 slots x WORLD segments x `seg` bytes, initially all sentinel
    call k uses slot k % 3:
      push   rank r writes its input, with sentinel values replaced, into segment r of slot k%3 of every peer
      clear  rank r refills slot (k+2)%3 (used by call k-1, already read) with the sentinel
      reduce rank r polls segment p of its own slot k%3 until no element is the sentinel, for every peer p,
             and sums the WORLD inputs in rank order (every rank rounds alike: replicas stay bit-identical)
Why three slots suffice: while rank r is in call k, no peer has finished call k+1 (that needs r's call
k+1 data), so peers write only slots k%3 and (k+1)%3 of r's buffer; slot (k+2)%3 is quiet until call
k+2, which starts only after r's call k has completed. So clearing needs no barrier either.

Sentinel: the 32-bit word 0x80008000. For 16-bit dtypes each half is -0.0 (0x8000), and an input -0.0
is sent as +0.0 (the same number); for fp32 it is the denormal -4.6e-41, sent as -0.0. Clearing writes
whole words whatever the dtype, so slots can change dtype between calls.
The call counter and each slot's last extent live in a small device array (`state`: [call, arrivals,
words used by slot 0, 1, 2]), so the kernel replays correctly inside a CUDA graph.
Peers' writes are plain stores; readers use volatile loads (no stale cache lines). Every program
pushes all of its tiles before it waits, and the grid fits on the GPU at once, so no wait can block a
write it depends on.
Kernel signature (shared with the other data kernels, see launch.py): runtime int args
(x_addr, out_addr, buf_table, state_addr, n, seg, rank), then the constexprs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpframe.comm.symm.barrier import as_ptr, peer_ptr
from tpframe.comm.symm.launch import KernelLauncher
from tpframe.comm.symm.tiles import store_tile

RUNTIME_ARGS = ("x_addr", "out_addr", "buf_table", "state_addr", "n", "seg", "rank")
SENTINEL_WORD = -2147450880  # 0x80008000 as int32
_SENTINEL_WORD = tl.constexpr(SENTINEL_WORD)  # the same, for the kernel
NUM_WARPS = 4
STATE_WORDS = 8
DEFAULT_SEGMENT_BYTES = 1 << 20  # the largest message, per rank and slot
_BITS = {
    torch.bfloat16: (tl.int16, tl.bfloat16),
    torch.float16: (tl.int16, tl.float16),
    torch.float32: (tl.int32, tl.float32),
}  # dtype -> (the integer type its bits travel as, the float type)


@triton.jit
def _load(ptr, offs, mask, full, VOLATILE: tl.constexpr):
    if full:
        v = tl.load(ptr + offs, volatile=VOLATILE)
    else:
        v = tl.load(ptr + offs, mask=mask, other=0, volatile=VOLATILE)
    return v


@triton.jit
def _sendable(v, SENT: tl.constexpr, REPL: tl.constexpr, BITS: tl.constexpr):
    """Input bits with the sentinel pattern replaced (the same number, or the nearest zero)."""
    return tl.where(v == SENT, REPL, v).to(BITS)


@triton.jit
def _push(x, buf_table, mine, n, rank, BITS: tl.constexpr, SENT, REPL, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """My input, the sentinel replaced, into `mine` (my segment of this call's slot) of every peer's buffer."""
    for t in range(tl.program_id(0), tl.cdiv(n, BLOCK), tl.num_programs(0)):
        offs = t * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        full = t * BLOCK + BLOCK <= n
        v = _sendable(_load(x, offs, mask, full, False), SENT, REPL, BITS)
        for q in tl.static_range(WORLD):
            if q != rank:
                store_tile(peer_ptr(buf_table, q, BITS) + mine, t * BLOCK, v, mask, full)


@triton.jit
def _clear(
    state, buf_table, rank, call, slot, n, seg, ITEM: tl.constexpr, WORLD: tl.constexpr, CLEAR_BLOCK: tl.constexpr
):
    """Refill the slot of the previous call in my buffer with the sentinel, as far as it was written (in 32-bit
    words, every segment); note how far this call writes its slot."""
    pid = tl.program_id(0)
    old = (call + 2) % 3
    words = tl.load(state + 2 + old, volatile=True)
    if pid == 0:
        tl.store(state + 2 + slot, tl.cdiv(n * ITEM, 4))
    seg_words = seg * ITEM // 4
    rows = tl.arange(0, WORLD)
    cleared = peer_ptr(buf_table, rank, tl.int32) + old * WORLD * seg_words + rows * seg_words
    for t in range(pid, tl.cdiv(words, CLEAR_BLOCK), tl.num_programs(0)):
        cols = t * CLEAR_BLOCK + tl.arange(0, CLEAR_BLOCK)
        sentinel = tl.full([WORLD, CLEAR_BLOCK], _SENTINEL_WORD, tl.int32)
        tl.store(cleared[:, None] + cols[None, :], sentinel, mask=(cols < words)[None, :] & (rows >= 0)[:, None])


@triton.jit
def _arrived(src, offs, mask, full, SENT):
    """A tile of a peer's segment, polled until no element is the sentinel (all of it has arrived)."""
    v = _load(src, offs, mask, full, True)
    pending = tl.max(tl.where(mask & (v == SENT), 1, 0), axis=0)
    while pending > 0:
        v = _load(src, offs, mask, full, True)
        pending = tl.max(tl.where(mask & (v == SENT), 1, 0), axis=0)
    return v


@triton.jit(do_not_specialize=RUNTIME_ARGS)
def lamport_all_reduce_kernel(
    x_addr: tl.int64,
    out_addr: tl.int64,
    buf_table: tl.int64,
    state_addr: tl.int64,
    n: tl.int32,
    seg: tl.int32,
    rank: tl.int32,
    DT: tl.constexpr,
    BITS: tl.constexpr,
    ITEM: tl.constexpr,
    SENT: tl.constexpr,
    REPL: tl.constexpr,
    VEC: tl.constexpr,
    WORLD: tl.constexpr,
    BLOCK: tl.constexpr,
    CLEAR_BLOCK: tl.constexpr,
    X_ALIGNED: tl.constexpr,
):
    """out[:n] = sum over ranks of x[:n] (n elements of DT); `seg`: elements of DT per buffer segment."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    state = state_addr.to(tl.pointer_type(tl.int32))
    call = tl.load(state, volatile=True)
    slot = call % 3
    seg = seg // VEC * VEC  # == seg; tells the compiler segments start 16-byte aligned
    x = as_ptr(x_addr, BITS, X_ALIGNED)
    _push(x, buf_table, (slot * WORLD + rank) * seg, n, rank, BITS, SENT, REPL, WORLD, BLOCK)
    _clear(state, buf_table, rank, call, slot, n, seg, ITEM, WORLD, CLEAR_BLOCK)
    # reduce: wait for each peer's segment of this slot in our own buffer, sum in rank order
    own = peer_ptr(buf_table, rank, BITS) + slot * WORLD * seg
    out = as_ptr(out_addr, DT, True)
    for t in range(pid, tl.cdiv(n, BLOCK), nprog):
        offs = t * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        full = t * BLOCK + BLOCK <= n
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for p in tl.static_range(WORLD):
            if p == rank:
                v = _sendable(_load(x, offs, mask, full, False), SENT, REPL, BITS)
            else:
                v = _arrived(own + p * seg, offs, mask, full, SENT)
            acc += v.to(DT, bitcast=True).to(tl.float32)
        store_tile(out, t * BLOCK, acc.to(DT), mask, full)
    # the last program to finish moves the call counter on (every program has read it by then)
    tl.debug_barrier()
    if tl.atomic_add(state + 1, 1, sem="acq_rel") == nprog - 1:
        tl.store(state + 1, 0)
        tl.store(state, call + 1)


class LamportAllReduce:
    """The barrier-free all-reduce on raw buffers: `buf_table` (int64 device tensor [world]) holds every rank's
    Lamport buffer (3 * world * seg_bytes, filled with `SENTINEL_WORD`), `state` this rank's int32 [STATE_WORDS]
    zeros. `max_programs`: the grid cap (every program must be resident at once)."""

    def __init__(
        self,
        buf_table: torch.Tensor,
        state: torch.Tensor,
        rank: int,
        world: int,
        seg_bytes: int,
        max_programs: int,
        device: torch.device,
    ):
        if seg_bytes % 16 or seg_bytes <= 0:
            raise ValueError(f"Lamport segments must be a positive multiple of 16 bytes, got {seg_bytes}")
        self.buf_table, self.state = buf_table, state  # kept alive: the kernel reads them
        self.rank, self.world, self.seg_bytes = rank, world, seg_bytes
        self.max_programs, self.device = max(1, max_programs), device
        self._launchers: dict = {}
        self._plans: dict = {}

    @staticmethod
    def buffer_bytes(world: int, seg_bytes: int = DEFAULT_SEGMENT_BYTES) -> int:
        return 3 * world * seg_bytes

    def fits(self, numel: int, dtype: torch.dtype) -> bool:
        return dtype in _BITS and 0 < numel * dtype.itemsize <= self.seg_bytes

    def all_reduce(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out[:] = sum over ranks of x (both contiguous, n elements)."""
        if not x.is_contiguous():
            x = x.contiguous()
        if not self.fits(x.numel(), x.dtype):
            raise ValueError(
                f"Lamport all-reduce of {x.numel()} {x.dtype} elements does not fit its "
                f"{self.seg_bytes}-byte segments (dtypes {sorted(map(str, _BITS))})"
            )
        self.plan(x.numel(), x.dtype, x.data_ptr() % 16 == 0)(x.data_ptr(), out.data_ptr())
        return out

    def plan(self, numel: int, dtype: torch.dtype, x_aligned: bool = True):
        """A closure (x_addr, out_addr) -> one launch for this size and dtype. Cached."""
        key = (numel, dtype, x_aligned)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > 4096:
                self._plans.clear()
            launcher = self._launcher(dtype, x_aligned)
            block = launcher.constexprs["BLOCK"]
            grid = min(max(-(-numel // block), 1), self.max_programs)
            plan = self._plans[key] = launcher.bind(
                grid,
                self.buf_table.data_ptr(),
                self.state.data_ptr(),
                numel,
                self.seg_bytes // dtype.itemsize,
                self.rank,
            )
        return plan

    def warm_up(self, dtype: torch.dtype) -> None:
        """Compile the kernel for `dtype` now (a CUDA graph capture must not compile)."""
        self._launcher(dtype, True)

    def _launcher(self, dtype: torch.dtype, x_aligned: bool) -> KernelLauncher:
        launcher = self._launchers.get((dtype, x_aligned))
        if launcher is None:
            bits, dt = _BITS[dtype]
            vec = 16 // dtype.itemsize
            sent, repl = (-32768, 0) if dtype.itemsize == 2 else (SENTINEL_WORD, -2147483648)
            constexprs = dict(
                DT=dt,
                BITS=bits,
                ITEM=dtype.itemsize,
                SENT=sent,
                REPL=repl,
                VEC=vec,
                WORLD=self.world,
                BLOCK=vec * 32 * NUM_WARPS,
                CLEAR_BLOCK=4 * 32 * NUM_WARPS,
                X_ALIGNED=x_aligned,
            )
            launcher = self._launchers[(dtype, x_aligned)] = KernelLauncher(
                lamport_all_reduce_kernel, constexprs, NUM_WARPS, self.device
            )
        return launcher

    @classmethod
    def create(
        cls,
        group,
        rank: int,
        world: int,
        device: torch.device,
        max_programs: int,
        seg_bytes: int = DEFAULT_SEGMENT_BYTES,
    ) -> LamportAllReduce:
        """Allocate and rendezvous the symmetric buffer on every rank of `group` (a collective)."""
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        nbytes = cls.buffer_bytes(world, seg_bytes)
        buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(buffer, group.group_name)
        buffer.view(torch.int32).fill_(SENTINEL_WORD)
        offset = buffer.data_ptr() - handle.buffer_ptrs[rank]
        offsets = [None] * world
        dist.all_gather_object(offsets, offset, group=group)
        if len(set(offsets)) != 1 or offset < 0 or offset + nbytes > handle.buffer_size:
            raise RuntimeError(f"Lamport buffer offsets differ between ranks or overflow: {offsets}")
        table = torch.tensor([p + offset for p in handle.buffer_ptrs], dtype=torch.int64, device=device)
        state = torch.zeros(STATE_WORDS, dtype=torch.int32, device=device)
        torch.cuda.synchronize(device)
        dist.barrier(group=group)  # every buffer holds the sentinel before any rank writes into it
        lamport = cls(table, state, rank, world, seg_bytes, max_programs, device)
        lamport._keep = (buffer, handle)
        return lamport
