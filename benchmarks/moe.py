"""Mixture-of-experts layer, forward+backward on one GPU: tpframe's MoE (tpframe/layers/moe.py) against plain-torch
peers on the same weights and tokens.

    python benchmarks/moe.py [--results benchmarks/RESULTS.md] [--no-append] [--iters 20]

Runs, each on x [T, h] bf16 random tokens with a random upstream gradient, SwiGLU experts without biases, top-k of
E with the weights renormalized (Mixtral's router):
  dense MLP, k*F wide  the same active FLOPs in two plain GEMMs: the ceiling a MoE layer approaches
  tpframe MoE          sort by expert, one GEMM pair per expert, weighted index_add (eager; TP=1, no EP)
  loop peer            Hugging Face Mixtral's loop: per expert, the rows that chose it (a mask), its MLP, index_add
  grouped_mm peer      torchtitan's route: tokens sorted by expert, torch._grouped_mm over stacked [E, ...] weights
Timed eagerly (the router sizes the GEMMs on the host): median of --iters after 3 warm-up calls, CUDA events.
FLOPs per call = 18 * T * k * h * F (forward 6 h F per token and chosen expert, backward twice that); router excluded.
'max rel err' = the largest |out - tpframe's out| / max|tpframe's out| over the peers' outputs (bf16).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from comm import report  # noqa: E402
from cp_attention import timed  # noqa: E402

# (name, T tokens, h, F per expert, E experts, k)
CASES = (
    ("Mixtral-style 8 experts top-2", 16384, 2048, 5632, 8, 2),
    ("fine-grained 64 experts top-8", 16384, 2048, 1408, 64, 8),
)


def route(x, router, k):
    probs = torch.softmax(x.float() @ router.float().t(), dim=-1)
    top_p, top_i = probs.topk(k, dim=-1)
    return top_i, (top_p / top_p.sum(-1, keepdim=True)).to(x.dtype)


def loop_peer(x, router, w1, w3, w2, k):
    top_i, weights = route(x, router, k)
    out = torch.zeros_like(x)
    mask = F.one_hot(top_i, w1.shape[0]).permute(2, 1, 0)  # [E, k, T]
    for e in range(w1.shape[0]):
        slot, tok = torch.where(mask[e])
        xe = x[tok]
        ye = (F.silu(xe @ w1[e].t()) * (xe @ w3[e].t())) @ w2[e].t()
        out.index_add_(0, tok, ye * weights[tok, slot, None])
    return out


def grouped_peer(x, router, w13, w2, k):
    """w13 [E, h, 2F] (gate | up), w2 [E, F, h]: torch._grouped_mm over tokens sorted by expert."""
    top_i, weights = route(x, router, k)
    order = torch.argsort(top_i.flatten(), stable=True)
    src = order // k
    counts = torch.bincount(top_i.flatten(), minlength=w13.shape[0])
    offs = counts.cumsum(0).to(torch.int32)
    xs = x.index_select(0, src)
    h13 = torch._grouped_mm(xs, w13, offs=offs)
    gate, up = h13.chunk(2, dim=-1)
    ys = torch._grouped_mm(F.silu(gate) * up, w2, offs=offs)
    ys = ys * weights.flatten().index_select(0, order).unsqueeze(1)
    return torch.zeros_like(x).index_add(0, src, ys)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    p.add_argument("--no-append", action="store_true")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/moe.py needs a CUDA GPU", file=sys.stderr)
        return 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("nccl", rank=0, world_size=1)
    dev = torch.device("cuda", 0)
    from tpframe.comm import Communicator
    from tpframe.layers.moe import MoE

    comm = Communicator(backend="nccl", device=dev)
    lines = [
        "| case | T x h, F, E, top-k | run | ms | TFLOP/s | vs dense | max rel err |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, T, h, ffn, E, k in CASES:
        torch.manual_seed(0)
        moe = MoE(h, ffn, E, k, activation="swiglu", aux_loss_coeff=0.0, comm=comm, dtype=torch.bfloat16, device=dev)
        router = moe.router.weight
        w1 = torch.stack([moe.experts[str(e)].fc1.weight[:ffn] for e in range(E)]).detach().requires_grad_()
        w3 = torch.stack([moe.experts[str(e)].fc1.weight[ffn:] for e in range(E)]).detach().requires_grad_()
        w2 = torch.stack([moe.experts[str(e)].fc2.weight for e in range(E)]).detach().requires_grad_()
        w13 = torch.cat([w1, w3], dim=1).transpose(1, 2).contiguous().detach().requires_grad_()  # [E, h, 2F]
        w2t = w2.transpose(1, 2).contiguous().detach().requires_grad_()  # [E, F, h]
        dense1 = torch.randn(2 * k * ffn, h, device=dev, dtype=torch.bfloat16).mul_(0.02).requires_grad_()
        dense2 = torch.randn(h, k * ffn, device=dev, dtype=torch.bfloat16).mul_(0.02).requires_grad_()
        x = torch.randn(T, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(T, h, device=dev, dtype=torch.bfloat16)
        moe_params = [x, *moe.parameters()]

        def dense():
            gate, up = F.linear(x, dense1).chunk(2, dim=-1)
            torch.autograd.grad(F.linear(F.silu(gate) * up, dense2), [x, dense1, dense2], dy)

        def ours():
            torch.autograd.grad(moe(x.unsqueeze(1)).squeeze(1), moe_params, dy)

        def loop():
            torch.autograd.grad(loop_peer(x, router, w1, w3, w2, k), [x, w1, w3, w2], dy)

        def grouped():
            torch.autograd.grad(grouped_peer(x, router, w13, w2t, k), [x, w13, w2t], dy)

        with torch.no_grad():
            reference = moe(x.unsqueeze(1)).squeeze(1).float()
            scale = reference.abs().max().item()
            errors = {"loop peer": (loop_peer(x, router, w1, w3, w2, k).float() - reference).abs().max().item() / scale}
            try:
                errors["grouped_mm peer"] = (
                    grouped_peer(x, router, w13, w2t, k).float() - reference
                ).abs().max().item() / scale
            except RuntimeError as e:  # an older GPU or torch without the bf16 grouped GEMM
                errors["grouped_mm peer"] = f"n/a ({str(e).splitlines()[0][:60]})"
        flops = 18.0 * T * k * h * ffn
        times = {
            "dense MLP, k*F wide": timed(dense, iters=args.iters),
            "tpframe MoE": timed(ours, iters=args.iters),
            "loop peer": timed(loop, iters=args.iters),
        }
        if not isinstance(errors["grouped_mm peer"], str):
            times["grouped_mm peer"] = timed(grouped, iters=args.iters)
        for run, ms in times.items():
            err = errors.get(run, 0.0 if run == "tpframe MoE" else "-")
            err = f"{err:.1e}" if isinstance(err, float) else err
            lines.append(
                f"| {name} | {T} x {h}, {ffn}, {E}, {k} | {run} | {ms:.2f} | {flops / ms / 1e9:.0f} | "
                f"{times['dense MLP, k*F wide'] / ms:.2f}x | {err} |"
            )
        if isinstance(errors["grouped_mm peer"], str):
            lines.append(
                f"| {name} | {T} x {h}, {ffn}, {E}, {k} | grouped_mm peer | - | - | - | {errors['grouped_mm peer']} |"
            )
        print(lines[-1], flush=True)
    device = torch.cuda.get_device_name(dev)
    text = (
        f"## Mixture-of-experts layer, forward+backward: tpframe vs plain-torch peers, 1x {device}, "
        f"{datetime.date.today()}\n\nCommand: `python benchmarks/moe.py --iters {args.iters}`; "
        f"torch {torch.__version__}, bf16. See the script's docstring for the runs and the FLOP count.\n\n"
        + "\n".join(lines)
        + "\n"
    )
    report(text, args.results, append=not args.no_append)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
