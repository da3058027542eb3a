"""Non-finite steps, divergence and loss spikes: Megatron's rerun state machine, lightened.

    guard = StepGuard(cfg.train, model, data=train_data, rng=RNGState(...), dp_comm=state.dp_comm, log=logger.info)
    loss, grad_norm, apply = guard.run_step(step, attempt)   # attempt() -> (loss, grad_norm) of one try

A step whose loss or gradient norm is not finite is re-run once from the same state and batch (the
data position and every RNG stream rewound, gradients zeroed). A finite re-run means the first try
hit a transient fault (hardware, a race): its result is used and training goes on. A non-finite
re-run is deterministic (the data or the model state): with `train.on_nonfinite=skip` the update is
skipped, and more than `train.max_skipped_steps` skips in a row stop training; with `abort` the first
one does. Training stops by raising `TrainingAborted` (train.py exits with code 3).

`all_finite` checks a strategy's state before a checkpoint is published; `healthy_since` tells the
checkpointer whether a step may be called healthy (no skipped step and no loss spike since the last
save). Inside a streak of skipped steps nothing is saved (a finite but blown-up state must never become
`latest`), and a run that ends inside one stops (`check_ended_healthy`, exit code 3). Loss spikes are
flagged by a robust z-score (median and MAD of the recent window).

Test hook: TPFRAME_FAULT_NAN=<step>:<mode>[:<micro-batch>] turns the loss of that micro-batch into NaN
on rank TPFRAME_FAULT_RANK (default 0): mode `once` (the first try of that step only: transient),
`step` (every try of that step: a bad batch), `always` (every try of every step from then on).
"""

from __future__ import annotations

import collections
import math
import os
from collections.abc import Callable

import torch
from torch import nn

from tpframe.errors import ConfigError, env_int

FAULT_NAN_ENV = "TPFRAME_FAULT_NAN"
FAULT_MODES = ("once", "step", "always")
MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation


class TrainingAborted(RuntimeError):
    """Training stopped on non-finite steps (train.on_nonfinite / train.max_skipped_steps)."""


# -- the fault hook ---------------------------------------------------------------------------------


def parse_fault_spec(spec: str | None) -> tuple[int, str, int] | None:
    """(step, mode, micro-batch) from TPFRAME_FAULT_NAN, or None; ConfigError if malformed."""
    if not spec:
        return None
    parts = spec.split(":")
    try:
        step, mode, micro = int(parts[0]), parts[1], int(parts[2]) if len(parts) > 2 else 0
        if len(parts) > 3 or mode not in FAULT_MODES or step < 1 or micro < 0:
            raise ValueError
    except (ValueError, IndexError):
        raise ConfigError(
            f"env var {FAULT_NAN_ENV}={spec!r} must be <step>:<{'|'.join(FAULT_MODES)}>[:<micro-batch>]"
        ) from None
    return step, mode, micro


def check_fault_env() -> None:
    """The test hooks' env vars (this module's TPFRAME_FAULT_NAN and TPFRAME_FAULT_RANK, the checkpointer's
    TPFRAME_FAULT_KILL_DURING_SAVE), checked with the config: a malformed one is a ConfigError."""
    parse_fault_spec(os.environ.get(FAULT_NAN_ENV))
    for name in ("TPFRAME_FAULT_KILL_DURING_SAVE", "TPFRAME_FAULT_RANK"):
        env_int(name, None, 0)


