"""Several nodes: two launchers on this host (python -m tpframe.launch --nnodes 2, one rendezvous on localhost) train
as one node with as many processes and resume; a mistake on either node ends both with one line before anything
is written; a run folder that is not one folder for every node is refused before training writes anything."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.dist_utils import DistributedFailure, run_distributed
from tests.training_utils import REPO, TINY, merge_overrides
from tpframe.observe.logger import read_metrics

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


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _node(n: int, port: int, *args: str, nproc: int = 2) -> subprocess.Popen:
    """Node `n` of two on this host: one launcher with `nproc` workers; node 0 hosts the rendezvous on `port`."""
    cmd = [sys.executable, "-m", "tpframe.launch", "--nnodes=2", f"--node-rank={n}", f"--nproc-per-node={nproc}"]
    return subprocess.Popen(
        [*cmd, f"--rdzv-endpoint=127.0.0.1:{port}", *args],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _two_nodes(*args: str, node1: tuple = (), nproc: int = 2, during=None) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of both nodes; node 1 starts once node 0 hosts the rendezvous; `during(nodes)`
    runs once both are started (what it reads of node 0's stdout is not returned)."""
    port = _free_port()
    first = _node(0, port, *args, nproc=nproc)
    deadline = time.monotonic() + 120
    while first.poll() is None and time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.2)
    nodes = [first, _node(1, port, *args, *node1, nproc=nproc)]
    if during is not None:
        during(nodes)
    outs = [p.communicate(timeout=300) for p in nodes]
    return [(p.returncode, *out) for p, out in zip(nodes, outs)]


@pytest.mark.slow
def test_two_launchers_train_as_one_node_with_as_many_processes_and_resume(tmp_path):
    nodes = _two_nodes(*ARGS, f"train.run_dir={tmp_path}/nodes")
    assert [code for code, _, _ in nodes] == [0, 0], nodes
    assert not nodes[0][2] and not nodes[1][2], "no line on stderr, no warning"
    one = subprocess.run(
        [sys.executable, "-m", "tpframe.launch", "--nproc-per-node", "4", *ARGS, f"train.run_dir={tmp_path}/one"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    assert "world 4 = tp 2 x dp 2" in nodes[0][1] + nodes[1][1]
    assert _losses(tmp_path / "nodes") == _losses(tmp_path / "one")
    saved = sorted(p.name for p in (tmp_path / "nodes" / "checkpoints").iterdir())
    assert saved == sorted(p.name for p in (tmp_path / "one" / "checkpoints").iterdir()) and "step_00000003" in saved
    latest = int((tmp_path / "nodes" / "checkpoints" / "latest").read_text().split("_")[1])
    more = _two_nodes(
        *merge_overrides(ARGS, [f"train.run_dir={tmp_path}/nodes", "train.steps=8", "checkpoint.auto_resume=true"])
    )
    assert [code for code, _, _ in more] == [0, 0], more
    assert f"resumed at step {latest} from" in more[0][1] + more[1][1]
    assert [r["step"] for r in read_metrics(tmp_path / "nodes" / "metrics.jsonl") if r["kind"] == "train"] == list(
        range(1, 9)
    )


def test_a_bad_key_on_one_node_is_one_line_exit_2_on_both_and_nothing_written(tmp_path):
    nodes = _two_nodes(*ARGS, f"train.run_dir={tmp_path}/run", node1=("model.hiden=64",))
    assert [code for code, _, _ in nodes] == [2, 2], nodes
    assert nodes[1][2].splitlines() == [
        "tpframe: config error: unknown config key 'model.hiden' (did you mean 'model.hidden'?)"
    ]
    assert nodes[0][2].splitlines() == [
        "tpframe.launch: the run was refused on another node (its launcher printed why); nothing was started here"
    ]
    assert not (tmp_path / "run").exists()


def test_a_rendezvous_port_in_use_is_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        node = _node(0, port, "--no-check", *ARGS, f"train.run_dir={tmp_path}/run", nproc=1)
        _, err = node.communicate(timeout=120)
    assert node.returncode == 4 and err.splitlines() == [
        f"tpframe.launch: the nodes did not meet at --rdzv-endpoint 127.0.0.1:{port}: The server socket has failed to "
        f"listen on any local network address. port: {port}, useIpv6: false, code: -98, name: EADDRINUSE, message: "
        "address already in use"
    ], err


def _kill_node_0_s_worker_at_step_2(nodes) -> None:
    for line in nodes[0].stdout:
        if line.replace(" ", "").startswith("step2/"):
            worker = Path(f"/proc/{nodes[0].pid}/task/{nodes[0].pid}/children").read_text().split()[0]
            os.kill(int(worker), signal.SIGKILL)
            return


@pytest.mark.slow
def test_a_node_whose_worker_is_killed_ends_the_other_with_its_worker_s_line_not_the_rendezvous(tmp_path):
    """kill -9 of node 0's only worker, no restarts: node 0 names it (exit 1); node 1's worker sees its peer gone and
    prints its own line (exit 4), and node 1's launcher adds nothing, though node 0's store is gone with it."""
    args = merge_overrides(ARGS, ["parallel.tp=1", "train.steps=100000", f"train.run_dir={tmp_path}/run"])
    nodes = _two_nodes(*args, nproc=1, during=_kill_node_0_s_worker_at_step_2)
    assert [code for code, _, _ in nodes] == [1, 4], nodes
    assert nodes[0][2].splitlines()[-1].startswith("tpframe.launch: rank 0 died of signal 9 (SIGKILL)"), nodes[0][2]
    said = [line for line in nodes[1][2].splitlines() if line.startswith("tpframe")]  # beside c10d's C++ warnings
    assert len(said) == 1 and said[0].startswith("tpframe: a collective failed"), said


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
