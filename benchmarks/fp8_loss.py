"""Does training in float8 learn what bf16 learns? Each train.fp8 recipe's loss curve beside bf16's, on real text.

    python benchmarks/fp8_loss.py --config configs/gpt_1.3b.yaml --steps 1000 --set parallel.tp=1 \
        train.seq_len=1024 train.micro_batch_size=4 train.global_batch_size=4 optim.warmup_steps=100  # GPU-only
    python benchmarks/fp8_loss.py --config configs/tiny_cpu.yaml --steps 20 --set parallel.tp=1 \
        train.dtype=bfloat16   # CPU smoke of the script (layers this small stay bf16: fp8_pays)

Runs train.py once in bf16 and once per recipe (tpframe.layers.fp8.RECIPES) on the Python standard library's source
(data.source=stdlib: real text that needs no download, as bytes, vocabulary 256), the same seed and sample order,
and compares with bf16's run: the final training loss (mean of the last tenth of the steps), the held-out loss at
the end, and the largest gap between the two curves (each a running mean over a twentieth of the steps) after the
first tenth. A recipe is within the band when its final training and held-out losses are within --band (1%) of
bf16's. Prints the table and appends it, with the command and device, to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import train_runs

sys.path.insert(0, str(train_runs.ROOT))


def train(args, recipe: str) -> list[dict]:
    overrides = [f"train.steps={args.steps}", "data.source=stdlib", "data.path=null", "model.vocab_size=256"]
    overrides += [f"train.eval_interval={args.steps}", "train.eval_steps=20", "checkpoint.interval=0"]
    overrides += ["checkpoint.save_at_end=false", "logging.interval=1", "logging.progress=false", *args.set]
    overrides.append(f"train.fp8={'false' if recipe == 'bf16' else recipe}")
    done = train_runs.run(args.config, args.gpus, Path(args.out) / recipe, overrides)
    if "error" in done:
        raise SystemExit(f"fp8_loss.py: {recipe}: {done['error']}")
    return done["rows"]


def smooth(losses: list[float], width: int) -> list[float]:
    return [statistics.fmean(losses[max(0, i - width + 1) : i + 1]) for i in range(len(losses))]


def summary(rows: list[dict], steps: int) -> dict:
    losses = [r["loss"] for r in rows if r["kind"] == "train"]
    tail = max(1, steps // 10)
    return dict(
        losses=losses,
        final=statistics.fmean(losses[-tail:]),
        eval=[r["loss"] for r in rows if r["kind"] == "eval"][-1],
        step_ms=statistics.median(r["step_ms"] for r in rows if r["kind"] == "train"),
    )


def table(args, runs: dict[str, dict], device: str) -> str:
    base = runs["bf16"]
    width, skip = max(1, args.steps // 20), max(1, args.steps // 10)
    lines = [
        f"| {args.config} {' '.join(args.set)}, {args.steps} steps, {device} | final train loss | vs bf16 "
        "| held-out loss | vs bf16 | largest gap of the curves | step ms | within the band |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for recipe, run in runs.items():
        gaps = [abs(a / b - 1) for a, b in zip(smooth(run["losses"], width), smooth(base["losses"], width))][skip:]
        final, held = run["final"] / base["final"] - 1, run["eval"] / base["eval"] - 1
        ok = "yes" if max(abs(final), abs(held)) <= args.band else "NO"
        lines.append(
            f"| {recipe} | {run['final']:.4f} | {final:+.2%} | {run['eval']:.4f} | {held:+.2%} "
            f"| {max(gaps, default=0.0):.2%} | {run['step_ms']:,.1f} | {'' if recipe == 'bf16' else ok} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--gpus", type=int, default=1, help="processes (GPUs on a GPU machine)")
    parser.add_argument("--band", type=float, default=0.01, help="largest relative gap of the final losses")
    parser.add_argument("--out", default="/tmp/fp8_loss_runs")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides for every run, KEY=VALUE")
    parser.add_argument("--recipes", nargs="*", default=None, help="some of the recipes (default: every one)")
    args = parser.parse_args()
    from tpframe.layers.fp8 import RECIPES

    device = train_runs.device()
    runs = {recipe: summary(train(args, recipe), args.steps) for recipe in ("bf16", *(args.recipes or RECIPES))}
    train_runs.append_results("train.fp8 loss curves beside bf16", device, table(args, runs, device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
