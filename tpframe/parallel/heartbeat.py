"""Bounded waits: who is stuck where, when a collective waits too long or a rank stops responding.

Every process group gets `comm.timeout_s` (tpframe.parallel.state); a timed-out gloo collective raises,
NCCL's watchdog aborts the communicator. Neither says which rank is missing, so each rank also
publishes a heartbeat in the job's store, once every `period` seconds from a thread:
`<counter> <step> <phase> <collectives>`, where (step, phase) is what its main thread is doing (`Progress`, marked
by the trainer). A rank frozen by SIGSTOP or wedged in a call that holds the GIL stops beating.

    progress = Progress()
    beat = Heartbeat.start(state, timeout_s=300, progress=progress)  # None in a world of one
    ...
    raise beat.explain(error)   # a communication failure -> CommFailure naming group, operation, missing ranks
    beat.stop()

When a peer has not beaten for 0.9 x `timeout_s`, the thread reports it itself (the lowest-ranked live rank
prints one line) and ends the process with exit code 4 (tpframe/exits.py), whether the main thread is in a
gloo or an NCCL wait; so does a collective of this rank's that has not completed for that long, all ranks alive.
Each beat also carries this rank's flight-recorder counters (tpframe/parallel/flight.py), so the report names the
collective that did not complete (op, group, sequence number, sizes) and the ranks that never entered it, and the
live ranks' records are dumped to `<run_dir>/comm_trace/rank_<r>` before the exit.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import torch.distributed as dist

from tpframe import exits
from tpframe.parallel import flight

SILENCE = 0.9  # a peer silent this share of comm.timeout_s is reported before any collective's own timeout fires

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
_STORE_GONE = (*_PEER_GONE, "connection was likely closed")  # the store's host ended


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
    groups: dict = field(default_factory=dict)  # its collectives per group (tpframe/parallel/flight.py), as published


def parse_beat(raw: bytes) -> tuple[str, str, str, str]:
    """(counter, step, phase, groups' status) of a heartbeat as `Heartbeat._publish` writes it."""
    counter, step, phase, groups = (raw.decode().split(" ", 3) + [""])[:4]
    return counter, step, phase, groups


def is_comm_failure(error: BaseException) -> bool:
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and any(s in str(error).lower() for s in _COMM_ERRORS)


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
        self.table = flight.group_table(state)  # the groups whose collectives the flight recorder counts
        self.ids: dict[str, str | None] = {}  # the recorder's group ids -> group names (flight.status)
        self.waiting: dict[str, tuple[int, float]] = {}  # group -> (its last completed collective, since when)
        now = time.monotonic()
        self.peers = {r: Peer(changed=now) for r in range(self.world) if r != self.rank}
        self.counter = 0
        self.store_ok_at, self.store_gone = now, False
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

    def watch(self, kind: str, group) -> None:
        """Name `group`, made after the heartbeat started (the checkpointer's own), in the reports as `kind`."""
        if group is None:
            return
        name, ranks = dist.distributed_c10d._get_process_group_name(group), dist.get_process_group_ranks(group)
        self.groups = {**self.groups, kind: ranks}  # new dicts: the thread reads these while it judges
        self.table = {**self.table, name: (kind, ranks)}

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=2 * self.period + 1)

    # -- the thread -------------------------------------------------------------------------------
    def _publish(self) -> None:
        self.counter += 1
        mine = {name: counts for name, counts in flight.status(self.ids).items() if name in self.table}
        self._track(mine)
        text = f"{self.counter} {self.progress.step} {self.progress.phase} {flight.status_text(mine)}"
        self.store.set(str(self.rank), text)

    def _track(self, mine: dict[str, tuple[int, int]]) -> None:
        """Since when each group has had a collective entered here and not completed."""
        now = time.monotonic()
        for name, (entered, completed) in mine.items():
            if entered <= completed:
                self.waiting.pop(name, None)
            elif self.waiting.get(name, (None,))[0] != completed:
                self.waiting[name] = (completed, now)

    def _collective_waited(self) -> float:
        """How long this rank's oldest uncompleted collective has waited (0 without one)."""
        return max((time.monotonic() - since for _, since in self.waiting.values()), default=0.0)

    def _exchange(self, keys: list[str]) -> None:
        """Publish this rank's beat and read the peers'. A store whose host has ended is not asked again (each try
        logs C++ frames): the peers' silence is judged by its age."""
        try:
            self._publish()
            if keys and self.store.check(keys):
                values = self.store.multi_get(keys)
                now = time.monotonic()
                for r, raw in zip(self.peers, values):
                    counter, step, phase, groups = parse_beat(raw)
                    peer = self.peers[r]
                    if int(counter) != peer.counter:
                        peer.counter, peer.step, peer.phase, peer.changed = int(counter), int(step), phase, now
                        peer.groups = flight.parse_status(groups)
            self.store_ok_at = time.monotonic()
        except Exception as e:  # noqa: BLE001 - the store itself is unreachable: judged by its age
            self.store_gone = any(s in str(e).lower() for s in _STORE_GONE)

    def _loop(self) -> None:
        keys = [str(r) for r in self.peers]
        while not self._stop.wait(self.period):
            if not self.store_gone:
                self._exchange(keys)
            silent = self.silent(SILENCE * self.timeout_s)
            # all alive, a collective that never ends (seen here up to a period after it began, checked each period)
            hung = self._collective_waited() > SILENCE * self.timeout_s - 2 * self.period
            if (silent or hung) and not self._stop.is_set():
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

    def _describe_peer(self, r: int, group: str | None = None) -> str:
        p, age = self.peers[r], time.monotonic() - self.peers[r].changed
        last = f"last seen at step {p.step}, {p.phase}" if p.counter >= 0 else "never seen"
        entered = f", last entered #{p.groups.get(group, (0, 0))[0]} there" if group is not None else ""
        if age > max(3 * self.period, 2.0):
            return f"rank {r} (no heartbeat for {age:.0f} s; {last}{entered})"
        return f"rank {r} (alive, at step {p.step}, {p.phase}{entered})"

    def _stuck(self, what: str) -> tuple[str, str] | None:
        """(where this rank waits, whom for) from the flight recorder: the collective that did not complete."""
        now = time.monotonic()
        peers = {r: (p.groups, now - p.changed) for r, p in self.peers.items()}
        stuck = flight.find_stuck(flight.pending(), self.table, peers, self.rank)
        if stuck is None or not stuck.waits_for():
            return None
        where = (
            f"rank {self.rank} waited {stuck.waited_s:.0f} s at step {self.progress.step} in {stuck.describe()}, "
            f"during {what}"
        )
        who = "".join(
            f"; {label}: " + ", ".join(self._describe_peer(r, stuck.group) for r in ranks)
            for label, ranks in stuck.waits_for()
        )
        return where, who

    def message(self, head: str, silent_only: list[int] | None = None) -> tuple[str, bool]:
        """(one line, whether this rank prints it: the lowest-ranked rank that is not silent)."""
        groups, what = PHASES.get(self.progress.phase, (("world",), self.progress.phase))
        where, who = self._stuck(what) or self._by_phase(groups, what, silent_only)
        store_age = time.monotonic() - self.store_ok_at
        if store_age > max(3 * self.period, 2.0):
            who += f"; the store the heartbeats go through has not answered for {store_age:.0f} s"
        dumped = flight.dump(self.rank, self.table)
        if dumped is not None:
            who += f"; flight records in {dumped.parent}"
        live = [r for r in range(self.world) if r == self.rank or r not in self.silent(max(3 * self.period, 2.0))]
        return f"{head}: {where}{who}; comm.timeout_s={self.timeout_s:g}", self.rank == min(live)

    def _by_phase(self, groups, what: str, silent_only: list[int] | None) -> tuple[str, str]:
        """(where, whom for) from the heartbeats alone: the members of this phase's groups not where this rank is."""
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
        return where, who

    def _report_and_exit(self, silent: list[int]) -> None:
        with self.lock:
            if self.reported:
                return
            self.reported = True
        # the collective's wait can pass its limit a moment before a frozen peer's silence does: name the freeze
        frozen = silent or self.silent(max(3 * self.period, 2.0))
        head = "a rank stopped responding" if frozen else "a collective did not complete"
        line, report = self.message(head, silent_only=silent)
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
        return CommFailure(line, report)
