"""Several nodes: train.py under torchrun with two "nodes" on this host trains as one node with as many processes,
and a run folder that is not one folder for every node is refused before training writes anything."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_utils import DistributedFailure, run_distributed
from tests.training_utils import REPO, TINY, merge_overrides

ARGS = [
    "train.py",
    *merge_overrides(
        ["--config", "configs/tiny_cpu.yaml"],
        TINY,
        [
            "parallel.tp=2",
            "train.global_batch_size=16",
            "train.steps=6",
            "train.eval_interval=3",
            "checkpoint.interval=3",
        ],
    ),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(run_dir: Path) -> list:
    return [r.get("loss") for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.mark.slow
def test_two_nodes_train_as_one_node_with_as_many_processes(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    port = _free_port()
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node-rank",
                str(n),
                "--nproc-per-node",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                *ARGS,
                f"train.run_dir={tmp_path}/nodes",
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for n in (0, 1)
    ]
    outs = [p.communicate(timeout=300)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    one = subprocess.run(
        [sys.executable, "-m", "tpframe.launch", "--nproc-per-node", "4", *ARGS, f"train.run_dir={tmp_path}/one"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    assert "world 4 = tp 2 x dp 2" in outs[0]
    assert _losses(tmp_path / "nodes") == _losses(tmp_path / "one")
    saved = sorted(p.name for p in (tmp_path / "nodes" / "checkpoints").iterdir())
    assert saved == sorted(p.name for p in (tmp_path / "one" / "checkpoints").iterdir()) and "step_00000003" in saved


def _check(root: str, shared: bool):
    import torch.distributed as dist

    from tpframe.run.shared_dir import check_shared

    rank = dist.get_rank()
    folder = Path(root) / ("same" if shared else f"node{rank}")  # not shared: each rank its own folder, one path
    folder.mkdir(parents=True, exist_ok=True)
    check_shared([("train.run_dir", folder)], rank=rank, force=True)
    return sorted(p.name for p in folder.iterdir())


def test_a_folder_every_rank_sees_passes_and_the_probe_is_gone(tmp_path):
    assert run_distributed(_check, 2, str(tmp_path), True) == [[], []]


def test_a_folder_that_differs_between_nodes_is_refused_on_every_rank(tmp_path):
    with pytest.raises(DistributedFailure) as e:
        run_distributed(_check, 2, str(tmp_path), False)
    message = str(e.value)
    assert "ConfigError: train.run_dir=" in message and "is not one folder for every node: ranks on" in message
    assert "put the run on a filesystem every node mounts" in message
    assert not list((tmp_path / "node0").iterdir()), "rank 0's probe must be removed"
