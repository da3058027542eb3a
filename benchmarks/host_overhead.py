"""Host (CPU) time per eager collective call: tpframe's Communicator and mappings against raw torch.distributed.

    torchrun --nproc-per-node 2 benchmarks/host_overhead.py [--iters 500] [--rounds 30] [--results FILE]
    python benchmarks/host_overhead.py            # CPU: one process, torch's "fake" process group of 2 ranks
    torchrun --nproc-per-node 1 benchmarks/host_overhead.py   # one GPU: the raw calls against the NCCL backend

Each probe is called back-to-back `iters` times per round, the probes interleaved round by round; the
table gives the fastest round (the least disturbed by other processes) in host microseconds per call (on GPU,
after a device sync, so the launch queue never fills: the Python + dispatch cost the caller pays, not the transfer).
"dist" rows are the raw torch.distributed calls; "backend" rows tpframe's NCCL backend (tpframe/comm/nccl.py);
"comm" rows go through tpframe.comm.Communicator (backend nccl); "mapping" rows through the autograd mappings under no_grad. On CPU the process group is
torch's fake backend (every collective returns at once, moving nothing), which isolates the Python and
dispatch cost from gloo's transport, whose own jitter on a small machine is a thousand times larger.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tpframe.comm import Communicator  # noqa: E402
from tpframe.layers.mappings import gather_from_sp, reduce_from_tp, reduce_scatter_to_sp  # noqa: E402


def probes(comm: Communicator, x: torch.Tensor) -> dict:
    """The calls to time. At world 1 the Communicator and the mappings return their input at once (nothing to
    reduce), so only the raw calls and the backend's (`comm.nccl`, which the Communicator's NCCL path calls) run."""
    world = comm.size
    inplace = x.clone()
    gathered = x.new_empty((world * x.shape[0],) + tuple(x.shape[1:]))
    scattered = x.new_empty((x.shape[0] // world,) + tuple(x.shape[1:]))
    all_gather = dist.all_gather_into_tensor
    reduce_scatter = dist.reduce_scatter_tensor
    backend = comm.nccl
    out = {
        "dist.all_reduce (in place)": lambda: dist.all_reduce(inplace),
        "backend all_reduce (donated: in place)": lambda: backend.all_reduce(inplace, donate=True),
        "backend all_reduce (copy + in place)": lambda: backend.all_reduce(x),
        "comm.all_reduce (out of place)": lambda: comm.all_reduce(x),
        "comm.all_reduce(donate=True)": lambda: comm.all_reduce(inplace, donate=True),
        "mapping reduce_from_tp": lambda: reduce_from_tp(x, comm),
        "dist.all_gather_into_tensor": lambda: all_gather(gathered, x),
        "backend all_gather (allocates its output)": lambda: backend.all_gather(x),
        "comm.all_gather": lambda: comm.all_gather(x),
        "mapping gather_from_sp": lambda: gather_from_sp(x, comm),
        "dist.reduce_scatter_tensor": lambda: reduce_scatter(scattered, x),
        "backend reduce_scatter (allocates its output)": lambda: backend.reduce_scatter(x),
        "comm.reduce_scatter": lambda: comm.reduce_scatter(x),
        "mapping reduce_scatter_to_sp": lambda: reduce_scatter_to_sp(x, comm),
    }
    if world == 1:
        out = {name: fn for name, fn in out.items() if name.startswith(("dist", "backend"))}
    return out


def measure(comm, x, iters: int, rounds: int, sync) -> dict:
    fns = probes(comm, x)
    times = {name: [] for name in fns}
    with torch.no_grad():
        for name, fn in fns.items():  # warm-up
            for _ in range(20):
                fn()
        for _ in range(rounds):
            for name, fn in fns.items():
                sync()
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                times[name].append((time.perf_counter() - t0) / iters * 1e6)
                sync()
    return {name: min(t) for name, t in times.items()}


def run(args) -> None:
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    comm = Communicator(backend="nccl", device=device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = {}
    for numel in (4096, 524288):  # 8 KiB and 1 MiB of bf16 (16 KiB / 2 MiB of fp32 on CPU)
        dtype = torch.bfloat16 if cuda else torch.float32
        x = torch.randn(numel // 64, 64, device=device).to(dtype)
        rows[numel] = measure(comm, x, args.iters, args.rounds, sync)
    if dist.get_rank() == 0:
        dev = torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores), {dist.get_backend()} group"
        lines = [
            f"### Host time per eager collective call, {dev} x{dist.get_world_size()}, torch {torch.__version__}",
            "",
            f"Command: `{args.command}`. Fastest of {args.rounds} rounds of {args.iters} back-to-back calls, "
            "microseconds of host time per call (see the script's docstring).",
            "",
            "| call | " + " | ".join(f"{n} elements us" for n in rows) + " |",
            "|---|" + "---|" * len(rows),
        ]
        for name in rows[4096]:
            lines.append(f"| {name} | " + " | ".join(f"{rows[n].get(name, float('nan')):.2f}" for n in rows) + " |")
        text = "\n".join(lines)
        print(text, flush=True)
        if args.results:
            with open(args.results, "a") as f:
                f.write("\n" + text + "\n")
    comm.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--results", default="", help="markdown file to append the table to")
    args = p.parse_args()
    args.command = " ".join(["benchmarks/host_overhead.py"] + sys.argv[1:])
    if "RANK" not in os.environ:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    run(args)


if __name__ == "__main__":
    main()
