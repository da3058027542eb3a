"""Runs that survive: python -m tpframe.launch --max-restarts K starts killed workers again from the latest
checkpoint, to the losses of the run nobody killed; --nproc-per-node MIN:MAX continues on fewer workers with the
same global sample order and grows back; a dead rank is named in one line; a mistake is never retried.

Every drill runs tests/record_samples.py (train.py recording each training sample it reads) on 4 CPU workers,
DP=4: 16 steps of a global batch of 24 (3 micro-batches of 2 per rank), a checkpoint every 4 steps."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.training_utils import REPO, TINY, merge_overrides

STEPS, BATCH, INTERVAL = 16, 24, 4
ARGS = merge_overrides(
    ["tests/record_samples.py", "--config", "configs/tiny_cpu.yaml"],
    TINY,
    [
        "parallel.tp=1",
        "train.micro_batch_size=2",
        f"train.global_batch_size={BATCH}",
        f"train.steps={STEPS}",
        f"checkpoint.interval={INTERVAL}",
        "comm.timeout_s=30",
    ],
)


def _launch(tmp_path: Path, *options: str, extra=()) -> subprocess.Popen:
    samples = tmp_path / "samples"
    samples.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TPFRAME_TEST_SAMPLES=str(samples))
    args = merge_overrides(ARGS, [f"train.run_dir={tmp_path}/run"], list(extra))  # a test's extra replaces a default
    cmd = [sys.executable, "-m", "tpframe.launch", *options, *args]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _worker(launcher_pid: int, local_rank: int) -> int:
    for task in Path(f"/proc/{launcher_pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if f"LOCAL_RANK={local_rank}".encode() in env:
                return int(pid)
    raise AssertionError(f"no worker of local rank {local_rank}")


def _run(proc: subprocess.Popen, *, kill_at: int | None = None, local_rank: int = 0, timeout=240) -> list[str]:
    """The launch's output lines; with `kill_at`, kill -9 the worker of `local_rank` once step `kill_at` shows."""
    lines, deadline = [], time.monotonic() + timeout
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if kill_at is not None and lines[-1].replace(" ", "").startswith(f"step{kill_at}/"):
                os.kill(_worker(proc.pid, local_rank), signal.SIGKILL)
                kill_at = None
            assert time.monotonic() < deadline, "\n".join(lines[-30:])
        proc.wait(timeout=30)
    finally:
        proc.kill()
    return lines


def _samples(tmp_path: Path) -> dict[int, list[tuple[int, int]]]:
    """attempt -> [(position, window)] of every training sample read, sorted by position."""
    out: dict[int, list[tuple[int, int]]] = {}
    for f in (tmp_path / "samples").iterdir():
        for line in f.read_text().splitlines():
            attempt, position, window = map(int, line.split())
            out.setdefault(attempt, []).append((position, window))
    return {a: sorted(v) for a, v in sorted(out.items())}


def _attempts(tmp_path: Path) -> list[dict[int, float]]:
    """step -> loss of each start of the workers, from metrics.jsonl (each start writes a "start" record)."""
    out: list[dict[int, float]] = []
    for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") == "start":
            out.append({})
        elif "loss" in record:
            out[-1][record["step"]] = record["loss"]
    return out


