"""Where a step's time goes: data loading, forward+backward, gradient sync, optimizer, checkpointing.

    timers = PhaseTimers(device, mode="auto")
    timers.begin()                       # a step starts
    ...; timers.mark("fwd_bwd")          # the time since the previous mark was forward+backward
    ms = timers.window()                 # {"data_ms": ..., ...}: mean per step since the last window()

Each `mark(phase)` charges the time since the previous mark (or `begin()`) to `phase`. Data loading
happens inside the schedule, between micro-batches: `TimedBatches` wraps the batch iterator and marks
around each `next()`.

Modes (logging.timers):
  auto  CPU: the host clock (CPU work is synchronous, so it is exact). CUDA: an event recorded on the
        current stream at each mark, never waited for until `window()`, which the trainer calls when
        it logs (and synchronizes anyway). The times are the GPU's timeline: a phase costs what it adds
        to the step on the GPU, so data loading that overlaps queued kernels shows as ~0 ms, and a
        checkpoint write or a gradient sync the GPU waits for shows in full. The phases add up to the
        step time; recording an event adds no synchronization (the cost of each mode against `none` and
        how much of the step the phases cover: benchmarks/RESULTS.md, 'Phase timers').
  sync  torch.cuda.synchronize() at every mark, then the host clock: host-side attribution of each
        phase, at the price of a device sync per phase per step (it stalls the CPU's run-ahead, so
        the step itself gets slower; use it to debug, not to measure throughput).
  none  no timing, no fields.
"""

from __future__ import annotations

import time

import torch

from tpframe.observe.logger import TIMER_MODES

PHASES = ("data", "fwd_bwd", "grad_sync", "optim", "ckpt")


class PhaseTimers:
    def __init__(self, device: torch.device, mode: str = "auto"):
        if mode not in TIMER_MODES:
            raise ValueError(f"timer mode must be one of {TIMER_MODES}, got {mode!r}")
        self.enabled = mode != "none"
        self.cuda = torch.device(device).type == "cuda"
        self.events = self.cuda and mode == "auto"
        self.sync = self.cuda and mode == "sync"
        self._marks: list[tuple[str | None, object]] = []  # (phase or None for begin(), timestamp or event)
        self._steps = 0
        self._spare: list[torch.cuda.Event] = []

    def _stamp(self):
        if self.events:
            event = self._spare.pop() if self._spare else torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def begin(self) -> None:
        """A step starts: the time before it (logging, evaluation) is charged to no phase."""
        if self.enabled:
            self._steps += 1
            self._marks.append((None, self._stamp()))

    def mark(self, phase: str) -> None:
        if self.enabled:
            self._marks.append((phase, self._stamp()))

    def window(self) -> dict[str, float]:
        """Mean milliseconds per step in each phase since the last call ({} when disabled or no step ran)."""
        if not self.enabled or not self._steps:
            return {}
        if self.events:
            self._marks[-1][1].synchronize()
        totals = dict.fromkeys(PHASES, 0.0)
        for (_, t0), (phase, t1) in zip(self._marks, self._marks[1:]):
            if phase is None:
                continue
            totals[phase] += t0.elapsed_time(t1) if self.events else (t1 - t0) * 1e3
        if self.events:
            self._spare.extend(e for _, e in self._marks)
        out = {f"{p}_ms": totals[p] / self._steps for p in PHASES}
        self._marks, self._steps = [], 0
        return out


class TimedBatches:
    """A batch iterator whose `next()` is charged to the "data" phase (what ran before it to "fwd_bwd")."""

    def __init__(self, batches, timers: PhaseTimers):
        self.batches, self.timers = batches, timers

    def next(self):
        self.timers.mark("fwd_bwd")
        batch = self.batches.next()
        self.timers.mark("data")
        return batch

    def __getattr__(self, name):  # everything else is the wrapped iterator's
        return getattr(self.batches, name)
