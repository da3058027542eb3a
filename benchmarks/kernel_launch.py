"""Host time of tpframe's Triton kernels: Triton's own JIT call against tpframe.kernels.launch's direct path. One GPU.

    python benchmarks/kernel_launch.py [--iters 200] [--rounds 20] [--model-steps 10] [--results FILE]

Per kernel: host microseconds per launch on tiny tensors (the GPU never limits), the fastest of `rounds` rounds of
`iters` back-to-back calls, each round after a device sync; the two paths interleaved round by round. Then the
whole model where the host limits: the GPT-1.3B shape (L=24 H=2048 16 heads, rotary, LayerNorm, GELU, V=50304,
bf16) at micro-batch 1 x 2048 tokens, forward+backward step time (median of `model-steps` after 3 warm-up), with
every kernel on each path; the same model in one CUDA graph gives the GPU-bound floor. FLOPs per step:
72*L*H^2*T + 12*L*H*S*T + 6*H*V*T with T = 2048. Appends the tables to RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

for _key, _value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(_key, _value)

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tpframe.kernels import cross_entropy, norm, rotary  # noqa: E402
from tpframe.kernels.launch import FastKernel  # noqa: E402


def all_kernels() -> list[FastKernel]:
    from tpframe.kernels import decode_attention

    return [k for m in (norm, rotary, cross_entropy, decode_attention) for k in vars(m).values() if isinstance(k, FastKernel)]


def set_direct(on: bool) -> None:
    for k in all_kernels():
        k.fast = on


def probes() -> dict:
    d = torch.device("cuda")
    x = torch.randn(8, 256, device=d, dtype=torch.bfloat16)
    w, b = torch.ones(256, device=d, dtype=torch.bfloat16), torch.zeros(256, device=d, dtype=torch.bfloat16)
    from tpframe.layers.attention import RotaryEmbedding

    cos, sin = RotaryEmbedding(64, 64).to(d)(16, torch.bfloat16)
    qkv = torch.randn(16, 1, 3 * 2 * 64, device=d, dtype=torch.bfloat16)
    logits = torch.randn(16, 512, device=d, dtype=torch.bfloat16)
    target = torch.randint(0, 512, (16,), device=d)
    return {
        "LayerNorm forward (tpframe/kernels/norm.py)": lambda: norm._Norm.apply(x, w, b, 1e-5, False),
        "qkv rotary forward (tpframe/kernels/rotary.py)": lambda: rotary._rotary_fwd(qkv, cos, sin, 2, 2, 64),
        "cross-entropy row statistics (tpframe/kernels/cross_entropy.py)":
            lambda: cross_entropy.row_stats(logits, target, 512),
    }


def per_call(fn, iters: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / iters * 1e6


def model_steps(steps: int) -> dict:
    from tpframe.models import BuildContext, build_model
    from tpframe.models.config import ModelConfig
    from tpframe.parallel import initialize_parallel, seed_parallel_rng

    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29561", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(k, v)
    state = initialize_parallel(tp=1)
    S, H, L = 2048, 2048, 24
    cfg = ModelConfig(vocab_size=50304, hidden=H, layers=L, heads=16, max_seq_len=S, position="rotary",
                      vocab_multiple=128)
    model = build_model(cfg, BuildContext(state.tp_comm, rng_tracker=seed_parallel_rng(1234), dtype=torch.bfloat16,
                                          device=state.device, seed=1234))
    tokens = torch.randint(0, 50304, (1, S + 1), device=state.device)
    inp, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step():
        model(inp, labels).mean().backward()
        for p in model.parameters():
            p.grad = None

    def timed(fn):
        for _ in range(3):
            fn()
        times = []
        for _ in range(steps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e3

    out = {}
    for label, direct in (("Triton's call", False), ("direct", True), ("Triton's call, again", False),
                          ("direct, again", True)):
        set_direct(direct)
        out[label] = timed(step)
    from tpframe.inference.graph import CapturedStep

    def fwd_bwd():
        for p in model.parameters():
            p.grad = None
        model(inp, labels).mean().backward()

    out["one CUDA graph (the GPU-bound floor)"] = timed(CapturedStep(fwd_bwd))
    flops = 72 * L * H * H * S + 12 * L * H * S * S + 6 * H * 50304 * S
    return {k: (ms, flops / ms / 1e9) for k, ms in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--model-steps", type=int, default=10, help="0: skip the whole-model rows")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"), help="'' to print only")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/kernel_launch.py times GPU kernel launches: run it on a CUDA machine", file=sys.stderr)
        raise SystemExit(2)
    torch.cuda.set_device(0)
    best = {}
    calls = probes()
    with torch.no_grad():
        for name, fn in calls.items():  # compile every variant first, on Triton's call
            fn()
        for _ in range(args.rounds):
            for direct in (False, True):
                set_direct(direct)
                for name, fn in calls.items():
                    us = per_call(fn, args.iters)
                    best[(name, direct)] = min(us, best.get((name, direct), float("inf")))
    set_direct(True)
    device, now = torch.cuda.get_device_name(), datetime.date.today().isoformat()
    lines = [f"\n## Triton kernel launches: Triton's JIT call vs tpframe's direct path, 1x {device}, {now}\n",
             f"Command: `python benchmarks/kernel_launch.py --iters {args.iters} --rounds {args.rounds} "
             f"--model-steps {args.model_steps}`, torch {torch.__version__}. Host microseconds per launch, "
             "tiny tensors, fastest round.\n",
             "| kernel | Triton's call us | direct us | saved us |", "|---|---|---|---|"]
    for name in calls:
        a, b = best[(name, False)], best[(name, True)]
        lines.append(f"| {name} | {a:.1f} | {b:.1f} | {a - b:.1f} |")
    if args.model_steps:
        rows = model_steps(args.model_steps)
        lines += ["", "GPT-1.3B shape, TP=1, micro-batch 1 x 2048 tokens, bf16, forward+backward (median step):", "",
                  "| kernels launched by | step ms | TFLOP/s |", "|---|---|---|"]
        lines += [f"| {k} | {ms:.1f} | {tf:.0f} |" for k, (ms, tf) in rows.items()]
    table = "\n".join(lines)
    print(table, flush=True)
    if args.results:
        with open(args.results, "a") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