class MicroBatchWatch:
    """A forward hook on the model: records whether each micro-batch's output is finite (no sync: the
    flags are read only when a step went wrong), and injects the test fault."""

    def __init__(self, model: nn.Module, rank: int):
        self.flags: list[torch.Tensor] = []
        self.step, self.attempt = 0, 0
        self.graphed = False  # a CUDA graph was captured through this hook (train.cuda_graph)
        fault = parse_fault_spec(os.environ.get(FAULT_NAN_ENV))
        self.fault = fault if fault and rank == int(os.environ.get("TPFRAME_FAULT_RANK", "0")) else None
        self.handle = model.register_forward_hook(self._hook)

    def start(self, step: int, attempt: int) -> None:
        self.flags.clear()
        self.step, self.attempt = step, attempt

    def _faulty(self, micro: int) -> bool:
        if self.fault is None or not torch.is_grad_enabled():  # evaluation is never poisoned
            return False
        step, mode, where = self.fault
        if micro != where:
            return False
        return {
            "once": self.step == step and self.attempt == 0,
            "step": self.step == step,
            "always": self.step >= step,
        }[mode]

    def _hook(self, module, inputs, output):
        if not isinstance(output, torch.Tensor) or not torch.is_grad_enabled():
            return None
        if output.is_cuda and torch.cuda.is_current_stream_capturing():  # train.cuda_graph: replays skip Python,
            self.graphed = True  # so neither a flag nor the test fault would mean anything there
            return None
        if self._faulty(len(self.flags)):
            output = output * float("nan")
        self.flags.append(torch.isfinite(output.detach()).all())
        return output

    def first_nonfinite(self) -> int:
        """Index of the first micro-batch of this try whose output was not finite, or -1."""
        for i, ok in enumerate(self.flags):
            if not bool(ok):
                return i
        return -1

    def remove(self) -> None:
        self.handle.remove()


# -- loss spikes ------------------------------------------------------------------------------------


class SpikeDetector:
    """Flags a loss more than `z` robust deviations above the median of the last `window` losses."""

    def __init__(self, z: float, window: int = 100, min_points: int = 20):
        self.z, self.min_points = z, min_points
        self.losses: collections.deque[float] = collections.deque(maxlen=window)

    def observe(self, loss: float) -> tuple[float, float] | None:
        """(robust z, median) when `loss` is a spike, else None; the loss joins the window either way."""
        spike = None
        if self.z > 0 and len(self.losses) >= self.min_points:
            z, median = robust_z(loss, list(self.losses))
            if z > self.z:
                spike = (z, median)
        self.losses.append(loss)
        return spike


