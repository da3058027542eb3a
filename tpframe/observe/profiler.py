"""Profiling a training run from its config (the `profile` section): torch.profiler over a few chosen steps on
chosen ranks, written under <run_dir>/profile/ as a trace (open it in https://ui.perfetto.dev or chrome://tracing),
a table of the most expensive ops, and on GPUs how long the device sat idle; optionally the CUDA allocator's
history over the same steps (drop the pickle on https://pytorch.org/memory_viz).

    profiler = StepProfiler.open(cfg.profile, rank=0, device=device, run_dir="runs/x", log=print)  # None: off
    profiler.before_step(step); ...train step...; profiler.after_step(step)    # the Trainer's loop does this
    profiler.close()                                                            # a run that ends inside the window

The step before the window (when this launch runs it) is the profiler's warm-up: its setup cost stays out of
the trace. Megatron's `--profile --profile-step-start/-end --profile-ranks` and torchtitan's `[profiling]` do
the same.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tpframe.errors import ConfigError, shown


@dataclass
class ProfileConfig:
    start_step: int = 0  # first step to profile (trace, op table, idle time in <run_dir>/profile); 0: off
    steps: int = 2  # consecutive steps profiled from start_step
    ranks: list[int] = field(default_factory=lambda: [0])  # global ranks that profile, each writing its own files
    memory: bool = False  # CUDA: also record the allocator's history over those steps (pytorch.org/memory_viz)
    record_shapes: bool = False  # op input shapes in the trace and the table (some overhead)
    with_stack: bool = False  # Python stacks in the trace (much overhead: for finding who launched a kernel)


def check_profile(cfg, world_size: int) -> None:
    """The `profile:` section of the run's Config `cfg`: a window inside the run, ranks that exist."""
    pr = cfg.profile
    if pr.start_step < 0 or pr.steps < 1:
        raise ConfigError(
            f"profile.start_step={pr.start_step} and profile.steps={pr.steps} need start_step >= 0 "
            "(0: no profiling) and steps >= 1"
        )
    if pr.start_step > cfg.train.steps:
        raise ConfigError(
            f"profile.start_step={pr.start_step} is after the last step (train.steps={cfg.train.steps}): "
            "nothing would be profiled; lower it, or set 0 to profile nothing"
        )
    bad = [r for r in pr.ranks if not 0 <= r < world_size]
    if bad or not pr.ranks:
        raise ConfigError(
            f"profile.ranks={shown(pr.ranks)} must name at least one rank, each in 0..{world_size - 1} "
            f"(world size {world_size})"
        )


