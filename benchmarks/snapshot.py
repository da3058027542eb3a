"""What saving costs a step: a checkpoint on disk against a snapshot in host memory (checkpoint.snapshot_interval).

    python benchmarks/snapshot.py --config configs/gpt_125m.yaml --gpus 1   # GPU-only: minutes a step on a CPU
    python benchmarks/snapshot.py --config configs/tiny_cpu.yaml --gpus 2 --steps 6 --warmup 1 --set parallel.tp=1 \
        model.hidden=512 model.layers=8 model.heads=8 train.micro_batch_size=8   # CPU, about two minutes

Runs train.py four times through `tpframe.launch --max-restarts 1` on synthetic data: saving nothing, a disk
checkpoint after every step (checkpoint.interval=1: DCP's files fsynced into the run directory), the same written by a
background thread (checkpoint.async_save: the step waits only for the copy to host memory), and a snapshot after
every step (checkpoint.snapshot_interval=1: the same files in /dev/shm). Each row: the median step time and the median
time of the save (`ckpt_ms`) over the steps after --warmup; the header gives a disk checkpoint's size (a snapshot
holds each rank's own pieces: with ddp, every rank's copy of the replicated state).
A restart loses at most the steps since the last save, so a save that costs less can be made more often. Prints the
table and appends it, with the command and device, to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from train_runs import append_results, device, run

MODES = {
    "no saves": ["checkpoint.interval=0"],
    "disk checkpoint every step": ["checkpoint.interval=1", "checkpoint.keep_last=2"],
    "disk checkpoint every step, written in the background": [
        "checkpoint.interval=1",
        "checkpoint.keep_last=2",
        "checkpoint.async_save=true",
    ],
    "snapshot in host memory every step": ["checkpoint.interval=0", "checkpoint.snapshot_interval=1"],
}


def timed(args, run_dir: Path, extra: list[str]) -> list[dict]:
    overrides = [f"train.steps={args.steps}", "data.source=synthetic", "data.path=null", "train.eval_interval=0"]
    overrides += ["checkpoint.save_at_end=false", "logging.interval=1", "logging.progress=false", *args.set, *extra]
    done = run(args.config, args.gpus, run_dir, overrides, launcher=("--max-restarts", "1"))
    if "error" in done:
        raise SystemExit(f"snapshot.py: {' '.join(extra)}: {done['error']}")
    return [r for r in done["rows"] if r.get("kind") == "train"][args.warmup :]


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
    machine = device()
    runs = {label: timed(args, Path(args.out) / str(i), extra) for i, (label, extra) in enumerate(MODES.items())}
    gib = size_gib(Path(args.out) / "1")
    lines = [
        f"| {args.config} {' '.join(args.set)}, {args.gpus} processes, {machine}, a checkpoint {gib:.2f} GiB | "
        "step ms | save ms |",
        "|---|---|---|",
    ]
    for label, rows in runs.items():
        step = statistics.median(r["step_ms"] for r in rows)
        save = statistics.median(r.get("ckpt_ms", 0.0) for r in rows)
        lines.append(f"| {label} | {step:,.0f} | {save:,.0f} |")
    append_results("Disk checkpoint vs host-memory snapshot", machine, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
