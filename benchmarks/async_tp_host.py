"""Host (CPU) time per async-TP layer call by copy engines (`parallel.async_tp=copy_engine`) beside the plain path.

    python benchmarks/async_tp_host.py        # one GPU

One process stands in for rank 0 of TP=2 (`benchmarks/gpt.py`'s `emulate_tp`): the collectives stay local and the
copy-engine pushes go into local stand-ins for the peer's memory and every flag wait passes, so no wait stalls
the GPU. The layers are tiny (a column + row pair, h=256, f=1024, 128 rows of bf16) so that the host paces: the
time per call is what the Python, dispatch and driver calls cost the caller. The plain rows launch no NCCL call
(their collectives are local copies): a real plain step adds one launch per collective. Median of ROUNDS rounds of
ITERS calls after warm-up. Appends the table to benchmarks/RESULTS.md (NO_APPEND=1: not).
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpt import emulate_tp  # noqa: E402
from tpframe.comm import Communicator  # noqa: E402
from tpframe.layers import ColumnParallelLinear, RowParallelLinear  # noqa: E402

ITERS, ROUNDS = int(os.environ.get("ITERS", "300")), int(os.environ.get("ROUNDS", "9"))
H, F, ROWS = 256, 1024, 64  # rows of this rank's sequence block (x 2 batch)


def per_call_us(fn) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(ROUNDS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(ITERS):
            fn()
        times.append((time.perf_counter() - t0) / ITERS * 1e6)  # before the sync: the host's time
        torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/async_tp_host.py needs a CUDA GPU")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("gloo", rank=0, world_size=1)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    comm = Communicator(dist.group.WORLD, backend="nccl", device=device)
    emulate_tp(comm, 2)
    ex = comm.peer_exchange()
    x = torch.randn(ROWS, 2, H, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(ROWS, 2, H, device=device, dtype=torch.bfloat16)

    def push_wait_release():
        incoming = ex.push({1: x.detach().view(-1, H)})[1]
        incoming.wait()
        incoming.release()

    rows = [("one push + wait + release", per_call_us(push_wait_release))]
    for mode, label in (("copy_engine", "copy_engine"), (None, "plain path (collectives local, no NCCL launch)")):
        kw = dict(sequence_parallel=True, comm=comm, dtype=torch.bfloat16, device=device, async_tp=mode)
        fc1, fc2 = ColumnParallelLinear(H, F, **kw), RowParallelLinear(F, H, **kw)

        def forward():
            with torch.no_grad():
                fc2(fc1(x))

        rows.append((f"{label}: column + row forward", per_call_us(forward)))
        rows.append((f"{label}: column + row forward+backward", per_call_us(lambda: fc2(fc1(x)).backward(grad))))
    table = ["| call | host us |", "|---|---|"] + [f"| {name} | {us:.1f} |" for name, us in rows]
    print("\n".join(table))
    if os.environ.get("NO_APPEND") != "1":
        with open(Path(__file__).resolve().parent / "RESULTS.md", "a") as f:
            f.write(
                f"\n### Async TP host cost per call, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
                f"{datetime.date.today()}\n`python benchmarks/async_tp_host.py` (ITERS={ITERS} ROUNDS={ROUNDS})\n\n"
                + "\n".join(table)
                + "\n"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