class StepProfiler:
    """Profiles steps [start_step, start_step + steps) of one rank; see the module docstring."""

    def __init__(
        self, cfg: ProfileConfig, *, rank: int, device: torch.device, out_dir: Path, log: Callable[[str], None]
    ):
        from torch.profiler import ProfilerActivity, profile

        self.cfg, self.rank, self.cuda, self.out_dir, self.log = cfg, rank, device.type == "cuda", out_dir, log
        self.first, self.last = cfg.start_step, cfg.start_step + cfg.steps - 1
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.prof = profile(
            activities=activities, record_shapes=cfg.record_shapes, with_stack=cfg.with_stack, acc_events=True
        )  # one window; without it torch warns when the warm-up is set up
        self.state = "waiting"  # -> "warm" (profiler set up, not recording) -> "recording" -> "done"
        self.recorded: list[int] = []
        self.span = None  # the current step's range in the trace ("tpframe step N")

    @classmethod
    def open(
        cls, cfg: ProfileConfig, *, rank: int, device: torch.device, run_dir: str | Path, log: Callable[[str], None]
    ) -> StepProfiler | None:
        """A profiler for this rank, or None when profiling is off or this rank is not in `cfg.ranks`."""
        if cfg.start_step <= 0 or rank not in cfg.ranks:
            return None
        return cls(cfg, rank=rank, device=device, out_dir=Path(run_dir) / "profile", log=log)

    def before_step(self, step: int) -> None:
        """Call before running optimizer step `step` (1-based)."""
        if self.state == "waiting" and step == self.first - 1:
            self.prof.prepare_trace()  # the warm-up: the profiler's own setup stays out of the recorded steps
            self.state = "warm"
        elif self.state in ("waiting", "warm") and step == self.first:
            if self.state == "waiting":
                self.prof.prepare_trace()
            if self.cfg.memory and self.cuda:
                torch.cuda.memory._record_memory_history(max_entries=1_000_000)
            self.prof.start_trace()
            self.state = "recording"
        elif self.state == "waiting" and step > self.first:
            self.log(
                f"profile: profile.start_step={self.first} is before this launch's first step ({step}): "
                "nothing profiled; set a later profile.start_step to profile a resumed run"
            )
            self.state = "done"
        if self.state == "recording":
            self.recorded.append(step)
            self.span = torch.profiler.record_function(f"tpframe step {step}")
            self.span.__enter__()

    def after_step(self, step: int) -> float:
        """Call after optimizer step `step`; the window's last step writes the files. Returns the seconds spent
        writing them (not training time: the trainer leaves them out of its throughput)."""
        if self.span is not None:
            self.span.__exit__(None, None, None)
            self.span = None
        if self.state == "recording" and step >= self.last:
            start = time.perf_counter()
            self._finish()
            return time.perf_counter() - start
        return 0.0

    def close(self) -> None:
        """End of training: a window cut short by the last step (or a stop) still writes what it recorded."""
        if self.state == "recording":
            self._finish()
        elif self.state == "warm":
            self.prof.stop_trace()  # set up for a step that never came
            self.state = "done"

    def _finish(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()  # the steps' kernels are in the trace
        self.prof.stop_trace()
        self.state = "done"
        self.out_dir.mkdir(parents=True, exist_ok=True)
        steps = f"{self.recorded[0]}-{self.recorded[-1]}" if len(self.recorded) > 1 else f"{self.recorded[0]}"
        stem = self.out_dir / f"steps{steps}-rank{self.rank}"
        trace = stem.with_suffix(".json")
        self.prof.export_chrome_trace(str(trace))
        table = op_table(self.prof, cuda=self.cuda, by_shape=self.cfg.record_shapes)
        idle = ""
        if self.cuda:
            span, busy, comm, exposed = gpu_timeline(trace)
            if span > 0:
                idle = (
                    f"; GPU busy {busy:.1f} of {span:.1f} ms, idle {1 - busy / span:.1%} (launch gaps and host "
                    "waits: the most train.cuda_graph could win)"
                )
                if comm > 0:
                    idle += (
                        f"; collectives ran {comm:.1f} ms, {exposed:.1f} ms of it with no computation beside "
                        "them (what overlap did not hide)"
                    )
                table += f"\nGPU timeline of the steps, first kernel to last{idle}\n"
        stem.with_suffix(".txt").write_text(table)
        written = [trace.name, stem.with_suffix(".txt").name]
        if self.cfg.memory and self.cuda:
            snapshot = stem.with_name(stem.name + "-memory.pickle")
            torch.cuda.memory._dump_snapshot(str(snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
            written.append(snapshot.name)
        self.log(f"profile of step {steps} on rank {self.rank} written to {self.out_dir}: {', '.join(written)}{idle}")


def op_table(prof, *, cuda: bool, rows: int = 40, by_shape: bool = False) -> str:
    """torch.profiler's table of the most expensive ops: by time on the GPU (self) on CUDA, by CPU time otherwise;
    one row per op and input shapes with `by_shape` (needs record_shapes)."""
    averages = prof.key_averages(group_by_input_shape=by_shape)
    averages[:] = [e for e in averages if not e.key.startswith("tpframe step")]  # ranges, not ops: in the trace
    keys = ("self_device_time_total", "self_cuda_time_total") if cuda else ("self_cpu_time_total",)
    for key in keys:  # the device column's name changed across torch versions
        try:
            return averages.table(sort_by=key, row_limit=rows, max_name_column_width=80)
        except (AttributeError, KeyError, ValueError):
            continue
    return averages.table(row_limit=rows, max_name_column_width=80)


_GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# the collectives' kernels: NCCL's, tpframe's symm kernels (tpframe/comm/symm) and peer-to-peer copies
_SYMM_KERNELS = ("all_gather_kernel", "all_reduce_kernel", "reduce_scatter_kernel", "barrier_kernel")


def _is_comm(event: dict) -> bool:
    name = event.get("name", "")
    return "nccl" in name.lower() or name.startswith("Memcpy PtoP") or any(k in name for k in _SYMM_KERNELS)


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering `spans`."""
    out: list[list[float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _length(spans) -> float:
    return sum(e - s for s, e in spans)


def gpu_events(trace_path: str | Path) -> list[dict]:
    """A chrome trace's GPU kernels, copies and memsets (its complete events of those categories)."""
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in _GPU_CATEGORIES]


def _gpu_spans(trace: str | Path | list[dict]) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(communication, everything else): the (start, end) in us of a trace's GPU events (a path, or `gpu_events`)."""
    comm, other = [], []
    for e in gpu_events(trace) if isinstance(trace, (str, Path)) else trace:
        (comm if _is_comm(e) else other).append((e["ts"], e["ts"] + e["dur"]))
    return comm, other


def gpu_timeline(trace: str | Path | list[dict]) -> tuple[float, float, float, float]:
    """(span, busy, communication, exposed) in ms of a chrome trace's GPU activity (its path, or its `gpu_events`),
    from one read of it.

    span: first kernel/copy/memset to last; busy: the union of their intervals (span - busy is the time the GPU
    sat idle between them). communication: how long some collective ran (the union of NCCL kernels, symm kernels
    and peer copies); exposed: how much of that no computation ran beside it, the time the collectives added to
    the step where overlap did not hide them."""
    comm, other = _gpu_spans(trace)
    spans = _union(comm + other)
    if not spans:
        return 0.0, 0.0, 0.0, 0.0
    comm, other = _union(comm), _union(other)
    hidden, j = 0.0, 0
    for s, e in comm:  # both lists sorted and disjoint: one sweep
        while j < len(other) and other[j][1] <= s:
            j += 1
        k = j
        while k < len(other) and other[k][0] < e:
            hidden += min(e, other[k][1]) - max(s, other[k][0])
            k += 1
    total = _length(comm)
    return (spans[-1][1] - spans[0][0]) / 1e3, _length(spans) / 1e3, total / 1e3, (total - hidden) / 1e3


def gpu_busy(trace_path: str | Path) -> tuple[float, float]:
    """(span, busy) of `gpu_timeline`."""
    return gpu_timeline(trace_path)[:2]
