"""LoRA against full fine-tuning: train.py's tokens/s and peak memory per GPU at one layout, same model and data.

    python benchmarks/finetune.py --config configs/sft_llama3_8b_lora.yaml --gpus 4       # Llama-3-8B, TP=4
    python benchmarks/finetune.py --config configs/sft_llama_cpu.yaml --gpus 2 --steps 6  # a CPU smoke test
    python benchmarks/finetune.py --config configs/sft_llama3_8b_lora.yaml --gpus 1 --peer \
        --set parallel.tp=1 parallel.sequence_parallel=false                               # one GPU, with the peer

Writes a random base of the config's model once (--base, a consolidated safetensors file, bf16, std 0.02), then runs
train.py twice through tpframe.launch on the synthetic corpus packed as documents (model.eod_id=10): optim.lora_rank
as the config says, and optim.lora_rank=null (every parameter trained, AdamW state for all). Each run's rate is the
median tokens/s of its steps after the first --warmup; its memory the largest mem_gib (torch's peak allocated on the
rank that logs). --peer adds Hugging Face transformers + PEFT on one GPU (the model and step TRL's SFTTrainer runs;
TRL itself adds no GPU work): the same Llama shape at random init, LoRA of the same rank on the same projections,
AdamW on the adapters, SDPA attention, the same micro-batch, sequence length and global batch, random tokens; its
tokens/s per GPU beside ours. Prints one table and appends it to RESULTS.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from train_runs import ROOT, append_results, device, run

sys.path.insert(0, str(ROOT))


def write_base(config: str, path: Path, overrides: list[str]) -> None:
    """A random model of `config`'s model: section (with `overrides`) as logical tensors (norm weights 1)."""
    import torch
    from safetensors.torch import save_file

    from tpframe.models import logical_shapes
    from tpframe.training.config import load_config

    cfg = load_config(config, overrides)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # an 8B model's random numbers: seconds on a GPU
    g = torch.Generator(dev).manual_seed(0)
    tensors = {}
    for name, shape in logical_shapes(cfg.model).items():
        norm = "norm" in name and len(shape) == 1
        t = torch.ones(shape) if norm else torch.randn(shape, generator=g, device=dev) * 0.02
        tensors[name] = t.to(torch.bfloat16).cpu()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))


HF_TARGETS = {
    "qkv": ["q_proj", "k_proj", "v_proj"],
    "proj": ["o_proj"],
    "fc1": ["gate_proj", "up_proj"],
    "fc2": ["down_proj"],
    "gate": ["gate_proj"],
    "up": ["up_proj"],
    "down": ["down_proj"],
    "head": ["lm_head"],
}


def peer(cfg, *, steps: int, warmup: int) -> dict:
    """transformers' LlamaForCausalLM + PEFT LoRA on one GPU, the shape and batch of `cfg` (see the docstring)."""
    import time

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    m, t, o = cfg.model, cfg.train, cfg.optim
    hf = LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden, intermediate_size=m.ffn_hidden, num_hidden_layers=m.layers,
        num_attention_heads=m.heads, num_key_value_heads=m.kv_heads or m.heads, rms_norm_eps=m.norm_eps,
        rope_theta=m.rope_theta, max_position_embeddings=t.seq_len, attn_implementation="sdpa",
    )  # fmt: skip
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(hf)
    targets = sorted({n for key in o.lora_targets for n in HF_TARGETS[key]})
    lora = LoraConfig(r=o.lora_rank, lora_alpha=o.lora_alpha, target_modules=targets, lora_dropout=0.0)
    model = get_peft_model(model, lora)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=o.lr, fused=True)
    micro = t.global_batch_size // t.micro_batch_size
    tokens = t.global_batch_size * t.seq_len
    rates = []
    for step in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(micro):
            ids = torch.randint(0, m.vocab_size, (t.micro_batch_size, t.seq_len), device="cuda")
            (model(input_ids=ids, labels=ids).loss / micro).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step >= warmup:
            rates.append(tokens / (time.perf_counter() - start))
    return {"rate": statistics.median(rates), "mem": torch.cuda.max_memory_allocated() / 2**30}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--base", default="/tmp/finetune_base.safetensors")
    parser.add_argument("--out", default="/tmp/finetune_runs", help="a fresh run folder per call is made in it")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides for both runs, KEY=VALUE")
    parser.add_argument("--peer", action="store_true", help="add transformers + PEFT on one GPU")
    args = parser.parse_args()
    base = Path(args.base)
    if not base.exists():
        write_base(args.config, base, args.set)
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
        *args.set,
    ]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix="call-", dir=args.out))  # another call's runs (another shape) stay apart
    results = {}
    full = [
        "optim.lora_rank=null",
        "optim.lora_alpha=16",
        "optim.lora_targets=[qkv,proj,fc1,fc2]",
    ]  # LoRA keys: default
    for label, extra in (("LoRA", []), ("full fine-tuning", full)):
        results[label] = run(args.config, args.gpus, out / label.replace(" ", "_"), common + extra)
    lines = [f"| {args.config}, {args.gpus} processes | tokens/s | peak memory per GPU (GiB) |", "|---|---|---|"]
    for label, r in results.items():
        if "error" in r:
            lines.append(f"| {label} | failed: {r['error']} | |")
            continue
        rows = [x for x in r["rows"] if x.get("kind") == "train"]
        rate = statistics.median(x["tokens_per_s"] for x in rows[args.warmup :] or rows)
        mem = max(x.get("mem_gib", 0.0) for x in rows)
        lines.append(f"| {label} | {rate:,.0f} ({rate / args.gpus:,.0f} per GPU) | {mem:.1f} |")
    if args.peer:
        from tpframe.training.config import load_config

        r = peer(load_config(args.config, args.set), steps=args.steps, warmup=args.warmup)
        lines.append(f"| transformers + PEFT LoRA, 1 GPU | {r['rate']:,.0f} per GPU | {r['mem']:.1f} |")
    append_results("LoRA against full fine-tuning", device(), "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
