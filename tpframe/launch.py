"""The launcher: check the config once for every world it may run, start the workers under torchelastic's
agent, forward preemption signals, and exit with the workers' code and no traceback of its own.

    python -m tpframe.launch --nproc-per-node 8 train.py --config configs/X.yaml [section.key=value ...]
    python -m tpframe.launch --nnodes 2 --node-rank R --rdzv-endpoint node0:29500 --nproc-per-node 8 train.py ...
    python -m tpframe.launch --nproc-per-node 2:4 --max-restarts 3 train.py ...       # elastic, one node

1. The parent runs train.py's `prepare` for the whole world (config, env vars, model shapes, memory on
   CPU, data, run directory, checkpoint) before any worker exists, on every node: a mistake is one line,
   exit code 2, and a node whose pre-flight failed closes the rendezvous so the others stop too.
2. Workers start under tpframe/run/agent.py's agent (torchelastic's LocalElasticAgent, c10d rendezvous),
   with torchelastic's own logging silenced.
3. SIGTERM and SIGUSR1 are forwarded to the workers, which save a checkpoint at the end of the step and
   exit 0; the launcher then exits 0. SIGINT (Ctrl-C) stops them without saving (exit 130).
4. A worker's failure ends the launch with that worker's exit code (2 config, 3 non-finite steps,
   4 a stopped rank or failed collective: tpframe/exits.py); the worker printed the line. A worker killed
   by a signal or crashing is named in one line: rank, signal or exit code, step. With --max-restarts K
   the workers start again from the latest checkpoint (one line per restart), except after 2, 3 and 5.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import inspect
import os
import socket
import sys
from pathlib import Path
from typing import NamedTuple

LAUNCH_HINT = "launch with python -m tpframe.launch --nproc-per-node N"


class LaunchEnv(NamedTuple):
    world_size: int
    rank: int
    local_rank: int
    local_world_size: int


def _world_exists() -> bool:
    """Whether the program already built the world's process group itself (so MASTER_ADDR/PORT go unused)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def launch_env() -> LaunchEnv:
    """This process's torchrun environment (WORLD_SIZE, RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT), checked before anything is written: train.py's and generate.py's pre-flight. Unset, it is a
    world of one (`single_process_env` fills it in). A ConfigError names the variable and the fix."""
    from tpframe.errors import ConfigError, env_int

    env = os.environ

    def integer(name: str, default: int, low: int) -> int:
        return env_int(name, default, low, hint=f" ({LAUNCH_HINT})")

    world = integer("WORLD_SIZE", 1, 1)
    rank = integer("RANK", 0, 0)
    local_rank = integer("LOCAL_RANK", 0, 0)
    local_world = integer("LOCAL_WORLD_SIZE", world, 1)
    if rank >= world:
        raise ConfigError(f"env var RANK={rank} must be below WORLD_SIZE={world} ({LAUNCH_HINT})")
    if world > 1 and not _world_exists():  # the process group is built from these (tpframe.parallel.state)
        missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not env.get(k, "").strip()]
        if missing:
            raise ConfigError(
                f"env var WORLD_SIZE={world} needs {', '.join(missing)} set too (the processes of a "
                f"world find each other through them; {LAUNCH_HINT}, which sets them)"
            )
    raw_port = env.get("MASTER_PORT")
    if raw_port is not None and "RANK" in env:  # without RANK, single_process_env picks a port of its own
        try:
            port = int(raw_port)
        except ValueError:
            port = -1
        if not 1 <= port <= 65535:
            raise ConfigError(
                f"env var MASTER_PORT={raw_port!r} must be a TCP port, an integer in 1..65535 ({LAUNCH_HINT})"
            )
    return LaunchEnv(world, rank, local_rank, local_world)


def restart_attempt() -> int:
    """Which start of this run's workers this is: 0 the first, > 0 a restart by tpframe.launch (or torchrun's
    --max-restarts), which resumes from the run's latest checkpoint."""
    from tpframe.errors import env_int

    return max(env_int("TPFRAME_ATTEMPT", 0, 0), env_int("TORCHELASTIC_RESTART_COUNT", 0, 0))