def _check_order(samples: dict, resumed: list[int]) -> None:
    """Each start of the workers reads the global order from its checkpoint's step on, each position once, and
    the positions the finished run kept are every sample of its 16 steps, in order."""
    kept: dict[int, int] = {}
    for attempt, read in samples.items():
        start, positions = resumed[attempt] * BATCH, [p for p, _ in read]
        done = [p for p in positions if p < positions[-1] // BATCH * BATCH]  # a killed attempt: its whole steps
        assert done == list(range(start, start + len(done))) and len(set(positions)) == len(positions), attempt
        kept = {p: w for p, w in kept.items() if p < start} | dict(read)
    assert list(kept) == list(range(STEPS * BATCH)), "no sample skipped or seen twice"


def _said(lines: list[str]) -> tuple[list[str], int]:
    """The launcher's lines, and the last step the first start of the workers logged."""
    said = [line for line in lines if line.startswith("tpframe.launch:")]
    steps = [int(line.split("/")[0].split()[1]) for line in lines[: lines.index(said[0])] if line.startswith("step")]
    return said, max(steps)


def _killed_rank_1_restarts_once(tmp_path: Path, extra: list[str], options=()) -> tuple[int, int]:
    """2 workers, kill -9 of rank 1 at step 6, --max-restarts 1: the run finishes with one launcher line naming the
    restart; (the last step the first start logged, the step the restart resumed from)."""
    proc = _launch(tmp_path, "--nproc-per-node=2", "--max-restarts=1", *options, extra=extra)
    lines = _run(proc, kill_at=6, local_rank=1)
    assert proc.returncode == 0, lines[-30:]
    said, died = _said(lines)
    m = re.fullmatch(r"tpframe\.launch: rank 1 died of signal 9 \(SIGKILL\).*; restart 1 of 1 from step (\d+)", said[0])
    assert len(said) == 1 and m, said
    return died, int(m[1])


@pytest.mark.slow
def test_kill_9_of_rank_0_of_4_workers_restarts_from_the_checkpoint_bit_for_bit(tmp_path):
    """Rank 0 is named in one line; the restarted workers retrace the steps the killed run made after that
    checkpoint to the bit, lose at most one checkpoint interval, and no surviving rank prints a line of its own."""
    proc = _launch(tmp_path, "--nproc-per-node=4", "--max-restarts=2")
    lines = _run(proc, kill_at=6, local_rank=0)
    assert proc.returncode == 0, lines[-30:]
    said, died = _said(lines)
    assert len(said) == 1, said
    m = re.fullmatch(
        r"tpframe\.launch: rank 0 died of signal 9 \(SIGKILL\), last seen at step \d+ \(\w+\); "
        r"restart 1 of 2 from step (\d+)",
        said[0],
    )
    assert m, said[0]
    resumed = int(m[1])
    assert resumed % INTERVAL == 0 and 0 < died - resumed <= INTERVAL, "lost at most one checkpoint interval"
    assert not any(line.startswith("tpframe: a collective failed") for line in lines), "the survivors say nothing"
    first, again = _attempts(tmp_path)
    assert list(again) == list(range(resumed + 1, STEPS + 1))
    assert {s: again[s] for s in first if s > resumed} == {s: first[s] for s in first if s > resumed}
    _check_order(_samples(tmp_path), [0, resumed])


@pytest.mark.slow
def test_elastic_run_continues_on_3_workers_with_the_same_samples_and_grows_back_to_4(tmp_path):
    """Worker 3 is killed: the run goes on at DP=3 (4 micro-batches per rank in place of 3, the same 24 samples a
    step), retraces the lost steps to 1e-5 of the DP=4 losses, and once it has saved at DP=3 grows back."""
    proc = _launch(tmp_path, "--nproc-per-node=3:4", "--max-restarts=2")
    lines = _run(proc, kill_at=6, local_rank=3)
    assert proc.returncode == 0, lines[-30:]
    said, died = _said(lines)
    assert len(said) == 2, said
    shrink = re.fullmatch(r"tpframe\.launch: rank 3 died of .*; restart 1 of 2 from step (\d+); world 4 -> 3", said[0])
    grow = re.fullmatch(r"tpframe\.launch: .*; restart from step (\d+); world 3 -> 4", said[1])
    assert shrink and grow, said
    out = "\n".join(lines)
    assert "world 4 -> 3 since the checkpoint: dp 4 -> 3, global batch 24 as before (4 micro-batches per rank)" in out
    assert "world 3 -> 4 since the checkpoint: dp 3 -> 4, global batch 24 as before (3 micro-batches per rank)" in out
    resumed = [0, int(shrink[1]), int(grow[1])]
    assert resumed[2] >= resumed[1] + INTERVAL, "grown back after a checkpoint at the smaller world"
    _check_order(_samples(tmp_path), resumed)
    first, smaller, grown = _attempts(tmp_path)
    assert list(smaller) == list(range(resumed[1] + 1, resumed[2] + 1)) and min(grown) == resumed[2] + 1
    for step in range(resumed[1] + 1, died + 1):
        assert abs(smaller[step] - first[step]) <= 1e-5 * first[step], (step, smaller[step], first[step])


@pytest.mark.slow
def test_a_restart_resumes_from_the_snapshot_in_host_memory_newer_than_the_disk_s(tmp_path):
    """checkpoint.snapshot_interval=1 beside disk checkpoints every 4 steps: kill -9 at step 6 loses at most one
    step, not up to four; the restarted workers retrace the killed run's steps to the bit from the snapshot; the
    disk checkpoints go on as before, and the snapshots' host memory is freed when the launch ends."""
    from tpframe.checkpoint.files import snapshot_root

    died, resumed = _killed_rank_1_restarts_once(tmp_path, ["checkpoint.snapshot_interval=1"])
    assert resumed % INTERVAL and died - resumed <= 1, (resumed, died)  # a snapshot's step, one step lost at most
    first, again = _attempts(tmp_path)
    assert {s: again[s] for s in first if s > resumed} == {s: first[s] for s in first if s > resumed}
    _check_order(_samples(tmp_path), [0, resumed])
    checkpoints = tmp_path / "run" / "checkpoints"
    assert [p.name for p in sorted(checkpoints.glob("step_*"))] == [f"step_{s:08d}" for s in (4, 8, 12)]
    assert not snapshot_root(checkpoints).exists()


@pytest.mark.slow
@pytest.mark.parametrize("options", [(), ("--no-check",)])
def test_the_restart_line_names_the_loaded_checkpoint_the_workers_resume_from(tmp_path, options):
    """checkpoint.load of another run's step 4 and nothing saved yet in this one: the restart resumes from step 4, as
    the line says (--no-check: from what rank 0's checkpointer published, with no pre-flight in the launcher)."""
    source = tmp_path / "source"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    args = merge_overrides(["train.py", *ARGS[1:]], ["train.steps=4", "checkpoint.save_at_end=true"])
    args.append(f"train.run_dir={source}")
    subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, check=True, timeout=120)
    died, resumed = _killed_rank_1_restarts_once(tmp_path, [f"checkpoint.load={source}/checkpoints"], options)
    assert resumed == 4 and died < 2 * INTERVAL, (resumed, died)


