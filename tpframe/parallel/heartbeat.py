"""Bounded waits: who is stuck where, when a collective waits too long or a rank stops responding.

Every process group gets `comm.timeout_s` (tpframe.parallel.state); a timed-out gloo collective raises,
NCCL's watchdog aborts the communicator. Neither says which rank is missing, so each rank also
publishes a heartbeat in the job's store, once every `period` seconds from a thread:
`<counter> <step> <phase>`, where (step, phase) is what its main thread is doing (`Progress`, marked
by the trainer). A rank frozen by SIGSTOP or wedged in a call that holds the GIL stops beating.

    progress = Progress()
    beat = Heartbeat.start(state, timeout_s=300, progress=progress)  # None in a world of one
    ...
    raise beat.explain(error)   # a communication failure -> CommFailure naming group, operation, missing ranks
    beat.stop()

When a peer has not beaten for 0.9 x `timeout_s`, the thread reports it itself (the lowest-ranked live rank
prints one line) and ends the process with exit code 4 (tpframe/exits.py), whether the main thread is in a
gloo or an NCCL wait. On CUDA, PyTorch's NCCL flight recorder is on (`configure_flight_recorder`) and its
trace is dumped to `<run_dir>/nccl_trace/rank_<r>` before the exit.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from tpframe import exits

TRACE_PREFIX_ENV = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"
SILENCE = 0.9  # a peer silent this share of comm.timeout_s is reported before any collective's own timeout fires
_TRACE_PREFIX: str | None = None  # the dump prefix configure_flight_recorder set (a user's own is kept)

# phase -> (the groups its collectives run on, what they are)
PHASES = {
    "init": (("world",), "process-group and model set-up"),
    "load": (("world",), "the checkpoint load"),
    "forward_backward": (("tp", "dp"), "forward/backward (tensor-parallel collectives, overlapped gradient sync)"),
    "grad_sync": (("dp", "tp"), "the gradient all-reduce / reduce-scatter"),
    "grad_norm": (("mp", "dp"), "the gradient-norm all-reduce"),
    "loss": (("dp",), "the loss all-reduce"),
    "optimizer": (("dp",), "the optimizer step (parameter all-gather)"),
    "eval": (("tp", "dp"), "evaluation"),
    "checkpoint": (("world",), "the checkpoint step (signal check, save, publish)"),
    "done": (("world",), "the end of training"),
}

_COMM_ERRORS = (
    "timed out",
    "timeout",
    "connection closed",
    "connection reset",
    "broken pipe",
    "communicator was aborted",
    "nccl error",
    "socket",
    "peer",
)

_PEER_GONE = ("connection closed", "connection reset", "broken pipe")  # a peer's process ended


class CommFailure(RuntimeError):
    """A collective that could not complete; the message is the one line to print. `report`: this rank prints it."""

    def __init__(self, message: str, report: bool = True):
        super().__init__(message)
        self.report = report


class Progress:
    """What this rank's main thread is doing, (step, phase): written by the trainer, read by the heartbeat."""

    def __init__(self) -> None:
        self.step, self.phase, self.since = 0, "init", time.monotonic()

    def mark(self, step: int, phase: str) -> None:
        self.step, self.phase, self.since = step, phase, time.monotonic()


@dataclass
class Peer:
    counter: int = -1
    step: int = 0
    phase: str = "init"
    changed: float = 0.0  # monotonic time its counter last changed, as seen here


def is_comm_failure(error: BaseException) -> bool:
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and any(s in str(error).lower() for s in _COMM_ERRORS)


def configure_flight_recorder(run_dir: str | Path) -> None:
    """Turn PyTorch's NCCL flight recorder on (unless the user set it) with its dump under the run dir.
    Must run before the NCCL process groups are created."""
    global _TRACE_PREFIX
    trace_dir = Path(run_dir) / "nccl_trace"
    if "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ:  # the old name: torch 2.11+ warns on every rank for it
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    if os.environ.get(TRACE_PREFIX_ENV, _TRACE_PREFIX) == _TRACE_PREFIX:  # unset, or set by an earlier run here
        trace_dir.mkdir(parents=True, exist_ok=True)
        _TRACE_PREFIX = os.environ[TRACE_PREFIX_ENV] = str(trace_dir / "rank_")


def dump_flight_recorder(rank: int) -> Path | None:
    """Write this rank's NCCL flight-recorder trace where NCCL's own dump would go; None off CUDA."""
    dump = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)
    prefix = os.environ.get(TRACE_PREFIX_ENV)
    if dump is None or prefix is None or not torch.cuda.is_available():
        return None
    try:
        path = Path(f"{prefix}{rank}")
        path.write_bytes(dump())
        return path
    except Exception:  # noqa: BLE001 - a failed dump must not hide the report
        return None


def _group_ranks(state) -> dict[str, list[int]]:
    from tpframe.parallel.state import rank_layout

    layout = rank_layout(state.world_size, state.tp, state.pp, cp=getattr(state, "cp", 1))
    mine = {kind: next(g for g in groups if state.rank in g) for kind, groups in layout.items() if kind != "embedding"}
    mine["world"] = list(range(state.world_size))
    return mine


