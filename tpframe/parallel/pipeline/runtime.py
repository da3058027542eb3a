"""Running a schedule order: this rank's forwards, backwards and weight gradients, with the p2p between.

`PipelineSchedule.forward_backward` has the signature of every schedule (tpframe.parallel.schedules):
    (model, batches, num_micro_batches, *, grad_sync, device) -> mean loss over micro-batches
It reads all of the step's micro-batches (every stage advances the data stream alike: the first
stage uses input_ids, the last the labels, and with packed documents every stage the ids), runs `orders.schedule_order`
for this rank, and calls `grad_sync.start_grad_sync()` right before its last gradient-producing action (the last B, or
with a zero-bubble schedule the last W). The loss lives on the last stage; an all-reduce over the pipeline group hands
it to every rank, so the trainer logs the same number everywhere.
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch import nn

from tpframe.parallel.pipeline.layout import model_chunks
from tpframe.parallel.pipeline.orders import Action, schedule_order, splits_backward
from tpframe.parallel.pipeline.p2p import PipelineLinks
from tpframe.parallel.pipeline.weight_grad import WeightGradStore
from tpframe.parallel.schedules import micro_batch_loss
from tpframe.parallel.state import ParallelState


class PipelineSchedule:
    """One pipeline schedule over `links`; `activation_shape` is [s(/tp), b, h], the same for every stage."""

    def __init__(
        self,
        state: ParallelState,
        links: PipelineLinks,
        *,
        schedule: str,
        virtual_stages: int = 1,
        activation_shape: tuple[int, ...],
        dtype: torch.dtype,
        timer: StageTimer | None = None,
    ):
        self.state, self.links, self.schedule = state, links, schedule
        self.pp, self.rank, self.v = state.pp, state.pp_rank, virtual_stages
        self.stages = self.pp * virtual_stages
        self.shape, self.dtype = tuple(activation_shape), dtype
        self.timer = timer or StageTimer(None)
        links.idle = self.timer.idle
        self._orders: dict[int, list[Action]] = {}

    def order(self, num_micro_batches: int) -> list[Action]:
        if num_micro_batches not in self._orders:
            self._orders[num_micro_batches] = schedule_order(
                self.schedule, pp=self.pp, rank=self.rank, num_micro_batches=num_micro_batches, virtual_stages=self.v
            )
        return self._orders[num_micro_batches]

    # -- one training step -----------------------------------------------------------------------
    def forward_backward(
        self,
        model: nn.Module,
        batches,
        num_micro_batches: int,
        *,
        grad_sync,
        device: torch.device,
        loss_scale: float | None = None,
    ) -> torch.Tensor:
        chunks, m = model_chunks(model), num_micro_batches
        data = [batches.next() for _ in range(m)]
        order = self.order(m)
        split = splits_backward(self.schedule)
        last_grad = max(i for i, a in enumerate(order) if a.kind == ("W" if split else "B"))
        store = WeightGradStore() if split else None
        saved: dict[tuple[int, int], tuple] = {}  # (chunk, mb) -> (input, output or loss)
        loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        with self.timer.span(), store.capturing() if split else contextlib.nullcontext():
            for i, a in enumerate(order):
                if i == last_grad:
                    grad_sync.start_grad_sync()
                if a.kind == "F":
                    x, out = self._forward(chunks[a.chunk], a, data[a.mb], device)
                    if self._last(a):
                        out = micro_batch_loss(out, m, loss_scale)
                        loss_sum += out.detach()
                    saved[(a.chunk, a.mb)] = (x, out)
                elif a.kind == "B":
                    self._backward(a, *saved.pop((a.chunk, a.mb)))
                    if split:
                        store.seal((a.chunk, a.mb))
                else:
                    store.flush((a.chunk, a.mb))
            with self.timer.idle():  # the sends drain; the last stage holds the loss
                self.links.wait_sends()
                loss = self.state.pp_comm.all_reduce(loss_sum)
        assert not saved and (store is None or len(store) == 0), "a pipeline order left work undone"
        return loss

    @torch.no_grad()
    def forward_only(
        self,
        model: nn.Module,
        batches,
        num_micro_batches: int,
        *,
        device: torch.device,
        loss_scale: float | None = None,
    ) -> torch.Tensor:
        """Mean loss over `num_micro_batches` (evaluation): every micro-batch through every chunk, in order (with
        `loss_scale`: the sum of `micro_batch_loss`, as in training)."""
        chunks = model_chunks(model)
        loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        for mb in range(num_micro_batches):
            batch = batches.next()
            for chunk in range(self.v):
                a = Action("F", chunk, mb)
                _, out = self._forward(chunks[chunk], a, batch, device)
                if self._last(a):
                    loss_sum += micro_batch_loss(out, 1, loss_scale)
        self.links.wait_sends()
        total = self.state.pp_comm.all_reduce(loss_sum)
        return total / max(1, num_micro_batches) if loss_scale is None else total

    # -- actions ---------------------------------------------------------------------------------
    def _stage(self, a: Action) -> int:
        return a.chunk * self.pp + self.rank

    def _last(self, a: Action) -> bool:
        return self._stage(a) == self.stages - 1

    def _forward(self, chunk: nn.Module, a: Action, batch, device):
        """F: receive (or embed) the input, run the chunk, send its output on. Returns (input, output)."""
        stage = self._stage(a)
        input_ids, labels = batch
        extra = {}
        if stage == 0:
            x = input_ids.to(device, non_blocking=True)
        else:
            x = self.links.recv("act", self.shape, self.dtype, stage=stage, mb=a.mb)
            x.requires_grad_(torch.is_grad_enabled())
            if getattr(chunk, "needs_input_ids", False):  # packed documents: every stage's attention needs them
                extra["input_ids"] = input_ids.to(device, non_blocking=True)
        if stage == self.stages - 1:
            return x, chunk(x, labels.to(device, non_blocking=True), **extra)  # per-token loss [b, s]
        y = chunk(x, **extra)
        if tuple(y.shape) != self.shape or y.dtype != self.dtype:
            raise RuntimeError(
                f"pipeline stage {stage} produced activations {tuple(y.shape)} {y.dtype}; the pipeline "
                f"sends {self.shape} {self.dtype} ([s(/tp), b, h] in the compute dtype)"
            )
        self.links.send("act", y.detach())
        return x, y

    def _backward(self, a: Action, x: torch.Tensor, out: torch.Tensor) -> None:
        """B: receive the output's gradient (or start from the loss), backward, send the input's gradient."""
        stage = self._stage(a)
        if stage == self.stages - 1:
            torch.autograd.backward(out)
        else:
            grad = self.links.recv("grad", self.shape, self.dtype, stage=stage, mb=a.mb)
            torch.autograd.backward(out, grad)
        if stage > 0:
            self.links.send("grad", x.grad)


class StageTimer:
    """Idle time (waits for neighbours) and schedule time of this rank, per step, for benchmarks.

    `device` None: off (no cost). CUDA: events around each wait, read after the step synchronizes
    (a wait stalls the stream, not the CPU, so only the GPU timeline knows how long it idled). CPU:
    wall clock."""

    def __init__(self, device: torch.device | None):
        self.device = device
        self.cuda = device is not None and device.type == "cuda"
        self._idle: list = []
        self._span: list = []

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    @contextlib.contextmanager
    def _measure(self, into: list):
        if self.device is None:
            yield
            return
        start = self._mark()
        try:
            yield
        finally:
            into.append((start, self._mark()))

    def idle(self):
        return self._measure(self._idle)

    def span(self):
        return self._measure(self._span)

    def pop(self) -> tuple[float, float]:
        """(idle seconds, schedule seconds) since the last pop; synchronizes CUDA."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            seconds = lambda pairs: sum(a.elapsed_time(b) for a, b in pairs) / 1e3  # noqa: E731
        else:
            seconds = lambda pairs: sum(b - a for a, b in pairs)  # noqa: E731
        out = (seconds(self._idle), seconds(self._span))
        self._idle, self._span = [], []
        return out
