"""What the benchmarks that run train.py itself share (finetune.py, snapshot.py, fp8_loss.py): one run through
`tpframe.launch` and its metrics.jsonl, and a table appended to RESULTS.md with the command and device."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
