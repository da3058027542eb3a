"""The launcher: check the config once, start the workers through torch.distributed's launcher API,
forward preemption signals, and exit with the workers' code and no traceback of its own.

    python -m tpframe.launch --nproc-per-node 2 train.py --config configs/tiny_cpu.yaml [section.key=value ...]

1. The parent runs train.py's `prepare` for the whole world (config, env vars, model shapes, memory on
   CPU, data, run directory, checkpoint) before any worker exists: a mistake is one line, exit code 2.
2. Workers start through `torch.distributed.launcher.api.elastic_launch` on one node (what
   `torchrun --standalone` and `accelerate launch` use), with torchelastic's own logging silenced.
3. SIGTERM and SIGUSR1 are forwarded to the workers, which save a checkpoint at the end of the step and
   exit 0; the launcher then exits 0. SIGINT (Ctrl-C) stops them without saving (exit 130).
4. A worker's failure ends the launch with that worker's exit code (2 config, 3 non-finite steps,
   4 a stopped rank or failed collective: tpframe/exits.py); the worker printed the line. Any
   other failure adds one line naming the rank and its exit code.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import inspect
import logging
import os
import signal
import socket
import sys
import uuid
from pathlib import Path
from typing import NamedTuple

FORWARDED = (signal.SIGTERM, signal.SIGUSR1)
TPFRAME_CODES = {
    2: "config error",
    3: "training stopped on non-finite steps",
    4: "a rank stopped responding",
    5: "checkpoint not saved",
    6: "out of memory",
}


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


def parse_args(argv: list[str]) -> argparse.Namespace:
    from tpframe.errors import ArgumentParser  # refuses an option given twice
    from tpframe.paths import not_a_file

    parser = ArgumentParser(
        prog="python -m tpframe.launch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--nproc-per-node", "--nproc_per_node", type=int, default=1, help="worker processes on this node (one per GPU)"
    )
    parser.add_argument("--no-check", action="store_true", help="skip the parent's pre-flight check")
    parser.add_argument("script", help="the script: train.py, or generate.py")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    parser.error = lambda message: (_ for _ in ()).throw(LaunchError(message))  # one line, not usage + error
    args = parser.parse_args(argv)
    if args.nproc_per_node < 1:
        raise LaunchError(f"--nproc-per-node={args.nproc_per_node} must be at least 1")
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


def preflight(script: str, script_args: list[str], world_size: int) -> None:
    """The script's own pre-flight for the whole world, when it has one (train.py's or generate.py's `prepare`)."""
    path = Path(script).resolve()
    if not _defines_prepare(path):
        return
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location("_tpframe_launched_script", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass in the script (generate.py's Plan) looks its module up there
    spec.loader.exec_module(module)  # train.py and generate.py only define functions when not __main__
    prepare = getattr(module, "prepare", None)
    if prepare is not None:
        accepted = inspect.signature(prepare).parameters  # train.py's takes all three, generate.py's world_size
        options = dict(world_size=world_size, rank=0, device_check=False)
        prepare(script_args, **{k: v for k, v in options.items() if k in accepted})


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
    """torchelastic logs worker deaths and restarts at WARNING; the workers' own lines say it better."""
    if os.environ.get("LOGLEVEL"):
        return
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic") or name.startswith("torch.distributed.launcher"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def launch(args: argparse.Namespace) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _quiet_torchelastic()

    def forward(signum, frame) -> None:
        for pid in _children():
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        print(
            f"tpframe.launch: {signal.Signals(signum).name} forwarded to the workers: they save a checkpoint and stop",
            file=sys.stderr,
            flush=True,
        )

    for sig in FORWARDED:
        signal.signal(sig, forward)
    if args.nproc_per_node > 1:  # as torchrun does: N processes each with every core's threads would thrash
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=args.nproc_per_node,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        signals_to_handle="SIGINT,SIGHUP,SIGQUIT",  # SIGTERM/SIGUSR1: forwarded above
    )
    try:
        elastic_launch(config, sys.executable)("-u", args.script, *args.script_args)
    except ChildFailedError as e:
        rank, first = e.get_first_failure()
        ours = sorted((f.timestamp, f.exitcode) for f in e.failures.values() if f.exitcode in TPFRAME_CODES)
        if ours:  # a worker printed its one line; the others' deaths (killed once it failed) are echoes
            return ours[0][1]
        code = first.exitcode
        what = f"signal {-code} ({first.signal_name()})" if code < 0 else f"exit code {code}"
        print(f"tpframe.launch: rank {rank} failed with {what}; its output is above", file=sys.stderr, flush=True)
        return 1
    except SignalException as e:
        print(f"tpframe.launch: stopped by {signal.Signals(e.sigval).name}", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except LaunchError as e:
        print(
            f"tpframe.launch: {e} (usage: python -m tpframe.launch --nproc-per-node N train.py ARGS...)",
            file=sys.stderr,
        )
        return 2
    if not args.no_check:
        from tpframe.errors import ConfigError

        try:
            preflight(args.script, args.script_args, args.nproc_per_node)
        except ConfigError as e:
            print(f"tpframe: config error: {e}", file=sys.stderr)
            return 2
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
