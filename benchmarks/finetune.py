"""LoRA against full fine-tuning: train.py's tokens/s and peak memory per GPU at one layout, same model and data.

    python benchmarks/finetune.py --config configs/sft_llama3_8b_lora.yaml --gpus 4       # Llama-3-8B, TP=4
    python benchmarks/finetune.py --config configs/sft_llama_cpu.yaml --gpus 2 --steps 6  # a CPU smoke test

Writes a random base of the config's model once (--base, a consolidated safetensors file, bf16, std 0.02), then runs
train.py twice through tpframe.launch on the synthetic corpus packed as documents (model.eod_id=10): optim.lora_rank
as the config says, and optim.lora_rank=null (every parameter trained, AdamW state for all). Each run's rate is the
median tokens/s of its steps after the first --warmup; its memory the largest mem_gib (torch's peak allocated on the
rank that logs). Prints one table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def write_base(config: str, path: Path) -> None:
    """A random model of `config`'s model: section as logical tensors (norm weights 1), written once."""
    import torch
    from safetensors.torch import save_file

    from tpframe.models import logical_shapes
    from tpframe.training.config import load_config

    cfg = load_config(config, [])
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in logical_shapes(cfg.model).items():
        norm = "norm" in name and len(shape) == 1
        t = torch.ones(shape) if norm else torch.randn(shape, generator=g) * 0.02
        tensors[name] = t.to(torch.bfloat16)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))


def run(config: str, gpus: int, run_dir: Path, overrides: list[str]) -> dict:
    cmd = [sys.executable, "-m", "tpframe.launch", "--nproc-per-node", str(gpus), str(ROOT / "train.py")]
    cmd += ["--config", config, f"train.run_dir={run_dir}", *overrides]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"rows": [r for r in rows if r.get("kind") == "train"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--base", default="/tmp/finetune_base.safetensors")
    parser.add_argument("--out", default="/tmp/finetune_runs")
    args = parser.parse_args()
    base = Path(args.base)
    if not base.exists():
        write_base(args.config, base)
    common = [
        f"checkpoint.init_from={base}",
        "data.source=synthetic",
        "data.path=null",
        "model.eod_id=10",
        f"train.steps={args.steps}",
        "train.eval_interval=0",
        "checkpoint.save_at_end=false",
        "checkpoint.interval=0",
        "logging.interval=1",
        "logging.progress=false",
    ]
    results = {}
    for label, extra in (("LoRA", []), ("full fine-tuning", ["optim.lora_rank=null"])):
        results[label] = run(args.config, args.gpus, Path(args.out) / label.replace(" ", "_"), common + extra)
    print(f"| {args.config}, {args.gpus} processes | tokens/s | peak memory per GPU (GiB) |")
    print("|---|---|---|")
    for label, r in results.items():
        if "error" in r:
            print(f"| {label} | failed: {r['error']} | |")
            continue
        rate = statistics.median(x["tokens_per_s"] for x in r["rows"][args.warmup :] or r["rows"])
        print(f"| {label} | {rate:,.0f} | {max(x.get('mem_gib', 0.0) for x in r['rows']):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
