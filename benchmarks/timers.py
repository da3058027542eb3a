"""What the phase timers cost and how well their phases add up to the step: logging.timers = none / auto / sync.

    torchrun --nproc-per-node 2 benchmarks/timers.py        # env: TP (default: world) STEPS (60) CONFIG, plus
                                                             # any section.key=value arguments for train.py

Each mode trains the same run (configs/gpt_125m.yaml by default: L=12 H=768 S=1024, bf16, TP=2 + SP) for STEPS
steps, logging every 10, in this one process after the others (same data, same seed). For every mode the table
gives the median step time over the logged windows after the first (warm-up) one, its ratio to mode `none` (the
timers' cost), and the phases' sum over the step time (their coverage: what is not in a phase is logging and
the loss's host read-back). Appends the table, the command and the device to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import train  # noqa: E402

PHASES = ("data_ms", "fwd_bwd_ms", "grad_sync_ms", "optim_ms", "ckpt_ms")


def run_mode(mode: str, run_dir: str, steps: int, extra: list[str]) -> list[dict]:
    config = os.environ.get("CONFIG", str(ROOT / "configs" / "gpt_125m.yaml"))
    tp = os.environ.get("TP", os.environ.get("WORLD_SIZE", "1"))
    given = {a.split("=", 1)[0] for a in extra}  # train.py refuses a key given twice: the command line's win
    args = [
        "--config",
        config,
        *(
            a
            for a in [
                f"parallel.tp={tp}",
                f"train.steps={steps}",
                "train.eval_interval=0",
                "logging.interval=10",
                "logging.progress=false",
                "checkpoint.save_at_end=false",
                "checkpoint.auto_resume=false",
                f"train.run_dir={run_dir}/{mode}",
            ]
            if a.split("=", 1)[0] not in given
        ),
        f"logging.timers={mode}",
        *extra,
    ]
    cfg, train_data, valid_data, resume = train.prepare(args)
    train.run(cfg, train_data, valid_data, resume)
    path = Path(run_dir) / mode / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if '"train"' in line] if path.exists() else []


def main() -> None:
    import torch.distributed as dist

    from tpframe.launch import single_process_env

    single_process_env()  # `python benchmarks/timers.py` works too
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # one world for all the runs: train.run's parallel state then leaves it up between them
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    steps = int(os.environ.get("STEPS", 60))
    extra = sys.argv[1:]
    rank = int(os.environ.get("RANK", "0"))
    run_dir = tempfile.mkdtemp(prefix="tpframe_timers_")  # only rank 0 writes metrics; nothing is checkpointed
    rows = {}
    for mode in ("none", "auto", "sync", "none"):  # `none` twice: the run-to-run noise of the baseline
        records = run_mode(mode, run_dir, steps, extra)[1:]  # the first window is one warm-up step
        if rank == 0:
            step = statistics.median(r["step_ms"] for r in records)
            coverage = statistics.median(sum(r.get(p, 0.0) for p in PHASES) / r["step_ms"] for r in records)
            phases = {p: statistics.median(r[p] for r in records) for p in PHASES if p in records[0]}
            rows.setdefault(mode, []).append((step, coverage if phases else None, phases))
    dist.destroy_process_group()
    if rank != 0:
        return
    base = statistics.mean(r[0] for r in rows["none"])
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    header = (
        f"phase timers on {device} x{os.environ.get('WORLD_SIZE', '1')}, {steps} steps per mode, median of the "
        f"10-step windows after the first; `none` ran first and last ({rows['none'][0][0]:.2f} / "
        f"{rows['none'][-1][0]:.2f} ms)"
    )
    lines = [
        header,
        "",
        "| timers | step ms | vs none | phases / step | data | fwd+bwd | grad sync | optim | ckpt (ms) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in ("none", "auto", "sync"):
        step, coverage, phases = rows[mode][0]
        cells = " | ".join(f"{phases[p]:.2f}" if p in phases else "-" for p in PHASES)
        cover = "-" if coverage is None else f"{coverage:.1%}"
        lines.append(f"| {mode} | {step:.2f} | {step / base:.3f}x | {cover} | {cells} |")
    table = "\n".join(lines)
    print(table)
    world = os.environ.get("WORLD_SIZE", "1")
    command = f"torchrun --nproc-per-node {world} benchmarks/timers.py {' '.join(extra)}".strip()
    with open(ROOT / "benchmarks" / "RESULTS.md", "a") as f:
        f.write(f"\n- `{command}` (STEPS={steps}), torch {torch.__version__}:\n\n{table}\n")


if __name__ == "__main__":
    main()
