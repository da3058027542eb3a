"""Context-parallel attention on one GPU: what each CP rank computes, against the whole sequence's attention.

    python benchmarks/cp_attention.py [--seq 16384,65536] [--cp 2,4,8] [--results benchmarks/RESULTS.md] [--no-append]

With parallel.cp = c, CP rank r holds chunks r and 2c-1-r of the sequence and attends, forward and backward, over
the keys up to each chunk's end (tpframe/layers/context.py: attend_local_chunks over the keys and values
all-gathered and put in order by order_chunks; the training path feeds the same blocks the gathered keys unordered,
one copy less than timed here). This
times, on one GPU, rank r's share for every r (the all-gather itself needs c GPUs: its bytes are stated):
  - whole: causal attention over all S tokens, forward + backward (what one GPU without CP does);
  - ideal: whole / c, a perfect split;
  - rank min / max: the fastest and slowest rank's attention (+ its reorder of the gathered keys and values);
  - balance: min / max over the ranks (1.0: every rank waits for none); efficiency: ideal / max;
  - chunk attention: "merged blocks", the default from MERGE_MIN_CHUNK queries per chunk (_CausalBlocks: both
    chunks over the rank's own keys, square causal mask, then over the chunks before its first and its second chunk
    over the chunks between, no mask: at most three fused-kernel calls merged by their log-sum-exps; cuDNN on
    Hopper), or "lower-right mask" (one SDPA call per chunk with torch's lower-right causal bias: FlashAttention-2),
    the fallback.
Random bf16 q, k, v and upstream gradient, b = 1; median of 10 timed calls after 3 warm-up calls, CUDA events.
FLOPs, causal: forward 2*b*nq*S^2*d (half of full attention's 4*b*nq*S^2*d), backward 2.5x forward
(FlashAttention recomputes the scores): 7*b*nq*S^2*d for forward + backward.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from comm import report  # noqa: E402

from tpframe.layers.context import MERGE_MIN_CHUNK, attend_local_chunks, order_chunks, shard_sequence  # noqa: E402

SHAPES = {  # name: (query heads, kv heads, head dim)
    "GPT-1.3B (16 heads, d=128)": (16, 16, 128),
    "Llama-8B-style (32 heads, GQA 8, d=128)": (32, 8, 128),
}


def timed(fn, *, warmup: int = 3, iters: int = 10) -> float:
    """Median ms of `fn()` over `iters` calls after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def rank_ms(q, k, v, dout, *, rank: int, cp: int, fused: bool) -> float:
    """One CP rank's attention, forward + backward, over the all-gathered keys and values (here: this GPU's copy of
    every rank's share, stacked as the all-gather hands them over), their reordering included."""
    ql = shard_sequence(q.detach(), dim=2, rank=rank, size=cp).requires_grad_()
    dl = shard_sequence(dout, dim=2, rank=rank, size=cp)
    kv = torch.stack(
        [shard_sequence(torch.stack([k.detach(), v.detach()]), dim=3, rank=i, size=cp) for i in range(cp)]
    ).requires_grad_()
    gqa = q.shape[1] != k.shape[1]

    def rank_step():
        ordered = order_chunks(kv)  # [2, b, nkv, S, d]
        out = attend_local_chunks(ql, ordered[0], ordered[1], rank=rank, size=cp, enable_gqa=gqa, fused=fused)
        torch.autograd.grad(out, (ql, kv), dl)

    return timed(rank_step)


def case_rows(name: str, nq: int, nkv: int, d: int, s: int, cps: list[int], dev: torch.device) -> list[str]:
    """The table's rows of one shape and sequence length: the whole attention, then each cp's ranks."""
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (
        torch.randn(1, n, s, d, generator=g, device=dev, dtype=torch.bfloat16, requires_grad=True)
        for n in (nq, nkv, nkv)
    )
    dout = torch.randn(1, nq, s, d, generator=g, device=dev, dtype=torch.bfloat16)

    def whole():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nq != nkv)
        torch.autograd.grad(out, (q, k, v), dout)

    t_whole = timed(whole)
    flops = 7 * nq * s * s * d
    rows = []
    for cp in cps:
        ideal = t_whole / cp
        kv_bytes = 2 * s * nkv * d * 2 * (cp - 1) / cp  # bf16 k and v of the other ranks' tokens
        for fused in (True, False):
            per_rank = [rank_ms(q, k, v, dout, rank=r, cp=cp, fused=fused) for r in range(cp)]
            lo, hi = min(per_rank), max(per_rank)
            merged = s // (2 * cp) >= MERGE_MIN_CHUNK  # what the default picks at this chunk length
            how = ("default: merged blocks" if merged else "default: lower-right mask") if fused else "lower-right mask"
            rows.append(
                f"| {name} | {s} | {cp} | {how} | {t_whole:.2f} | {flops / t_whole / 1e9:.0f} | "
                f"{ideal:.2f} | {lo:.2f} | {hi:.2f} | {lo / hi:.2f} | {ideal / hi:.2f} | "
                f"{kv_bytes / 2**20:.0f} MiB |"
            )
            print(rows[-1], flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", default="16384,65536")
    p.add_argument("--cp", default="2,4,8")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    p.add_argument("--no-append", action="store_true")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/cp_attention.py needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    seqs, cps = [int(x) for x in args.seq.split(",")], [int(x) for x in args.cp.split(",")]
    rows = [
        "| shape | S | cp | chunk attention | whole ms | TFLOP/s | ideal ms | rank min ms | rank max ms | balance "
        "| efficiency | K,V all-gathered per rank per layer |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, (nq, nkv, d) in SHAPES.items():
        for s in seqs:
            rows += case_rows(name, nq, nkv, d, s, cps, dev)
            torch.cuda.empty_cache()
    device = torch.cuda.get_device_name(dev)
    text = "\n".join(
        [
            f"## Context-parallel attention, one rank's share: 1x {device}, {datetime.date.today()}",
            "",
            f"Command: `python benchmarks/cp_attention.py --seq {args.seq} --cp {args.cp}`. torch {torch.__version__}, "
            "bf16, b=1, forward + backward, median of 10 calls after 3 warm-up calls (CUDA events), random data. "
            "FLOPs (causal, fwd+bwd) = 7*b*nq*S^2*d. Rank times include putting the gathered keys and values in order "
            "(order_chunks) and its backward; the all-gather itself (last column: bytes per rank per layer, forward; "
            "the same reduce-scattered in backward) needs cp GPUs and is not timed here.",
            "",
            *rows,
            "",
        ]
    )
    report(text, args.results, append=not args.no_append)
    return 0


if __name__ == "__main__":
    sys.exit(main())
