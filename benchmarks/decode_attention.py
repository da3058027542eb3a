"""Decode attention: tpframe's Triton kernel (tpframe/kernels/decode_attention.py) against SDPA, one GPU.

    python benchmarks/decode_attention.py [--sweep] [--results benchmarks/RESULTS.md]

Each case: a generation-style KV cache (rows left-padded, one query token per row and head, the additive mask of
tpframe/inference/kv_cache.py), bf16, d=128. Each timing: 20 calls captured in one CUDA graph, replayed 5 times, the
median per call (the kernels alone, without launch overhead, as the decode step's graph runs them). Bytes: the keys
and values read, 2 x b x nkv x L x d x 2; the FLOPs (4 x b x nq x L x d) are negligible. --sweep also times every
(slots per iteration, warps, target programs) setting of the kernel (the multi-head or the grouped-query one,
as the case needs) and prints the best four per case.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from comm import report, time_graph  # noqa: E402  (benchmarks/comm.py: k calls in one CUDA graph, median of replays)

from tests.test_decode_attention_interpreter import cache_case  # noqa: E402
from tpframe.kernels import decode_attention as da  # noqa: E402

# b, nq, nkv, L: the GPT-1.3B decode shapes at TP=1 and 2, a long cache, and Llama-style grouped heads (32/8 at TP=1,
# 16/4 at TP=2, 32/4 at batch 8)
CASES = (
    (1, 16, 16, 256),
    (8, 16, 16, 256),
    (1, 8, 8, 256),
    (1, 16, 16, 2048),
    (1, 32, 8, 1024),
    (1, 16, 4, 1024),
    (8, 32, 4, 1024),
)
D = 128


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", action="store_true", help="also time every kernel setting")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    p.add_argument("--no-append", action="store_true")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/decode_attention.py needs a CUDA GPU", file=sys.stderr)
        return 2
    graph_time = functools.partial(time_graph, k=20, reps=5, device=torch.device("cuda", torch.cuda.current_device()))
    chosen = {
        False: (da.BLOCK_L, da.NUM_WARPS, da.PROGRAMS),
        True: (da.GROUP_BLOCK_L, da.GROUP_NUM_WARPS, da.GROUP_PROGRAMS),
    }

    def use(grouped: bool, setting) -> None:  # the multi-head kernel's setting, or the grouped-query kernel's
        if grouped:
            da.GROUP_BLOCK_L, da.GROUP_NUM_WARPS, da.GROUP_PROGRAMS = setting
        else:
            da.BLOCK_L, da.NUM_WARPS, da.PROGRAMS = setting

    lines = [
        "| rows x query heads (kv heads), cache slots | MB read | SDPA us | kernel us | kernel / SDPA | splits |",
        "|---|---|---|---|---|---|",
    ]
    for b, nq, nkv, slots in CASES:
        grouped = nq != nkv
        q, k, v, mask = cache_case(b, nq, nkv, 1, slots, D, dtype=torch.bfloat16, device="cuda")
        sdpa = graph_time(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=grouped))
        ours = graph_time(lambda: da.decode_attention(q, k, v, mask))
        tried = []
        for setting in itertools.product((16, 32, 64), (1, 2, 4), (64, 264, 1024)) if args.sweep else ():
            use(grouped, setting)
            tried.append((graph_time(lambda: da.decode_attention(q, k, v, mask)), setting))
        use(grouped, chosen[grouped])
        mb = 2 * b * nkv * slots * D * 2 / 1e6
        heads = f"{nq}" + (f" ({nkv})" if nkv != nq else "")
        splits = da.launch_plan(b, nq, nkv, 1, slots)[2]
        lines.append(f"| {b} x {heads}, {slots} | {mb:.1f} | {sdpa:.2f} | {ours:.2f} | {ours / sdpa:.2f}x | {splits} |")
        if tried:
            best = "; ".join(f"{t:.2f} us at {s}" for t, s in sorted(tried)[:4])
            print(f"b={b} nq={nq} nkv={nkv} L={slots}: best (slots per iteration, warps, programs): {best}", flush=True)
    name = torch.cuda.get_device_name()
    text = "\n".join(
        [
            f"## Decode attention: tpframe's kernel vs SDPA, 1x {name}, {datetime.date.today().isoformat()}",
            "",
            f"Command: `python benchmarks/decode_attention.py {' '.join(sys.argv[1:])}`; torch {torch.__version__}; "
            f"bf16, d={D}, one query token per row and head, the cache mask of generation; kernel settings (slots per "
            f"iteration, warps, target programs): multi-head {chosen[False]}, grouped-query {chosen[True]}; us per call "
            "from CUDA-graph replays.",
            "",
            *lines,
            "",
        ]
    )
    report(text, args.results, append=not args.no_append)
    return 0


if __name__ == "__main__":
    sys.exit(main())
