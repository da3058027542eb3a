"""Stage-to-stage communication: activations [s(/tp), b, h] forward, their gradients backward.

Every directed link between neighbouring pipeline ranks (activations r -> r+1, gradients r+1 -> r,
and with virtual stages the wrap-around pair between the last rank and the first) is a process group
of its own carrying one kind of message in one direction. A schedule order sends on a link in the
order its receiver takes (checked by `orders.simulate`), so every link is a first-in first-out
queue: NCCL needs nothing else to match sends with receives, and no send waits behind a receive of
the other direction. Shapes and dtype are fixed for a run, so a receive allocates its buffer
without a handshake.

A receive that does not complete within `timeout_s` ends the run with a message naming the stage,
the micro-batch and the peer: with gloo (CPU) the wait itself times out; with NCCL the wait does not
block the CPU, so a watchdog thread checks the outstanding receives.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from tpframe.parallel.state import ParallelState, rank_layout


class PipelineTimeout(RuntimeError):
    """A stage waited longer than parallel.pp_timeout_s for a message from its neighbour."""


class PipelineLinks:
    """This rank's links to its pipeline neighbours (built collectively: every rank calls the constructor)."""

    KINDS = ("act", "grad")

    def __init__(self, state: ParallelState, *, wrap: bool = False, timeout_s: float = 300.0):
        self.state, self.timeout_s = state, timeout_s
        self.pp, self.rank = state.pp, state.pp_rank
        self.groups: dict[tuple[str, int], dist.ProcessGroup] = {}  # (kind, lower pipeline rank of the pair) -> group
        for pipeline in rank_layout(state.world_size, state.tp, state.pp, cp=state.cp)["pp"]:
            for r in range(state.pp if wrap else state.pp - 1):
                for kind in self.KINDS:
                    ranks = sorted({pipeline[r], pipeline[(r + 1) % state.pp]})
                    group = dist.new_group(ranks)
                    state._groups.append(group)  # destroyed with the parallel state
                    if state.rank in pipeline:
                        self.groups[(kind, r)] = group
        self.cuda = state.device.type == "cuda"
        self.watchdog = Watchdog(timeout_s) if self.cuda else None
        self.idle: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext  # a StageTimer's idle()
        self.sends: list = []
        self._warm_up()

    def _warm_up(self) -> None:
        """One tiny message over every link, link by link in the same order on every rank: NCCL sets up a
        pair's communicator at its first message, blocking until both ends arrive, so first uses in
        schedule order could wait on each other; here they cannot (and a broken link fails at start)."""
        token = torch.zeros(1, device=self.state.device)
        for kind, r in sorted(self.groups):
            src, dst = (r, (r + 1) % self.pp) if kind == "act" else ((r + 1) % self.pp, r)
            group = self.groups[(kind, r)]
            if self.rank == src:
                dist.send(token, self.state.pp_ranks[dst], group=group)
            elif self.rank == dst:
                dist.recv(token, self.state.pp_ranks[src], group=group)

    def _peer(self, kind: str, direction: str) -> tuple[dist.ProcessGroup, int]:
        """(group, global peer rank) for sending (direction "out") or receiving ("in") messages of `kind`."""
        downstream = (kind == "act") == (direction == "out")  # the peer is the next rank
        link = self.rank if downstream else (self.rank - 1) % self.pp
        peer = (self.rank + (1 if downstream else -1)) % self.pp
        return self.groups[(kind, link)], self.state.pp_ranks[peer]

    def send(self, kind: str, tensor: torch.Tensor) -> None:
        """Post a send of `tensor` (kept alive until the send completes); returns at once."""
        group, peer = self._peer(kind, "out")
        tensor = tensor.contiguous()
        self.sends.append((dist.isend(tensor, peer, group=group), tensor))
        self.sends = [(w, t) for w, t in self.sends if not w.is_completed()]

    def recv(self, kind: str, shape: tuple[int, ...], dtype: torch.dtype, *, stage: int, mb: int) -> torch.Tensor:
        """Receive the next message of `kind` into a new [shape] buffer; `stage` (this rank's virtual
        stage) and `mb` only name the wait if it times out."""
        group, peer = self._peer(kind, "in")
        buffer = torch.empty(shape, dtype=dtype, device=self.state.device)
        work = dist.irecv(buffer, peer, group=group)
        peer_stage = stage - 1 if kind == "act" else stage + 1
        what = "activations" if kind == "act" else "output gradient"
        message = (
            f"pipeline stage {stage} (rank {self.state.rank}) waited more than {self.timeout_s:g}s for the "
            f"{what} of micro-batch {mb} from stage {peer_stage} (rank {peer}); that rank stopped or hangs, "
            "see its log (parallel.pp_timeout_s sets the limit)"
        )
        with self.idle():
            if self.cuda:  # the wait only orders the streams; the watchdog bounds it
                self.watchdog.watch(work, message)
                work.wait()
            else:
                try:
                    work.wait(timedelta(seconds=self.timeout_s))
                except RuntimeError as e:
                    raise PipelineTimeout(f"{message} [{str(e).splitlines()[0][:200]}]") from None
        return buffer

    def wait_sends(self) -> None:
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()


class Watchdog:
    """Checks outstanding receives from a daemon thread; one older than `timeout_s` calls `on_timeout`
    with its message (default: print it and end the process, as NCCL's own watchdog would, only sooner
    and naming the stage). The thread runs only while something is watched."""

    def __init__(self, timeout_s: float, on_timeout: Callable[[str], None] | None = None, poll_s: float = 1.0):
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self.on_timeout = on_timeout or _abort
        self.watched: list[tuple[float, object, str]] = []
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def watch(self, work, message: str) -> None:
        with self.lock:
            self.watched.append((time.monotonic(), work, message))
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="tpframe-pipeline-watchdog", daemon=True)
                self.thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(self.poll_s)
            now = time.monotonic()
            with self.lock:
                self.watched = [(t, w, m) for t, w, m in self.watched if not w.is_completed()]
                late = next((m for t, w, m in self.watched if now - t > self.timeout_s), None)
                if late is not None or not self.watched:
                    self.thread = None
                    if late is not None:
                        self.watched.clear()
                    break
        if late is not None:
            self.on_timeout(late)


def _abort(message: str) -> None:
    print(f"tpframe: {message}", file=sys.stderr, flush=True)
    os._exit(1)
