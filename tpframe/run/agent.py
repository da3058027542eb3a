"""The launcher's agent: torchelastic's LocalElasticAgent (c10d rendezvous, worker processes, restarts), with
tpframe's rules for what a failure does.

- A dead worker is named in one line (rank, exit code or signal, the step its heartbeat last showed); the
  others on this node are killed at once (SIGKILL: a peer is gone, so no collective of theirs can complete,
  and a SIGTERM would make them try to save).
- With `max_restarts` K, the workers are started again (up to K times) and resume from the run's latest
  checkpoint, one line per restart saying which rank, which exit and from which step. Exit codes 2 (a mistake
  in the config or a checkpoint), 3 (training stopped) and 5 (a file not written) would only repeat: never
  retried.
- Each attempt gets a fresh store for its process groups, held by this agent: a store kept across attempts
  holds the dead attempt's gloo/NCCL addresses, and the new workers wait on them until their timeout.
- Elastic on one node (`local_sizes`: the worker counts the layout allows, largest first): a slot whose worker
  died sits out the next attempt, which runs at the largest allowed count of the slots left (the same global
  batch, more accumulation: the data position is global). Once a checkpoint has been saved at the smaller
  world, the agent asks the workers to save and stop (SIGTERM), and starts them again at the largest count.
  Across nodes (`--nnodes MIN:MAX`) torchelastic's rendezvous does the same: a node that leaves is a failure,
  a node that joins restarts every node's workers (SIGTERM: they save first).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from torch.distributed import TCPStore
from torch.distributed.elastic.agent.server.api import DEFAULT_ROLE, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.rendezvous.api import RendezvousError

from tpframe.checkpoint.files import CHECKPOINTS_KEY, latest_step, newer_snapshot, snapshot_root
from tpframe.parallel.heartbeat import parse_beat
from tpframe.run import LAUNCHER_PID_ENV

STOP_GRACE_S = 300  # how long stopped workers get to save before SIGKILL
TPFRAME_CODES = {
    2: "config error",
    3: "training stopped",
    4: "a rank stopped responding",
    5: "checkpoint not saved",
    6: "out of memory",
}
NOT_RETRIED = (2, 3, 5)  # a restart would repeat them
_STORE_KEY = "tpframe/worker_store"
# tpframe.parallel.heartbeat's key in the workers' store, under torch's prefixes of the default group's store
_HEARTBEAT_KEY = "default_pg/0//tpframe/heartbeat//{}"
_CHECKPOINTS_KEY = "default_pg/0//" + CHECKPOINTS_KEY  # rank 0's checkpointer: "<step resumed from, or -1> <folder>"


def say(line: str) -> None:
    print(f"tpframe.launch: {line}", file=sys.stderr, flush=True)


@dataclass
class Death:
    """A worker that ended with a non-zero code (negative: the signal that killed it)."""

    rank: int
    local_rank: int
    code: int
    step: str  # "; last seen at step N (phase)" from its last heartbeat, or ""

    def describe(self) -> str:
        if self.code < 0:
            what = f"died of signal {-self.code} ({signal.Signals(-self.code).name})"
        else:
            what = f"exited {self.code}" + (f" ({TPFRAME_CODES[self.code]})" if self.code in TPFRAME_CODES else "")
        return f"rank {self.rank} {what}{self.step}"


class Agent(LocalElasticAgent):
    def __init__(
        self, spec, logs_specs, *, local_sizes: list[int], checkpoints: Path | None, start: int | None, single_node
    ):
        """`checkpoints`: the run's checkpoint folder (None: learnt from the workers); `start`: the step the first start
        resumes from (checkpoint.load or `latest`), where a restart resumes too while the run has saved nothing."""
        super().__init__(spec, logs_specs, start_method="spawn")
        self.local_sizes, self.checkpoints, self.start, self.single_node = local_sizes, checkpoints, start, single_node
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        self.slots = visible.split(",") if visible else [str(i) for i in range(local_sizes[0])]
        self.out: set[str] = set()  # slots sitting out after their worker died
        self.deaths: list[Death] = []
        self.killed: set[int] = set()
        self.worker_store: TCPStore | None = None
        self.stopping = False  # a forwarded SIGTERM/SIGUSR1/SIGINT, or node 0 gone: no restart, no growth
        self.attempt, self.resumed_at = 0, start

    def run(self, role: str = DEFAULT_ROLE):
        try:
            return super().run(role)
        finally:  # the launch is over: no restart will read its snapshots (one node only); their host memory back
            if self.single_node and self._learn_checkpoints() is not None:
                shutil.rmtree(snapshot_root(self.checkpoints), ignore_errors=True)

    # -- a fresh store per attempt ---------------------------------------------------------------------------
    def _rendezvous(self, group: WorkerGroup) -> None:
        super()._rendezvous(group)  # group.store: this round's own keys
        if group.group_rank == 0:
            host = "127.0.0.1" if self.single_node else (group.spec.local_addr or socket.getfqdn())
            self.worker_store = TCPStore(host, 0, is_master=True, wait_for_workers=False, multi_tenant=True)
            group.store.set(_STORE_KEY, f"{host} {self.worker_store.port} {self.attempt}")
        host, port, attempt = group.store.get(_STORE_KEY).decode().split()
        self.attempt = int(attempt)  # node 0's count: a node that joins later resumes as the others do
        if group.group_rank != 0:
            self.worker_store = TCPStore(host, int(port), is_master=False)
        group.master_addr, group.master_port = host, int(port)

    # -- watching the workers ----------------------------------------------------------------------------------
    def _step_of(self, rank: int) -> str:
        try:
            key = _HEARTBEAT_KEY.format(rank)
            if self.worker_store is not None and self.worker_store.check([key]):
                _, step, phase, _ = parse_beat(self.worker_store.get(key))
                return f", last seen at step {step} ({phase})"
        except Exception:  # noqa: BLE001 - the step is a courtesy; the death is named without it
            pass
        return ""

    def _monitor_workers(self, group: WorkerGroup):
        handlers = getattr(self._pcontext, "subprocess_handlers", {}) or {}
        codes = {lr: h.proc.poll() for lr, h in handlers.items()}
        seen = {d.local_rank for d in self.deaths} | self.killed
        new = [lr for lr, code in codes.items() if code not in (None, 0) and lr not in seen]
        for lr in new:  # tpframe's own exit printed its step (and the store may have gone with a peer's node)
            rank = group.workers[lr].global_rank
            self.deaths.append(Death(rank, lr, codes[lr], "" if codes[lr] in TPFRAME_CODES else self._step_of(rank)))
        if new:  # the rest cannot finish a collective without it
            for lr, code in codes.items():
                if code is None:
                    handlers[lr].proc.kill()
                    self.killed.add(lr)
        return super()._monitor_workers(group)

    def root_cause(self) -> Death | None:
        """The death that caused the others: a signal, a crash or tpframe's own exit before any exit 4 (a peer
        that saw a collective fail), then the first seen."""
        return min(self.deaths, key=lambda d: d.code == 4, default=None)

    # -- the loop ----------------------------------------------------------------------------------------------
    def _invoke_run(self, role: str = DEFAULT_ROLE):
        group = self._worker_group
        self._start(group)
        while True:
            time.sleep(group.spec.monitor_interval)
            result = self._monitor_workers(group)
            group.state = result.state
            if result.state == WorkerState.SUCCEEDED:
                self._exit_barrier()
                return result
            if result.state in (WorkerState.UNHEALTHY, WorkerState.FAILED):
                death = self.root_cause()
                code = death.code if death else 1
                if self.stopping or code in NOT_RETRIED or self._remaining_restarts <= 0:
                    self._stop_workers(group)
                    group.state = WorkerState.FAILED
                    return result
                self._remaining_restarts -= 1
                if death is not None and self.local_sizes[-1] < self.local_sizes[0]:
                    self.out.add(self._current_slots()[death.local_rank])
                n = group.spec.max_restarts - self._remaining_restarts
                self._restart(
                    group,
                    f"{death.describe() if death else 'a worker failed'}; restart {n} of {group.spec.max_restarts}",
                )
            elif not self.stopping and self._nodes_waiting(group):
                self._restart(group, "a node joined (or restarted its workers)", planned=True)
            elif not self.stopping and self._capacity_back():
                self._restart(group, "the slots are back", planned=True)

    def _nodes_waiting(self, group: WorkerGroup) -> bool:
        """Whether a node waits to join. Node 0's store unreachable (it has gone): no restart can meet, so none is
        tried; the workers here end on their own, with their own line."""
        try:
            return group.spec.rdzv_handler.num_nodes_waiting() > 0
        except RendezvousError:
            self.stopping = True
            return False

    def _current_slots(self) -> list[str]:
        return [s for s in self.slots if s not in self.out][: self._worker_group.spec.local_world_size]

    def _capacity_back(self) -> bool:
        """A slot sat out and a checkpoint was saved since: try the full count again."""
        if not self.out:
            return False
        latest = self._latest_step()  # on disk: a snapshot serves only the world it was taken at
        if latest is None or (self.resumed_at is not None and latest <= self.resumed_at):
            return False
        self.out.clear()
        return True

    def _latest_step(self, world: int | None = None) -> int | None:
        """The run's `latest` step; with `world`, the step a restart at that world resumes from: `latest`, or this
        launch's newer snapshot in host memory when it was taken at that world."""
        root = self._learn_checkpoints()
        if root is None:
            return self.start
        job = self._worker_group.spec.rdzv_handler.get_run_id()
        snapshot = newer_snapshot(root, job, world) if world is not None else None
        step = snapshot[1]["step"] if snapshot is not None else latest_step(root)
        return self.start if step is None else step

    def _learn_checkpoints(self) -> Path | None:
        """The run's checkpoint folder; under --no-check (no pre-flight), as rank 0's checkpointer published it, with
        the step it resumed from."""
        if self.checkpoints is None and self.worker_store is not None:
            try:
                if self.worker_store.check([_CHECKPOINTS_KEY]):
                    step, root = self.worker_store.get(_CHECKPOINTS_KEY).decode().split(" ", 1)
                    self.checkpoints, self.start = Path(root), (int(step) if int(step) >= 0 else None)
            except Exception:  # noqa: BLE001 - not published (another script, a worker that died first): unknown
                pass
        return self.checkpoints

    def _size(self) -> int:
        """The largest allowed worker count of the slots in service (all of them when none fits)."""
        free = len(self.slots) - len(self.out)
        size = next((n for n in self.local_sizes if n <= free), self.local_sizes[0])
        if size == self.local_sizes[0]:
            self.out.clear()
        return size

    def _start(self, group: WorkerGroup) -> None:
        size = group.spec.local_world_size = self._size()
        if self.local_sizes[-1] < self.local_sizes[0]:  # the slots in service, in order
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join([s for s in self.slots if s not in self.out][:size])
        self.deaths, self.killed = [], set()  # killed: by this agent, after a death
        self._initialize_workers(group)

    def _start_workers(self, group: WorkerGroup):
        os.environ["TPFRAME_ATTEMPT"] = str(self.attempt)  # > 0: the workers resume from the latest checkpoint
        os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
        pids = super()._start_workers(group)
        if self.stopping:  # a stop asked for while they were starting (the rendezvous, the spawn): theirs too
            for pid in pids.values():
                os.kill(pid, signal.SIGTERM)
        return pids

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, *args, **kwargs) -> None:
        """Stop the workers (torchelastic's `_stop_workers` calls this): SIGTERM (live workers save and exit 0, a
        planned stop), SIGKILL after STOP_GRACE_S. Ours rather than torchelastic's, whose signature and grace (30 s)
        differ between torch versions."""
        for name in ("_worker_watchdog", "_health_check_server"):
            if getattr(self, name, None) is not None:
                getattr(self, name).stop()
                setattr(self, name, None)
        if self._pcontext:
            self._pcontext.close(death_sig, STOP_GRACE_S)

    def _restart(self, group: WorkerGroup, why: str, *, planned: bool = False) -> None:
        """Stop the workers and start them again; `planned`: asked to save and stop (SIGTERM), the line says whether
        they did. A stop asked for meanwhile: no new workers; the loop then ends with how the stopped ones ended."""
        self._stop_workers(group)
        group.state = WorkerState.STOPPED
        if self.stopping:
            return
        if planned:
            handlers = getattr(self._pcontext, "subprocess_handlers", {}) or {}
            saved = all(h.proc.poll() == 0 for h in handlers.values())
            why += f": the workers {'saved and stopped' if saved else 'stopped without saving'}; restart"
        self.attempt += 1
        before, after = group.spec.local_world_size, self._size()
        self.resumed_at = self._latest_step(after if self.single_node else None)
        where = f"from step {self.resumed_at}" if self.resumed_at is not None else "from the start (no checkpoint)"
        change = f"; world {before} -> {after}" if self.single_node and after != before else ""
        say(f"{why} {where}{change}")
        self._start(group)