def _started(launcher_pid: int) -> bool:
    return any((task / "children").read_text().split() for task in Path(f"/proc/{launcher_pid}/task").iterdir())


@pytest.mark.parametrize("when", ["start-up", pytest.param("restart", marks=pytest.mark.slow)])
def test_sigterm_while_the_workers_start_stops_them_cleanly_and_exits_0(tmp_path, when):
    """SIGTERM to the launcher as its workers start, the first time or after a restart: they stop (the agent signals
    workers spawned after it too; before a step there is nothing to save); none is named dead of it, and the launch
    exits 0."""
    proc = _launch(tmp_path, "--nproc-per-node=2", "--max-restarts=1")
    lines, deadline = [], time.monotonic() + 120
    try:
        for line in proc.stdout if when == "restart" else ():
            lines.append(line.rstrip("\n"))
            if lines[-1].replace(" ", "").startswith("step2/"):
                os.kill(_worker(proc.pid, 1), signal.SIGKILL)
            if lines[-1].startswith("tpframe.launch: rank 1 died of signal 9"):
                break
        while not _started(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        lines += proc.communicate(timeout=120)[0].splitlines()
    finally:
        proc.kill()
    assert proc.returncode == 0 and "signal 15" not in "\n".join(lines) and "Traceback" not in "\n".join(lines), lines
    assert sum(line.startswith("tpframe.launch: SIGTERM forwarded") for line in lines) == 1, lines


def test_a_mistake_the_workers_find_is_not_retried(tmp_path):
    """--no-check: the workers find the mistake (exit 2); a restart would repeat it, so there is none."""
    proc = _launch(tmp_path, "--nproc-per-node=1", "--max-restarts=2", "--no-check", extra=["optim.weight_decay=nan"])
    lines = _run(proc)
    assert proc.returncode == 2 and len(lines) == 1 and "optim.weight_decay=nan" in lines[0], lines


@pytest.mark.gpu(count=2)
def test_nccl_kill_9_of_rank_1_restarts_from_the_checkpoint_bit_for_bit(tmp_path):
    """The same on 2 GPUs (NCCL, DP=2): the restarted workers build fresh NCCL communicators, and retrace the steps
    after the checkpoint to the bit."""
    _, resumed = _killed_rank_1_restarts_once(tmp_path, ["train.global_batch_size=8"])
    first, again = _attempts(tmp_path)
    assert {s: again[s] for s in first if s > resumed} == {s: first[s] for s in first if s > resumed}
