"""Start this node's workers under tpframe's agent (tpframe/run/agent.py) and turn how they ended into one exit
code and at most one line of the launcher's own: the rendezvous (c10d, on node 0's --rdzv-endpoint, or this
host alone), the forwarding of preemption signals, and the end (tpframe.launch's `main` calls `launch`)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import uuid
from pathlib import Path

from tpframe.run.agent import TPFRAME_CODES, Agent, say

FORWARDED = (signal.SIGTERM, signal.SIGUSR1)


def _children() -> list[int]:
    """Pids of this process's children (the workers): /proc/<pid>/task/*/children."""
    pids = []
    for task in Path(f"/proc/{os.getpid()}/task").glob("*"):
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return pids


def _quiet_torchelastic() -> None:
    """torchelastic logs worker deaths and restarts at WARNING; the workers' own lines and ours say it better."""
    if os.environ.get("LOGLEVEL"):
        return
    for name in list(logging.root.manager.loggerDict) + ["torch.distributed.elastic"]:
        if name.startswith("torch.distributed.elastic") or name.startswith("torch.distributed.launcher"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _rendezvous(args, *, read_timeout: int = 300):
    """The c10d rendezvous of this launch: node 0 hosts its store at --rdzv-endpoint (the others wait for it up to
    `read_timeout` s, its pre-flight included); one node: this host alone."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry

    several = args.nodes[-1] > 1
    params = RendezvousParameters(
        backend="c10d",
        endpoint=args.rdzv_endpoint if several else "localhost:0",
        run_id=os.environ.get("SLURM_JOB_ID", "tpframe") if several else str(uuid.uuid4()),
        min_nodes=args.nodes[0],
        max_nodes=args.nodes[-1],
        is_host=args.node_rank == 0 or not several,
        read_timeout=read_timeout,
    )
    return rdzv_registry.get_rendezvous_handler(params)


def close_rendezvous(args) -> None:
    """This node's pre-flight failed: close the rendezvous, so the other nodes stop (exit 2) instead of waiting
    for it. Best effort: a node 0 that is not up yet cannot be told."""
    _quiet_torchelastic()
    try:
        _rendezvous(args, read_timeout=10).shutdown()
    except Exception:  # noqa: BLE001 - the others then wait out their join timeout
        pass


def _forward(agent: Agent):
    def forward(signum, frame) -> None:
        agent.stopping = True  # no restart after a stop someone asked for
        for pid in _children():
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        say(f"{signal.Signals(signum).name} forwarded to the workers: they save a checkpoint and stop")

    return forward


def launch(args, *, local_sizes: list[int], checkpoints: Path | None, start: int | None = None) -> int:
    """Run the workers to their end; the exit code (0, a worker's tpframe code, 1, 128 + a signal)."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousError

    _quiet_torchelastic()
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGINT,SIGHUP,SIGQUIT"  # SIGTERM/SIGUSR1: forwarded
    if args.nodes[-1] * local_sizes[0] > 1:  # as torchrun does: N processes with every core's threads would thrash
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    single, agent = args.nodes[-1] == 1, None
    try:
        spec = WorkerSpec(
            role="default",
            local_world_size=local_sizes[0],
            entrypoint=sys.executable,
            args=("-u", args.script, *args.script_args),
            rdzv_handler=_rendezvous(args),
            max_restarts=args.max_restarts,
            monitor_interval=0.1,
        )
        agent = Agent(
            spec, DefaultLogsSpecs(), local_sizes=local_sizes, checkpoints=checkpoints, start=start, single_node=single
        )
        for sig in FORWARDED:
            signal.signal(sig, _forward(agent))
        result = agent.run()
    except SignalException as e:
        spec.rdzv_handler.shutdown()  # the other nodes stop too, instead of waiting for this one
        say(f"stopped by {signal.Signals(e.sigval).name}")
        return 128 + int(e.sigval)
    except RendezvousClosedError:
        say("the run was refused on another node (its launcher printed why); nothing was started here")
        return 2
    except RendezvousError as e:
        cause = str(e.__cause__ or e).strip().splitlines()[0][:200]
        if getattr(agent, "_pcontext", None) is None:  # no worker started
            say(f"the nodes did not meet at --rdzv-endpoint {args.rdzv_endpoint}: {cause}")
        else:
            say(f"node 0's rendezvous at {args.rdzv_endpoint} is gone ({cause}): no restart; see the workers' lines")
        return 4
    if result is None or not result.is_failed():
        return 0  # every node passed the exit barrier: nothing to close
    spec.rdzv_handler.shutdown()
    death = agent.root_cause()
    if death is not None and death.code in TPFRAME_CODES:  # the worker printed its line
        return death.code
    if agent.stopping and death is not None and -death.code in FORWARDED:  # it landed before train.py could take it
        say(f"the workers ended on the forwarded {signal.Signals(-death.code).name} before they could save")
        return 0
    say(f"{death.describe() if death else 'a worker failed'}; its output is above")
    return 1
