"""Gradient buffers: fp32 accumulation in one flat buffer, split into buckets synced over DP as they fill.

`GradBuffer` gives every parameter a `main_grad`: an fp32 view into one flat buffer, laid out in
reverse parameter order (roughly the order backward produces gradients) and cut into buckets of
about `bucket_bytes`. A post-accumulate hook adds each backward's `param.grad` into `main_grad`
(so micro-batches accumulate in fp32 even for bf16 params) and frees `param.grad`.

Zeroing is lazy: `zero()` writes nothing; a parameter's first gradient of the step is *copied* into
its `main_grad` (a vectorized bf16->fp32 copy), later ones added. That saves a pass over the whole
fp32 buffer per step and, with one micro-batch, the mixed-dtype add (torch's bf16+fp32 add is not vectorized, the
copy is: benchmarks/RESULTS.md, 'The full optimizer step against forward+backward'). A parameter that received
no gradient in the step is zeroed when its bucket is synced.

Only after `start_sync()` (the schedule calls it before the last micro-batch's backward) does a
bucket whose every gradient has arrived launch its DP collective, asynchronously, while backward
goes on (`overlap=True`); earlier micro-batches cause no DP traffic. `finish_sync()` launches what
is left and waits. The collective averages in fp32 (NCCL inside the collective, ReduceOp.AVG; gloo
by a scaling pass before it): an all-reduce (ddp: every rank gets every gradient) or a
reduce-scatter (zero1: rank d gets slice d of each bucket, in place: the result lands in the
bucket's slice d of this rank's own buffer, so no second buffer is needed). With `reduce_dtype=torch.bfloat16`
(parallel.grad_reduce_dtype) each bucket is rounded to bf16 for the collective, which moves half the bytes, and its
result is written back into the fp32 buffer: micro-batches still accumulate in fp32, and only the sum over DP is
rounded (Megatron-LM's --grad-reduce-in-bf16 accumulates in bf16 as well). On CUDA the rounding, the collective and
the write-back are queued at the bucket's launch on a stream of their own (one bucket's bf16 copy alive at a time), so
the backward's stream does none of that work; `finish_sync` makes the compute stream wait for it. The rounding is
memory-bound and costs about the same on either stream (benchmarks/RESULTS.md, 'What parallel.grad_reduce_dtype=bfloat16
costs a rank's own GPU').

Sequence-parallel params (norm weights, row-parallel biases) see only this rank's [s/tp] slice,
so their gradients are partial over TP: `allreduce_sequence_parallel_grads` sums them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from tpframe.comm import Communicator
from tpframe.parallel.state import ParallelState

# torch 2.13 renamed the tensor collectives; 2.11 only has the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def allreduce_sequence_parallel_grads(grads: list[torch.Tensor], tp_comm: Communicator) -> None:
    """Sum over TP, in place, the partial gradients (or gradient pieces) of sequence-parallel params."""
    if tp_comm.size == 1 or not grads:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = tp_comm.all_reduce(torch.cat([g.reshape(-1) for g in same]), donate=True)  # cat's output: fresh
        offset = 0
        for g in same:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def allreduce_shared_grads(grads: list[tuple[nn.Parameter, torch.Tensor]], parallel: ParallelState) -> None:
    """Sum in place the gradients (or equal gradient slices), paired with their params, that several ranks hold
    parts of: sequence-parallel params' over TP, and over the embedding group (first and last pipeline stage)
    those of weights both stages hold (tied input embedding and output head)."""
    allreduce_sequence_parallel_grads([g for p, g in grads if p.sequence_parallel], parallel.tp_comm)
    if parallel.embedding_comm is not None:  # the same in-place sum, over another group
        allreduce_sequence_parallel_grads([g for p, g in grads if p.pipeline_tied], parallel.embedding_comm)


@dataclass(eq=False)
class Bucket:
    index: int
    start: int  # [start, stop) of the flat buffer; stop - start is a multiple of the DP size
    stop: int
    params: list[nn.Parameter]
    pending: int = 0  # gradients still to arrive in the synced backward
    fresh: set = field(default_factory=set)  # ids of params with no gradient yet this step (main_grad stale)
    work: object = None  # the in-flight collective
    wire: torch.Tensor | None = None  # the bucket rounded to reduce_dtype, in flight (reduce_dtype != fp32)
    launched: bool = False
    members: set = field(default_factory=set)


class GradBuffer:
    """Flat fp32 gradient buffer for `params`, bucketed, synced over `dp_group`.

    `mode` is "all_reduce" (ddp) or "reduce_scatter" (zero1); `average_over` (default `dp_size`) divides
    the sum. `offsets[p]` is where param p starts
    in the flat buffer; the same layout can carry the params themselves (zero1's param buffer).
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        dp_group: dist.ProcessGroup | None,
        *,
        dp_size: int,
        dp_rank: int = 0,
        bucket_bytes: int = 40 * 2**20,
        overlap: bool = True,
        mode: str = "all_reduce",
        average_over: int | None = None,
        reduce_dtype: torch.dtype = torch.float32,
    ):
        if mode not in ("all_reduce", "reduce_scatter"):
            raise ValueError(f"GradBuffer mode must be 'all_reduce' or 'reduce_scatter', got {mode!r}")
        if bucket_bytes <= 0:
            raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes")
        if reduce_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"gradients are reduced in float32 or bfloat16, got {reduce_dtype}")
        params = [p for p in params if p.requires_grad]
        if not params:
            raise ValueError("GradBuffer needs at least one parameter that requires grad")
        self.params = list(reversed(params))  # backward produces the last layers' grads first
        self.dp_group, self.dp_size, self.dp_rank, self.overlap, self.mode = dp_group, dp_size, dp_rank, overlap, mode
        self.reduce_dtype = reduce_dtype
        self._wire_stream = None  # CUDA, reduce_dtype != fp32: where buckets are rounded, reduced and written back
        # the sum over the group is divided by this: dp_size, or more where the group is a subset of the ranks
        # whose losses are averaged (expert parallelism: experts replicated over dp*cp/ep ranks only)
        self.average_over = average_over or dp_size
        # NCCL averages inside the collective (ReduceOp.AVG), saving a pass over the whole fp32 buffer on the
        # compute stream before each launch (benchmarks/RESULTS.md, 'Numbers moved out of code comments'); gloo has
        # no AVG
        self._avg_in_collective = (
            dp_size > 1 and self.average_over == dp_size and dist.get_backend(dp_group) == dist.Backend.NCCL
        )
        self.offsets, self.buckets = self._layout(bucket_bytes)
        self.numel = self.buckets[-1].stop
        # padding stays zero
        self.buffer = torch.zeros(self.numel, dtype=torch.float32, device=self.params[0].device)
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self._position = {id(p): i for i, p in enumerate(self.params)}
        for p in self.params:
            p.main_grad = self.buffer[self.offsets[p] : self.offsets[p] + p.numel()].view_as(p)
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulate) for p in self.params]
        self.syncing = False
        self.events: list[tuple[str, int]] | None = None  # set to [] to record ("grad", i) / ("launch", b)

    def _layout(self, bucket_bytes: int) -> tuple[dict[nn.Parameter, int], list[Bucket]]:
        """Each parameter's offset in the flat buffer and the buckets over it: about `bucket_bytes` of fp32 each, in
        backward's order, each padded to a multiple of dp_size (even reduce-scatter slices)."""
        offsets: dict[nn.Parameter, int] = {}
        buckets: list[Bucket] = []
        offset, current, limit = 0, [], max(1, bucket_bytes // 4)

        def close() -> None:
            nonlocal offset, current
            start = buckets[-1].stop if buckets else 0
            stop = start + -(-(offset - start) // self.dp_size) * self.dp_size
            buckets.append(Bucket(len(buckets), start, stop, current, members=set(map(id, current))))
            offset, current = stop, []

        for i, p in enumerate(self.params):
            # a pipeline-tied weight (first and last stage) gets a bucket of its own, so its reduce-scatter
            # slice is the same element range on both stages and the two can be summed slice by slice
            if p.pipeline_tied and current:
                close()
            offsets[p] = offset
            offset += p.numel()
            current.append(p)
            start = buckets[-1].stop if buckets else 0
            if offset - start >= limit or i == len(self.params) - 1 or p.pipeline_tied:
                close()
        return offsets, buckets

    # -- the per-step protocol ---------------------------------------------------------------------
    def zero(self) -> None:
        """Start a step: every gradient counts as zero (lazily: the first one of the step is copied, not
        added); backward passes accumulate without DP traffic."""
        self.syncing = False
        for b in self.buckets:
            b.launched, b.work, b.wire, b.pending = False, None, None, len(b.params)
            b.fresh = set(b.members)

    def start_sync(self) -> None:
        """The coming backward is the step's last: launch each bucket's collective once it is full."""
        self.syncing = True

    def finish_sync(self) -> None:
        """Launch the buckets not launched yet (no overlap, or params without grads) and wait for all."""
        self.syncing = True
        for b in self.buckets:
            if not b.launched:
                self._launch(b)
        if self._wire_stream is not None:  # every bucket's rounding, collective and write-back were queued there
            torch.cuda.current_stream(self.buffer.device).wait_stream(self._wire_stream)
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
            if b.wire is not None:
                self._write_back(b)

    def host_state(self) -> tuple:
        """The host bookkeeping of this step so far: per bucket which params have no gradient yet, whether it was
        launched and how many gradients it still waits for; whether syncing. A CUDA-graphed schedule restores it
        after each replay, since the hooks that keep it do not run then."""
        return [(set(b.fresh), b.launched, b.pending) for b in self.buckets], self.syncing

    def set_host_state(self, state: tuple) -> None:
        buckets, self.syncing = state
        for b, (fresh, launched, pending) in zip(self.buckets, buckets, strict=True):
            b.fresh, b.launched, b.pending = set(fresh), launched, pending

    def _accumulate(self, p: nn.Parameter) -> None:
        b = self.bucket_of[p]
        if id(p) in b.fresh:
            p.main_grad.copy_(p.grad)
            b.fresh.discard(id(p))
        else:
            p.main_grad.add_(p.grad)
        p.grad = None
        if self.events is not None:
            self.events.append(("grad", self._position[id(p)]))
        if self.syncing and self.overlap:
            b.pending -= 1
            if b.pending == 0:
                self._launch(b)

    def _launch(self, b: Bucket) -> None:
        b.launched = True
        for p in b.params:  # no gradient this step: it is zero
            if id(p) in b.fresh:
                p.main_grad.zero_()
        b.fresh.clear()
        if self.events is not None:
            self.events.append(("launch", b.index))
        data = self.buffer[b.start : b.stop]
        if self.average_over > 1 and not self._avg_in_collective:
            data.mul_(1.0 / self.average_over)  # average in fp32 (exact for powers of two)
        if self.dp_size == 1:
            return
        if self.reduce_dtype == data.dtype:
            b.work = self._collective(b, data)
        elif not data.is_cuda:  # rounded here; written back after the wait (finish_sync)
            b.wire = data.to(self.reduce_dtype)
            b.work = self._collective(b, b.wire)
        else:  # all of it on the wire stream, after what the compute stream has queued so far (this bucket's grads)
            if self._wire_stream is None:
                self._wire_stream = torch.cuda.Stream(self.buffer.device)
            self._wire_stream.wait_stream(torch.cuda.current_stream(self.buffer.device))
            with torch.cuda.stream(self._wire_stream):
                b.wire = data.to(self.reduce_dtype)  # allocated on the wire stream, used only there
                self._collective(b, b.wire).wait()  # the wire stream waits for the collective; the host does not
                self._write_back(b)

    def _collective(self, b: Bucket, data: torch.Tensor):
        """Launch bucket `b`'s DP collective over `data` (the bucket itself, or its bf16 copy), asynchronously."""
        op = dist.ReduceOp.AVG if self._avg_in_collective else dist.ReduceOp.SUM
        if self.mode == "all_reduce":
            return dist.all_reduce(data, op=op, group=self.dp_group, async_op=True)
        # in place: this rank's slice of the bucket receives the result (NCCL and gloo allow the alias)
        lo, hi = self.shard_range(b)
        return _reduce_scatter(data[lo - b.start : hi - b.start], data, op=op, group=self.dp_group, async_op=True)

    def _write_back(self, b: Bucket) -> None:
        """The reduced bf16 copy of bucket `b` (all of it, or this rank's slice) back into the fp32 buffer."""
        lo, hi = (b.start, b.stop) if self.mode == "all_reduce" else self.shard_range(b)
        self.buffer[lo:hi].copy_(b.wire[lo - b.start : hi - b.start])
        b.wire = None

    # -- views -------------------------------------------------------------------------------------
    def shard_range(self, b: Bucket) -> tuple[int, int]:
        """[start, stop) of the flat buffer that this DP rank owns in bucket `b` (reduce-scatter)."""
        size = (b.stop - b.start) // self.dp_size
        return b.start + self.dp_rank * size, b.start + (self.dp_rank + 1) * size

    def shards(self) -> list[torch.Tensor]:
        """This rank's reduced slice of every bucket (valid after `finish_sync` in reduce-scatter mode)."""
        return [self.buffer[slice(*self.shard_range(b))] for b in self.buckets]


def replica_grad_buffers(
    params: list[nn.Parameter],
    parallel: ParallelState,
    *,
    mode: str,
    bucket_bytes: int,
    overlap: bool,
    reduce_dtype: torch.dtype,
) -> list[GradBuffer]:
    """The gradient buffers of `params` over their replicas: the dense params' over DP x CP and, with expert
    parallelism, the experts' (they differ between EP ranks) over the edp group, summed there and averaged over
    every rank's loss."""
    expert = {id(p) for p in params if p.expert} if parallel.ep > 1 else set()
    common = dict(bucket_bytes=bucket_bytes, overlap=overlap, mode=mode, reduce_dtype=reduce_dtype)
    dense = [p for p in params if id(p) not in expert]
    out = [GradBuffer(dense, parallel.dp_cp_group, dp_size=parallel.dp_cp, dp_rank=parallel.dp_cp_rank, **common)]
    if expert:
        out.append(
            GradBuffer(
                [p for p in params if id(p) in expert],
                parallel.edp_group,
                dp_size=parallel.edp,
                dp_rank=parallel.edp_comm.rank,
                average_over=parallel.dp_cp,
                **common,
            )
        )
    return out