def single_process_env() -> None:
    """Let `python train.py` (or generate.py) run without a launcher: the env of a world of one process. A
    launched process keeps its env (checked by `launch_env`); a world of one given in part gets the rest."""
    launched = "RANK" in os.environ
    if launched and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return
    env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    if not launched or "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            env["MASTER_PORT"] = str(s.getsockname()[1])
    for key, value in env.items():
        if not launched or key not in os.environ:
            os.environ[key] = value


class LaunchError(Exception):
    """A mistake in the launcher's own arguments."""


def _count_range(option: str, raw: str) -> range:
    """`N` or `MIN:MAX` (both at least 1) as a range."""
    low, colon, high = raw.partition(":")
    try:
        counts = range(int(low), int(high if colon else low) + 1)
    except ValueError:
        counts = range(0)
    if not counts or counts.start < 1:
        raise LaunchError(f"{option}={raw} must be a count N or a range MIN:MAX of counts of at least 1")
    return counts


def _check_endpoint(raw: str) -> None:
    """--rdzv-endpoint is HOST:PORT (c10d reads a missing port as 29400): refused here, not after the pre-flight."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    try:
        port = parse_rendezvous_endpoint(raw, default_port=29400)[1]
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise LaunchError(
            f"--rdzv-endpoint={raw} must be HOST:PORT: node 0's host name or address and a TCP port in 1..65535 "
            "(an IPv6 address in brackets: [::1]:29500)"
        )


def parse_args(argv: list[str]) -> argparse.Namespace:
    from tpframe.errors import ArgumentParser  # refuses an option given twice
    from tpframe.paths import not_a_file

    parser = ArgumentParser(
        prog="python -m tpframe.launch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--nproc-per-node", "--nproc_per_node", default="1", help="workers on this node (one per GPU), or MIN:MAX")
    add("--nnodes", default="1", help="nodes, or MIN:MAX (elastic); every node runs this launcher")
    add("--node-rank", "--node_rank", type=int, default=0, help="this node's number; node 0 hosts the rendezvous")
    add("--rdzv-endpoint", "--rdzv_endpoint", default="", help="HOST:PORT of node 0, where the nodes meet")
    add("--max-restarts", "--max_restarts", type=int, default=0, help="start failed workers again, K times")
    add("--no-check", action="store_true", help="skip the parent's pre-flight check")
    add("script", help="the script: train.py, or generate.py")
    add("script_args", nargs=argparse.REMAINDER, help="its arguments")
    parser.error = lambda message: (_ for _ in ()).throw(LaunchError(message))  # one line, not usage + error
    args = parser.parse_args(argv)
    args.procs = _count_range("--nproc-per-node", args.nproc_per_node)
    args.nodes = _count_range("--nnodes", args.nnodes)
    if len(args.procs) > 1 and len(args.nodes) > 1:
        raise LaunchError("give a range MIN:MAX to --nproc-per-node or to --nnodes, not to both")
    if len(args.procs) > 1 and args.nodes.stop > 2:
        raise LaunchError(f"--nproc-per-node={args.nproc_per_node} is for one node; across nodes give --nnodes MIN:MAX")
    if (len(args.procs) > 1 or len(args.nodes) > 1) and args.max_restarts < 1:
        raise LaunchError("an elastic run changes its world only at a restart: give --max-restarts K (K >= 1)")
    if args.max_restarts < 0:
        raise LaunchError(f"--max-restarts={args.max_restarts} must be at least 0")
    if not 0 <= args.node_rank < args.nodes[-1]:
        raise LaunchError(f"--node-rank={args.node_rank} must be in 0..{args.nodes[-1] - 1} (--nnodes={args.nnodes})")
    if args.nodes[-1] > 1 and not args.rdzv_endpoint:
        raise LaunchError("several nodes meet at node 0: give --rdzv-endpoint HOST:PORT (the same on every node)")
    if args.rdzv_endpoint:
        _check_endpoint(args.rdzv_endpoint)
    if why := not_a_file(args.script):
        raise LaunchError(f"training script {args.script!r} {why}")
    return args


def _defines_prepare(path: Path) -> bool:
    """Whether the script defines a top-level `prepare` (read, not run: other scripts may act on import)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return False
    return any(isinstance(node, ast.FunctionDef) and node.name == "prepare" for node in tree.body)


