"""What saving costs a step: a checkpoint on disk against a snapshot in host memory (checkpoint.snapshot_interval).

    python benchmarks/snapshot.py --config configs/gpt_125m.yaml --gpus 1   # GPU-only: minutes a step on a CPU
    python benchmarks/snapshot.py --config configs/tiny_cpu.yaml --gpus 2 --steps 6 --warmup 1 --set parallel.tp=1 \
        model.hidden=512 model.layers=8 model.heads=8 train.micro_batch_size=8   # CPU, about two minutes

Runs train.py three times through `tpframe.launch --max-restarts 1` on synthetic data: saving nothing, a disk
checkpoint after every step (checkpoint.interval=1: DCP's files fsynced into the run directory), and a snapshot after
every step (checkpoint.snapshot_interval=1: the same files in /dev/shm). Each row: the median step time and the median
time of the save (`ckpt_ms`) over the steps after --warmup; the header gives a disk checkpoint's size (a snapshot
holds each rank's own pieces: with ddp, every rank's copy of the replicated state).
A restart loses at most the steps since the last save, so a save that costs less can be made more often. Prints the
table and appends it, with the command and device, to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODES = {
    "no saves": ["checkpoint.interval=0"],
    "disk checkpoint every step": ["checkpoint.interval=1", "checkpoint.keep_last=2"],
    "snapshot in host memory every step": ["checkpoint.interval=0", "checkpoint.snapshot_interval=1"],
}


def run(args, run_dir: Path, extra: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "tpframe.launch", "--nproc-per-node", str(args.gpus), "--max-restarts", "1"]
    cmd += [str(ROOT / "train.py"), "--config", args.config, f"train.run_dir={run_dir}", f"train.steps={args.steps}"]
    cmd += ["data.source=synthetic", "data.path=null", "train.eval_interval=0", "checkpoint.save_at_end=false"]
    cmd += ["logging.interval=1", "logging.progress=false", *args.set, *extra]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"snapshot.py: {' '.join(extra)}: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind") == "train"][args.warmup :]


def size_gib(run_dir: Path) -> float:
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    return sum(f.stat().st_size for f in latest.iterdir()) / 2**30


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--gpus", type=int, default=1, help="processes (GPUs on a GPU machine)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default="/tmp/snapshot_runs")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides for every run, KEY=VALUE")
    args = parser.parse_args()
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    runs = {label: run(args, Path(args.out) / str(i), extra) for i, (label, extra) in enumerate(MODES.items())}
    gib = size_gib(Path(args.out) / "1")
    lines = [
        f"| {args.config} {' '.join(args.set)}, {args.gpus} processes, {device}, a checkpoint {gib:.2f} GiB | "
        "step ms | save ms |",
        "|---|---|---|",
    ]
    for label, rows in runs.items():
        step = statistics.median(r["step_ms"] for r in rows)
        save = statistics.median(r.get("ckpt_ms", 0.0) for r in rows)
        lines.append(f"| {label} | {step:,.0f} | {save:,.0f} |")
    table = "\n".join(lines)
    print(table)
    with open(ROOT / "benchmarks" / "RESULTS.md", "a") as f:
        command = "python benchmarks/snapshot.py " + " ".join(sys.argv[1:])
        f.write(f"\n### Disk checkpoint vs host-memory snapshot, {device}, {time.strftime('%Y-%m-%d')}\n")
        f.write(f"`{command}`\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
