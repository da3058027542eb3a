"""Every node sees the run's folders: checkpoints and metrics need one filesystem that all nodes share.

On several hosts, global rank 0 writes a probe file into `train.run_dir` (and `checkpoint.dir` when the
checkpoints live elsewhere) and every rank looks for it. A rank that cannot see it sits on a host with a folder of
its own under the same path: each node would write its shards of every checkpoint there, no node would hold a whole
one, and the first resume would fail, days later. The run is refused instead, in one line naming the hosts, before
training writes anything but its lock. On one host there is nothing to check (one collective of host names).

    check_shared([("train.run_dir", cfg.train.run_dir)], rank=state.rank)   # after the process groups exist
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import torch.distributed as dist

from tpframe.errors import ConfigError


def check_shared(dirs: list[tuple[str, str | Path]], *, rank: int, group=None, force: bool = False) -> None:
    """ConfigError on every rank when some rank does not see what rank 0 writes in one of `dirs` ((key, path)
    pairs). A collective of `group` (default: the world). `force`: check on one host too (tests)."""
    world = dist.get_world_size(group)
    host = socket.gethostname()
    hosts: list = [None] * world
    dist.all_gather_object(hosts, host, group=group)
    if len(set(hosts)) == 1 and not force:
        return
    name = [f".tpframe_shared_probe_{host}_{os.getpid()}_{time.time_ns()}" if rank == 0 else None]
    dist.broadcast_object_list(name, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    probes = [Path(path) / name[0] for _, path in dirs]
    failed = None  # rank 0's own write error: raised after the collectives, so no rank waits for a rank gone
    try:
        if rank == 0:
            try:
                for probe in probes:
                    probe.parent.mkdir(parents=True, exist_ok=True)
                    probe.write_text(f"written by rank 0 on {host} to check that every node sees this folder\n")
            except OSError as e:
                failed = e
        dist.barrier(group)
        seen = [probe.is_file() for probe in probes]
        views: list = [None] * world
        dist.all_gather_object(views, seen, group=group)  # every rank has looked
    finally:
        if rank == 0:
            for probe in probes:
                probe.unlink(missing_ok=True)
    dist.barrier(group)  # no rank goes on while a probe is still there
    if failed is not None:
        raise failed
    for i, (key, path) in enumerate(dirs):
        blind = sorted({h for h, v in zip(hosts, views) if not v[i]})
        if blind:
            raise ConfigError(
                f"{key}={str(path)!r} is not one folder for every node: ranks on {', '.join(blind)} do not see what "
                f"rank 0 (on {hosts[0]}) writes there, so checkpoints would be split between the nodes; put the run "
                "on a filesystem every node mounts (NFS, Lustre, ...)"
            )