def _script_prepare(script: str):
    """The script's own pre-flight (train.py's or generate.py's `prepare`), or None."""
    path = Path(script).resolve()
    if not _defines_prepare(path):
        return None
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location("_tpframe_launched_script", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass in the script (generate.py's Plan) looks its module up there
    spec.loader.exec_module(module)  # train.py and generate.py only define functions when not __main__
    return getattr(module, "prepare", None)


def preflight(script: str, script_args: list[str], world_size: int, rank: int = 0):
    """The script's own pre-flight for the whole world, when it has one; what it returns (train.py: the config)."""
    prepare = _script_prepare(script)
    if prepare is None:
        return None
    accepted = inspect.signature(prepare).parameters  # train.py's takes all three, generate.py's world_size
    options = dict(world_size=world_size, rank=rank, device_check=False)
    return prepare(script_args, **{k: v for k, v in options.items() if k in accepted})


def check_worlds(args) -> tuple[list[int], Path | None, int | None]:
    """The pre-flight at every world the launch may run (ConfigError at the largest, or at any node count of
    --nnodes MIN:MAX); returns the worker counts of this node the layout allows, largest first, the run's
    checkpoints folder and the step the workers resume from."""
    from tpframe.errors import ConfigError

    nproc, last = args.procs[-1], args.node_rank > 0  # node 0 checks as rank 0 (it probes the run's lock)
    prepared = preflight(
        args.script, args.script_args, args.nodes[-1] * nproc, args.nodes[-1] * nproc - 1 if last else 0
    )
    cfg = prepared[0] if isinstance(prepared, tuple) and hasattr(prepared[0], "checkpoint") else None
    resume = prepared[-1] if cfg is not None else (None, None)  # train.py's: (checkpoint, its meta) or (None, None)
    if resume[0] is not None:  # its files passed: the checks below and the workers need not read them again
        from tpframe.checkpoint.files import VERIFIED_ENV

        os.environ[VERIFIED_ENV] = str(Path(resume[0]).resolve())
    sizes = [nproc]
    for nodes in reversed(args.nodes[:-1]):  # every node count must train
        try:
            preflight(args.script, args.script_args, nodes * nproc, nodes * nproc - 1 if last else 0)
        except ConfigError as e:
            raise ConfigError(f"at --nnodes {nodes} (world {nodes * nproc}): {e}") from None
    for procs in reversed(args.procs[:-1]):  # the worker counts the layout allows
        try:
            preflight(args.script, args.script_args, procs, 0)
            sizes.append(procs)
        except ConfigError:
            continue
    if cfg is None:
        return sizes, None, None
    from tpframe.checkpoint.files import checkpoint_root

    return sizes, checkpoint_root(cfg), resume[1]["train"]["step"] if resume[1] else None


def main(argv: list[str] | None = None) -> int:
    from tpframe.run.launcher import close_rendezvous, launch

    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except LaunchError as e:
        print(
            f"tpframe.launch: {e} (usage: python -m tpframe.launch --nproc-per-node N train.py ARGS...)",
            file=sys.stderr,
        )
        return 2
    sizes, checkpoints, start = [n for n in reversed(args.procs)], None, None
    from tpframe.errors import ConfigError

    try:
        if not args.no_check:
            sizes, checkpoints, start = check_worlds(args)
        return launch(args, local_sizes=sizes, checkpoints=checkpoints, start=start)
    except ConfigError as e:
        print(f"tpframe: config error: {e}", file=sys.stderr, flush=True)
        if args.nodes[-1] > 1:
            close_rendezvous(args)  # the other nodes stop too, instead of waiting for this one
        return 2
    except KeyboardInterrupt:  # Ctrl-C before the workers start (then torchelastic's handler takes SIGINT)
        print("tpframe.launch: stopped by SIGINT (Ctrl-C) before the workers started", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
