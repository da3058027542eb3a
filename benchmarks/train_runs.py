"""What the benchmarks share: a job run with a timeout that ends all it started (`run_job`: gpt.py, long_context.py,
pipeline.py, documents.py); for those that run train.py itself (finetune.py, snapshot.py, fp8_loss.py), one run
through `tpframe.launch` and its metrics.jsonl, and a table appended to RESULTS.md with the command and device."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STOP_GRACE_S = 30.0  # run_job: how long a timed-out job has to end on SIGTERM


def run_job(cmd: list[str], *, env: dict | None = None, timeout: float | None = None) -> tuple[int | None, str]:
    """`cmd`'s exit code (None: stopped after `timeout` s) and its stdout + stderr. A timed-out job gets SIGTERM
    first and SIGKILL only after STOP_GRACE_S: torchrun passes SIGTERM on to its workers and waits for them, while a
    killed torchrun leaves them running (each in a session of its own) on the GPU the next job is timed on, holding
    the output pipes, so that the wait for its output hangs too."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out + err
    except subprocess.TimeoutExpired:
        pass
    for stop in (proc.terminate, proc.kill):
        stop()
        try:
            out, err = proc.communicate(timeout=STOP_GRACE_S)
            return None, out + err
        except subprocess.TimeoutExpired as e:
            partial = e
    return None, _text(partial.stdout) + _text(partial.stderr)  # a pipe still held open by a stray process


def _text(b: bytes | str | None) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else b or ""


def run(config: str, gpus: int, run_dir: Path, overrides: list[str], *, launcher: tuple[str, ...] = ()) -> dict:
    """train.py on `gpus` processes (`launcher`: tpframe.launch's own flags): {"rows": every metrics.jsonl record},
    or {"error": the run's last line of stderr}."""
    cmd = [sys.executable, "-m", "tpframe.launch", "--nproc-per-node", str(gpus), *launcher, str(ROOT / "train.py")]
    cmd += ["--config", config, f"train.run_dir={run_dir}", *overrides]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    return {"rows": [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]}


def device() -> str:
    """This machine's GPU by name ("CPU" without one): the device column of the tables and RESULTS.md."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"


def append_results(title: str, device: str, table: str) -> None:
    """Print `table` and append it to RESULTS.md under `title`, with the command that made it and the device."""
    print(table)
    command = f"python benchmarks/{Path(sys.argv[0]).name} " + " ".join(sys.argv[1:])
    with open(ROOT / "benchmarks" / "RESULTS.md", "a") as f:
        f.write(f"\n### {title}, {device}, {time.strftime('%Y-%m-%d')}\n`{command}`\n\n{table}\n")