class Heartbeat:
    """This rank's heartbeat thread and its view of every other rank's."""

    def __init__(self, store, state, *, timeout_s: float, progress: Progress, period: float | None = None):
        self.store, self.rank, self.world = store, state.rank, state.world_size
        self.timeout_s, self.progress = timeout_s, progress
        self.period = period or min(1.0, max(0.05, timeout_s / 10))
        self.groups = _group_ranks(state)
        now = time.monotonic()
        self.peers = {r: Peer(changed=now) for r in range(self.world) if r != self.rank}
        self.counter = 0
        self.store_ok_at = now
        self.lock = threading.Lock()
        self.reported = False
        self._stop = threading.Event()
        self._publish()
        self.thread = threading.Thread(target=self._loop, name="tpframe-heartbeat", daemon=True)
        self.thread.start()

    @classmethod
    def start(cls, state, *, timeout_s: float, progress: Progress) -> Heartbeat | None:
        """The heartbeat of this rank, or None in a world of one (or without a store to beat in)."""
        if state.world_size == 1:
            return None
        try:
            store = dist.PrefixStore("tpframe/heartbeat/", dist.distributed_c10d._get_default_store())
        except (AttributeError, ValueError, RuntimeError):
            return None
        return cls(store, state, timeout_s=timeout_s, progress=progress)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=2 * self.period + 1)

    # -- the thread -------------------------------------------------------------------------------
    def _publish(self) -> None:
        self.counter += 1
        self.store.set(str(self.rank), f"{self.counter} {self.progress.step} {self.progress.phase}")

    def _loop(self) -> None:
        keys = [str(r) for r in self.peers]
        while not self._stop.wait(self.period):
            try:
                self._publish()
                if keys and self.store.check(keys):
                    values = self.store.multi_get(keys)
                    now = time.monotonic()
                    for r, raw in zip(self.peers, values):
                        counter, step, phase = raw.decode().split(" ", 2)
                        peer = self.peers[r]
                        if int(counter) != peer.counter:
                            peer.counter, peer.step, peer.phase, peer.changed = int(counter), int(step), phase, now
                self.store_ok_at = time.monotonic()
            except Exception:  # noqa: BLE001 - the store itself is unreachable: judged below by its age
                pass
            silent = self.silent(SILENCE * self.timeout_s)
            if silent and not self._stop.is_set():
                self._report_and_exit(silent)

    # -- judging ----------------------------------------------------------------------------------
    def silent(self, seconds: float) -> list[int]:
        """Ranks that have not beaten for more than `seconds`."""
        now = time.monotonic()
        return sorted(r for r, p in self.peers.items() if now - p.changed > seconds)

    def _waiting_for(self, group_names) -> list[int]:
        """The members of this phase's groups that are not where this rank is: silent, or at another step/phase."""
        members = sorted({r for name in group_names for r in self.groups.get(name, [])})
        silent = set(self.silent(max(3 * self.period, 2.0)))
        me = (self.progress.step, self.progress.phase)
        return [
            r for r in members if r != self.rank and (r in silent or (self.peers[r].step, self.peers[r].phase) != me)
        ]

    def _describe_peer(self, r: int) -> str:
        p, age = self.peers[r], time.monotonic() - self.peers[r].changed
        last = f"last seen at step {p.step}, {p.phase}" if p.counter >= 0 else "never seen"
        if age > max(3 * self.period, 2.0):
            return f"rank {r} (no heartbeat for {age:.0f} s; {last})"
        return f"rank {r} (alive, at step {p.step}, {p.phase})"

    def message(self, head: str, silent_only: list[int] | None = None) -> tuple[str, bool]:
        """(one line, whether this rank prints it: the lowest-ranked rank that is not silent)."""
        groups, what = PHASES.get(self.progress.phase, (("world",), self.progress.phase))
        missing = self._waiting_for(groups) if silent_only is None else silent_only
        names = " and ".join(f"{g} group {self.groups.get(g)}" for g in groups)
        where = (
            f"rank {self.rank} waited {time.monotonic() - self.progress.since:.0f} s at step {self.progress.step} "
            f"in {what} on the {names}"
        )
        who = (
            ("; did not arrive: " + ", ".join(self._describe_peer(r) for r in missing))
            if missing
            else "; every rank of the group was alive and at the same place (a collective mismatch?)"
        )
        store_age = time.monotonic() - self.store_ok_at
        if store_age > max(3 * self.period, 2.0):
            who += f"; the store the heartbeats go through has not answered for {store_age:.0f} s"
        live = [r for r in range(self.world) if r == self.rank or r not in self.silent(max(3 * self.period, 2.0))]
        return f"{head}: {where}{who}; comm.timeout_s={self.timeout_s:g}", self.rank == min(live)

    def _report_and_exit(self, silent: list[int]) -> None:
        with self.lock:
            if self.reported:
                return
            self.reported = True
        line, report = self.message("a rank stopped responding", silent_only=silent)
        dumped = dump_flight_recorder(self.rank)
        if dumped is not None:
            line += f"; NCCL flight recorder: {dumped.parent}"
        exits.report(line, show=report)
        os._exit(exits.EXIT_COMM)

    # -- the main thread's failures ----------------------------------------------------------------
    def explain(self, error: BaseException) -> BaseException:
        """A communication failure as a CommFailure with the one-line report; any other error unchanged."""
        if not is_comm_failure(error):
            return error
        with self.lock:
            if self.reported:  # the thread is reporting and exiting already
                time.sleep(10 * self.period)
            self.reported = True
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if any(s in first.lower() for s in _PEER_GONE):  # let a dead peer's heartbeat go stale, so the line calls
            time.sleep(max(3 * self.period, 2.0) + self.period)  # it silent, not alive (a launcher kills us first)
        line, report = self.message(f"a collective failed ({first[:160]})")
        dumped = dump_flight_recorder(self.rank)
        if dumped is not None:
            line += f"; NCCL flight recorder: {dumped.parent}"
        return CommFailure(line, report)