def robust_z(value: float, window: list[float]) -> tuple[float, float]:
    """(value - median) / (1.4826 * MAD) of `window`, and the median (a MAD of 0 counts as tiny)."""
    ordered = sorted(window)
    n = len(ordered)
    median = 0.5 * (ordered[(n - 1) // 2] + ordered[n // 2])
    deviations = sorted(abs(x - median) for x in ordered)
    mad = 0.5 * (deviations[(n - 1) // 2] + deviations[n // 2])
    scale = MAD_TO_SIGMA * mad if mad > 0 else 1e-12 * max(1.0, abs(median))
    return (value - median) / scale, median


# -- the state machine ------------------------------------------------------------------------------


class StepGuard:
    """Runs each optimizer step's try, re-runs a non-finite one, and decides: apply, skip or abort.

    Its counters are checkpointed (state_dict/load_state_dict) and recorded in meta.json."""

    def __init__(
        self,
        cfg,
        model: nn.Module,
        *,
        data,
        rng,
        dp_comm,
        rank: int = 0,
        cp: int = 1,
        log: Callable[[str], None] = print,
    ):
        """`dp_comm`: the ranks that hold the same parameters (DP, times CP when `cp` > 1)."""
        self.on_nonfinite, self.max_skipped = cfg.on_nonfinite, cfg.max_skipped_steps
        self.data, self.rng, self.dp_comm, self.log, self.cp = data, rng, dp_comm, log, cp
        self.watch = MicroBatchWatch(model, rank)
        self.spikes = SpikeDetector(cfg.loss_spike_z)
        self.consecutive_skips = 0
        self.skipped_steps = 0  # deterministic non-finite steps, skipped
        self.transient_faults = 0  # non-finite tries whose re-run was finite
        self.loss_spikes = 0
        self.last_incident = -1  # last step that was skipped or spiked: later checkpoints are healthy

    def run_step(self, step: int, attempt: Callable[[], tuple[float, float]]) -> tuple[float, float, bool]:
        """(loss, grad_norm, apply the update) for optimizer step `step` (1-based). Every rank takes the
        same branch: the loss is averaged over DP and the norm reduced over the whole world."""
        position, rng = self.data.state_dict(), self.rng.state_dict()
        self.watch.start(step, 0)
        loss, norm = attempt()
        if math.isfinite(loss) and math.isfinite(norm):
            self._observe(step, loss)
            return loss, norm, True
        self.log(f"step {step}: {self._describe(loss, norm)}; re-running it from the same state and batch")
        self.data.load_state_dict(position)
        self.rng.load_state_dict(rng)
        self.watch.start(step, 1)
        loss, norm = attempt()
        if math.isfinite(loss) and math.isfinite(norm):
            self.transient_faults += 1
            self.log(f"step {step}: the re-run is finite (loss {loss:.4f}): a transient fault; its update is applied")
            self._observe(step, loss)
            return loss, norm, True
        self.last_incident = step
        what = (
            f"step {step}: the re-run is non-finite too ({self._describe(loss, norm)}): "
            "deterministic (the batch or the model state)"
        )
        if self.on_nonfinite == "abort":
            raise TrainingAborted(f"{what}; training stopped (train.on_nonfinite=abort)")
        self.consecutive_skips += 1
        self.skipped_steps += 1
        if self.consecutive_skips > self.max_skipped:
            raise TrainingAborted(
                f"{what}; {self.consecutive_skips} non-finite steps in a row exceed "
                f"train.max_skipped_steps={self.max_skipped}: training stopped"
            )
        self.log(
            f"{what}; update skipped ({self.consecutive_skips} in a row, train.max_skipped_steps={self.max_skipped})"
        )
        return loss, norm, False

    def _observe(self, step: int, loss: float) -> None:
        self.consecutive_skips = 0
        spike = self.spikes.observe(loss)
        if spike is not None:
            self.loss_spikes += 1
            self.last_incident = step
            z, median = spike
            self.log(
                f"step {step}: loss spike: {loss:.4f} against a median of {median:.4f} over the last "
                f"{len(self.spikes.losses) - 1} steps (robust z {z:.1f} > train.loss_spike_z={self.spikes.z:g})"
            )

    def _describe(self, loss: float, norm: float) -> str:
        """What was non-finite, and where: the first bad micro-batch of every DP rank (one tiny all-reduce)."""
        parts = [f"loss {loss}"] if not math.isfinite(loss) else []
        parts += [f"gradient norm {norm}"] if not math.isfinite(norm) else []
        text = "non-finite " + " and ".join(parts)
        if self.watch.graphed and not self.watch.flags:  # every rank alike: the step was replayed from a CUDA graph
            return text + " (which micro-batch is not known: the step replayed a CUDA graph, train.cuda_graph)"
        mine = self.watch.first_nonfinite()
        dp, dp_rank = self.dp_comm.size, self.dp_comm.rank
        found = torch.full((dp,), -1.0, device=self.dp_comm.device)
        found[dp_rank] = float(mine)
        found = self.dp_comm.all_reduce(found, op="max") if dp > 1 else found
        where = [(r, int(i)) for r, i in enumerate(found.tolist()) if i >= 0]
        if where:
            rank = (
                (lambda r: f"DP rank {r}")
                if self.cp == 1
                else (lambda r: f"DP rank {r // self.cp} CP rank {r % self.cp}")
            )
            text += "; first in " + ", ".join(f"micro-batch {i} of {rank(r)}" for r, i in where)
        else:
            text += " (every micro-batch's loss was finite: the backward overflowed)"
        return text

    def check_ended_healthy(self, step: int) -> None:
        """Training ended (its last step, a stop): inside a streak of skipped steps its weights are not trusted and
        no checkpoint was published during it (the checkpointer's rule), so the run stops with TrainingAborted."""
        if self.consecutive_skips:
            first = step - self.consecutive_skips + 1
            raise TrainingAborted(
                f"training ended at step {step} inside a streak of {self.consecutive_skips} skipped non-finite steps "
                f"(steps {first}-{step}): its weights are not trusted and no checkpoint was written during the streak"
            )

    def healthy_since(self, step: int) -> bool:
        """No skipped step and no loss spike after `step` (the previous save): a checkpoint now is healthy."""
        return self.last_incident <= step

    def state_dict(self) -> dict:
        return {
            "consecutive_skips": self.consecutive_skips,
            "skipped_steps": self.skipped_steps,
            "transient_faults": self.transient_faults,
            "loss_spikes": self.loss_spikes,
            "last_incident": self.last_incident,
        }

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            if key in self.state_dict():
                setattr(self, key, int(value))
