"""One-row linear layers (the batch-1 decode step's GEMMs): tpframe's kernel (tpframe/kernels/gemv.py) against
cuBLAS (F.linear), one GPU.

    python benchmarks/row_linear.py [--sweep] [--results benchmarks/RESULTS.md] [--no-append]

Cases: GPT-1.3B's decode layers (SwiGLU, FFN 5504, V=50304) at TP=1 and TP=2, x [1, K] bf16, weight [N, K].
Each timing: one CUDA graph that calls the layer once on each of C copies of the weight (C x weight bytes >= 400 MB,
so no call finds its weight in the 50 MB L2, as in a decode step, where every layer's weight is read once), replayed
7 times; the median per call. Bytes: the weight, 2 N K (x and y are negligible); floor: bytes / the HBM bandwidth
(3.35 TB/s H100, 4.8 TB/s H200). Then SwiGLU's first layer: torch's silu(gate) * up after the GEMM, or the
activation inside the kernel. --sweep also times the kernel's (BLOCK_N, BLOCK_K, warps, stages) settings and
prints the best three per case.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from comm import report, time_graph  # noqa: E402  (benchmarks/comm.py)

from tpframe.kernels import gemv  # noqa: E402

CASES = {
    "qkv": (6144, 2048),
    "attention out": (2048, 2048),
    "gate+up": (11008, 2048),
    "down": (2048, 5504),
    "head": (50304, 2048),
    "qkv, TP=2": (3072, 2048),
    "attention out, TP=2": (2048, 1024),
    "gate+up, TP=2": (5504, 2048),
    "down, TP=2": (2048, 2752),
    "head, TP=2": (25152, 2048),
}
SETTINGS = list(itertools.product((1, 2, 4), (512, 1024, 2048), (4, 8), (3, 4)))


def rotated_us(call, copies: int, reps: int = 7) -> float:
    """Microseconds per call(i) in a CUDA graph of `copies` calls that cycle through i = 0..copies-1, so each
    replay reads every copy once; median of `reps` replays (benchmarks/comm.py's time_graph)."""
    order = itertools.cycle(range(copies))
    return time_graph(lambda: call(next(order)), copies, reps, torch.device("cuda", torch.cuda.current_device()))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", action="store_true", help="also time the kernel's settings")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    p.add_argument("--no-append", action="store_true")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/row_linear.py needs a CUDA GPU", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name()
    hbm = 4.8e12 if "H200" in name else 3.35e12 if "H100" in name else None
    chosen = (gemv.BLOCK_N, gemv.BLOCK_K, gemv.WARPS, gemv.STAGES)
    chosen_swiglu = gemv.SWIGLU_BLOCK_N
    g = torch.Generator(device="cuda").manual_seed(0)
    lines = [
        "| layer [N x K] | MB | floor us | cuBLAS us | kernel us | kernel TB/s | kernel / cuBLAS |",
        "|---|---|---|---|---|---|---|",
    ]
    sweeps = []
    for layer, (n, k) in CASES.items():
        copies = max(4, -(-400_000_000 // (2 * n * k)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k**0.5 for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=g)
        with torch.no_grad():
            cublas = rotated_us(lambda i: F.linear(x, ws[i]), copies)
            ours = rotated_us(lambda i: gemv.row_linear(x, ws[i]), copies)
            if args.sweep:
                timed = []
                for setting in SETTINGS:
                    gemv.BLOCK_N, gemv.BLOCK_K, gemv.WARPS, gemv.STAGES = setting
                    timed.append((rotated_us(lambda i: gemv.row_linear(x, ws[i]), copies, reps=5), setting))
                gemv.BLOCK_N, gemv.BLOCK_K, gemv.WARPS, gemv.STAGES = chosen
                sweeps.append(f"- {layer}: " + ", ".join(f"{s} {t:.2f} us" for t, s in sorted(timed)[:3]))
        mb = 2 * n * k / 1e6
        floor = f"{mb * 1e12 / hbm:.1f}" if hbm else "-"
        lines.append(
            f"| {layer} [{n} x {k}] | {mb:.1f} | {floor} | {cublas:.2f} | {ours:.2f} | "
            f"{mb / ours:.2f} | {ours / cublas:.2f}x |"
        )
        print(lines[-1], flush=True)
        del ws
    today = datetime.date.today().isoformat()
    # SwiGLU's first layer: the activation after the GEMM (torch) or inside the kernel, at 1 and 2 outputs per program
    swiglu = [
        "",
        "| SwiGLU fc1 [N x K] | cuBLAS + silu * up us | kernel + silu * up us | kernel with SwiGLU inside, "
        "1 output per program us | same, 2 outputs per program us |",
        "|---|---|---|---|---|",
    ]
    for n, k in ((11008, 2048), (5504, 2048)):
        copies = max(4, -(-400_000_000 // (2 * n * k)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k**0.5 for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=g)

        def act(h):
            gate, up = h.chunk(2, dim=-1)
            return F.silu(gate) * up

        cells = [
            rotated_us(lambda i: act(F.linear(x, ws[i])), copies),
            rotated_us(lambda i: act(gemv.row_linear(x, ws[i])), copies),
        ]
        for block_n in (1, 2):
            gemv.SWIGLU_BLOCK_N = block_n
            cells.append(rotated_us(lambda i: gemv.row_linear(x, ws[i], activation="swiglu"), copies))
        gemv.SWIGLU_BLOCK_N = chosen_swiglu
        swiglu.append(f"| [{n} x {k}] | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
        print(swiglu[-1], flush=True)
        del ws
    lines += swiglu
    head = [
        f"## One-row linear layers: tpframe's kernel vs cuBLAS, 1x {name}, {today}",
        "",
        f"Command: `python benchmarks/row_linear.py {' '.join(sys.argv[1:])}`; torch {torch.__version__}; x [1, K] "
        f"bf16, weight [N, K] bf16; kernel setting (BLOCK_N, BLOCK_K, warps, stages) {chosen}; us per call in CUDA "
        "graphs, each call on another copy of the weight (no L2 reuse).",
        "",
    ]
    tail = ["", "Sweep, best three settings per case (BLOCK_N, BLOCK_K, warps, stages):", "", *sweeps] if sweeps else []
    report("\n".join(head + lines + tail) + "\n", args.results, append=not args.no_append)
    return 0


if __name__ == "__main__":
    sys.exit(main())
