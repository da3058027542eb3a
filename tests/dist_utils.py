"""Run a function in N gloo processes: the first failing rank's traceback, a timeout, no hangs.

    results = run_distributed(worker, world_size=4, tp=2)   # worker(tp=2) runs on every rank

`worker` must be a module-level function (it is pickled by reference). Each process gets a
fresh world (a file-based rendezvous, so no port races); `destroy_parallel()` runs after it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

_CTX = None


def _context():
    # forkserver: children fork from a clean server that imported torch once (fast, and no
    # OpenMP state inherited from the test process).
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        # What train.py's run imports too (DCP, dynamo through torch.optim, the trainer): paid once per
        # session here instead of once per rank per spawned test.
        _CTX.set_forkserver_preload(
            [
                "torch",
                "torch.distributed",
                "tpframe.layers",
                "tpframe.parallel",
                "torch._dynamo",
                "torch.distributed.checkpoint",
                "tpframe.optim",
                "tpframe.checkpoint.checkpointer",
                "tpframe.training.trainer",
                "tpframe.data",
            ]
        )
    return _CTX


def _child(
    rank: int, world_size: int, init_file: str, env: dict, backend: str, fn: Callable, args, kwargs, results
) -> None:
    try:
        import gc

        import torch
        import torch.distributed as dist

        gc.freeze()  # what the forkserver preloaded lives for good: each run's full collection skips it (~0.15 s)
        torch.set_num_threads(1)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), **env)
        if backend == "nccl":
            torch.cuda.set_device(rank)  # one GPU per rank, before NCCL picks a device
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        try:
            out = fn(*args, **kwargs)
        finally:
            from tpframe.parallel import destroy_parallel

            destroy_parallel()
            if dist.is_initialized():
                dist.destroy_process_group()
        # Plain pickle bytes: tensors are copied, not shared through fds that die with the child.
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", traceback.format_exc()))


class DistributedFailure(AssertionError):
    pass


# A rank that dies takes its peers' collectives down with it; those errors are echoes, not causes.
_ECHOES = ("Connection closed by peer", "Connection reset by peer", "gloo/transport", "Broken pipe")


def _describe_failure(fn, errors: dict[int, str], results, procs, grace: float = 2.0) -> str:
    """Collect the other ranks' errors for a moment, then name the root cause first."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and len(errors) < len(procs):
        try:
            rank, status, payload = results.get(timeout=0.2)
        except queue.Empty:
            continue
        if status == "error":
            errors[rank] = payload
    order = sorted(errors, key=lambda r: (any(e in errors[r] for e in _ECHOES), r))
    first = order[0]
    text = f"{fn.__name__} failed on rank {first}:\n{errors[first]}"
    if len(order) > 1:
        text += f"\n(ranks {order[1:]} failed too, most likely as a consequence)"
    return text


def each(fn: Callable, items: list) -> list:
    """fn(item) of each of `items` in turn: `run_distributed(each, n, fn, items)` runs several runs of one world size
    in the same processes (a world's start costs more than a tiny run's step)."""
    return [fn(item) for item in items]


def run_distributed(
    fn: Callable,
    world_size: int,
    *args,
    timeout: float = 180.0,
    env: dict[str, str] | None = None,
    backend: str = "gloo",
    **kwargs,
) -> list[Any]:
    """Run fn(*args, **kwargs) on `world_size` ranks of `backend` ("gloo", or "nccl" with rank r on
    cuda:r); return the per-rank results.

    `env` is set in every rank (the children do not see later changes to this process's env).
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"run_distributed backend must be 'gloo' or 'nccl', got {backend!r}")
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_child,
                args=(r, world_size, init_file, env or {}, backend, fn, args, kwargs, results),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        outputs: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(outputs) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(world_size)) - set(outputs))
                    raise TimeoutError(f"{fn.__name__}: ranks {missing} did not finish within {timeout:.0f}s (hang?)")
                try:
                    rank, status, payload = results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outputs]
                    if dead:
                        raise DistributedFailure(
                            f"{fn.__name__}: rank {dead[0]} died with exit code {procs[dead[0]].exitcode}"
                        ) from None
                    continue
                if status == "error":
                    raise DistributedFailure(_describe_failure(fn, {rank: payload}, results, procs))
                outputs[rank] = pickle.loads(payload)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=10)
    return [outputs[r] for r in range(world_size)]
