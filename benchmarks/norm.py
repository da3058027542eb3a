"""LayerNorm / RMSNorm forward+backward: tpframe's Triton kernels (tpframe/kernels/norm.py) against torch's, one GPU.

    python benchmarks/norm.py [--results benchmarks/RESULTS.md] [--no-append]

Each case: x [rows, h] bf16 (rows = micro-batch x sequence of a GPT shape), weight (and bias), random data; one
forward and one backward with a random upstream gradient, timed as 20 calls in one CUDA graph replayed 5 times
(benchmarks/comm.py's time_graph: the kernels, not Python), median per call. Bytes: the forward reads x and
writes y, the backward reads x and dy and writes dx: 5 x rows x h x 2 bytes at the least.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from comm import report, time_graph  # noqa: E402

from tpframe.kernels.norm import _Norm  # noqa: E402

# rows, h: GPT-125M (16 x 1024, 768), GPT-1.3B (8 x 2048, 2048), Llama-style H=4096 (4 x 2048)
CASES = ((16384, 768), (16384, 2048), (8192, 4096))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    p.add_argument("--no-append", action="store_true")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/norm.py needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    graph_time = functools.partial(time_graph, k=20, reps=5, device=dev)
    lines = [
        "| norm | rows x h | MB moved (min) | torch us | kernel us | kernel / torch | kernel GB/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for rms in (False, True):
        for rows, h in CASES:
            x = torch.randn(rows, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
            w = torch.ones(h, device=dev, dtype=torch.bfloat16, requires_grad=True)
            b = None if rms else torch.zeros(h, device=dev, dtype=torch.bfloat16, requires_grad=True)
            dy = torch.randn(rows, h, device=dev, dtype=torch.bfloat16)
            params = [x, w] + ([b] if b is not None else [])

            def torch_step():
                y = F.rms_norm(x, (h,), w, 1e-5) if rms else F.layer_norm(x, (h,), w, b, 1e-5)
                torch.autograd.grad(y, params, dy)

            def kernel_step():
                torch.autograd.grad(_Norm.apply(x, w, b, 1e-5, rms), params, dy)

            theirs, ours = graph_time(torch_step), graph_time(kernel_step)
            mb = 5 * rows * h * 2 / 1e6
            lines.append(
                f"| {'RMSNorm' if rms else 'LayerNorm + bias'} | {rows} x {h} | {mb:.0f} | {theirs:.1f} "
                f"| {ours:.1f} | {ours / theirs:.2f}x | {mb / ours * 1e3:.0f} |"
            )
    text = "\n".join(
        [
            f"## Norms, forward+backward: tpframe's kernels vs torch, 1x {torch.cuda.get_device_name()}, "
            f"{datetime.date.today().isoformat()}",
            "",
            f"Command: `python benchmarks/norm.py {' '.join(sys.argv[1:])}`; torch {torch.__version__}; bf16; us per "
            "forward+backward from CUDA-graph replays.",
            "",
            *lines,
            "",
        ]
    )
    report(text, args.results, append=not args.no_append)
    return 0


if __name__ == "__main__":
    sys.exit(main())
