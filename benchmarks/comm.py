"""Collective latency and bus bandwidth on one node: NCCL, torch's symm_mem all-reduce ops and tpframe's
symm kernels, side by side, eager and under CUDA graph replay. Writes the thresholds `auto` uses.

    torchrun --nproc-per-node 2 benchmarks/comm.py \\
        [--max-mib 256] [--results benchmarks/RESULTS.md] [--thresholds tpframe/comm/symm/thresholds.json]

Per op, dtype and size (4 KiB .. --max-mib, x2 steps; random normal data) every implementation is timed
as the median over R batches of K back-to-back calls: eager (launched from Python) and graph (the K calls
captured in one CUDA graph and replayed). The slower rank's median is reported. Bus bandwidth:
all-reduce 2(n-1)/n * bytes / t, all-gather and reduce-scatter (n-1)/n * bytes / t, where bytes is the
collective's largest tensor (all-reduce input, all-gather output, reduce-scatter input).
Thresholds: per (op, world, dtype, mode) the sizes where the fastest of our kernels beat tpframe's NCCL
backend, and the fastest all-reduce kernel by size (one-shot, push, two-shot, or the barrier-free Lamport);
then `auto` is timed with them. A run over fewer ops, dtypes or sizes updates only what it measured.
--nccl-window adds NCCL on buffers registered as symmetric windows (torch symmetric memory with its NCCL
backend, NCCL >= 2.27), in a process of its own: torch fixes one symmetric-memory backend per process.
Keep NVLink multicast off: NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tpframe.comm import (
    Communicator,  # noqa: E402
    select,  # noqa: E402
)

KIB, MIB = 1 << 10, 1 << 20
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
OPS = ("all_reduce", "all_gather", "reduce_scatter")
FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min-kib", type=int, default=4)
    p.add_argument("--max-mib", type=int, default=256)
    p.add_argument("--dtypes", default="bf16,fp16,fp32")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--results", default="benchmarks/RESULTS.md", help="markdown file the tables are appended to")
    p.add_argument("--thresholds", default=str(select.DEFAULT_PATH), help="thresholds JSON to write (merged)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply the iteration counts (e.g. 0.3 for a smoke run)")
    p.add_argument(
        "--nccl-window",
        action="store_true",
        help="only: NCCL all-reduce on symmetric-window buffers vs plain buffers (bf16, eager and graph)",
    )
    args = p.parse_args()
    for d in args.dtypes.split(","):
        if d not in DTYPES:
            p.error(f"--dtypes: {d!r} is not one of {sorted(DTYPES)}")
    for o in args.ops.split(","):
        if o not in OPS:
            p.error(f"--ops: {o!r} is not one of {OPS}")
    return args


def counts(nbytes: int, scale: float) -> tuple[int, int]:
    """(K calls per timed batch, R batches): many small calls, few large ones."""
    k, r = (20, 30) if nbytes <= MIB else (10, 10) if nbytes <= 16 * MIB else (3, 5)
    return max(2, int(k * scale)), max(3, int(r * scale))


def device_barrier(device):
    torch.cuda.synchronize()
    dist.barrier(device_ids=[device.index])


def time_eager(fn, k, reps, device) -> float:
    for _ in range(3):
        fn()
    device_barrier(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(k):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / k)
    return statistics.median(times)


def report(text: str, results: str, *, append: bool) -> None:
    """Print a benchmark's markdown section and, with `append`, add it to the results file."""
    print(text, flush=True)
    if append:
        with open(results, "a") as f:
            f.write("\n" + text)


def time_graph(fn, k, reps, device) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    device_barrier(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(k):
            fn()
    graph.replay()
    device_barrier(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / k)
    del graph
    device_barrier(device)
    return statistics.median(times)


COMM_NAMES = ["comm-nccl", "comm-symm", "auto"]


def forced(comm: Communicator, backend: str) -> Communicator:
    """A view of `comm` forced to one backend: same groups, same symm buffer, its own dispatch cache."""
    view = copy.copy(comm)
    view.requested, view._plans = backend, {}
    return view


class Impls:
    """The implementations of each op, as zero-argument calls on prepared inputs."""

    def __init__(self, comm: Communicator, max_bytes: int, device):
        import torch.distributed._symmetric_memory as symm_mem

        self.comm, self.device = comm, device
        self.forced: dict[str, Communicator] = {}
        self.group_name = dist.group.WORLD.group_name
        self.torch_buf = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.torch_buf, self.group_name)
        ops = torch.ops.symm_mem
        self.has = {
            name: hasattr(ops, name)
            for name in (
                "one_shot_all_reduce",
                "one_shot_all_reduce_copy",
                "two_shot_all_reduce_",
                "two_shot_all_reduce_out",
            )
        }

    def for_op(self, op: str, x: torch.Tensor) -> dict:
        comm, k = self.comm, self.comm.symm.kernels
        via = {"auto": comm, **{f"comm-{b}": c for b, c in self.forced.items()}}
        if op == "all_gather":
            return {
                "nccl": lambda: comm.nccl.all_gather(x),
                "ours": lambda: k.all_gather(x, x.new_empty((comm.size * x.numel(),))),
                **{name: (lambda c=c: c.all_gather(x)) for name, c in via.items()},
            }
        if op == "reduce_scatter":
            return {
                "nccl": lambda: comm.nccl.reduce_scatter(x),
                "ours": lambda: k.reduce_scatter(x, x.new_empty((x.numel() // comm.size,))),
                **{name: (lambda c=c: c.reduce_scatter(x)) for name, c in via.items()},
            }
        inplace, donated = x.clone(), x.clone()
        impls = {
            "nccl-raw": lambda: dist.all_reduce(inplace),
            "nccl": lambda: comm.nccl.all_reduce(x),
            "nccl-donate": lambda: comm.nccl.all_reduce(donated, donate=True),
        }
        tview = self.torch_buf[: x.numel() * x.element_size()].view(x.dtype)
        ops, name = torch.ops.symm_mem, self.group_name
        if self.has["one_shot_all_reduce_copy"]:
            impls["torch-1shot"] = lambda: ops.one_shot_all_reduce_copy(tview, x, "sum", name)
        elif self.has["one_shot_all_reduce"]:
            impls["torch-1shot"] = lambda: (tview.copy_(x), ops.one_shot_all_reduce(tview, "sum", name))[1]
        if self.has["two_shot_all_reduce_out"]:
            impls["torch-2shot"] = lambda: ops.two_shot_all_reduce_out(tview.copy_(x), "sum", name, torch.empty_like(x))
        elif self.has["two_shot_all_reduce_"]:
            impls["torch-2shot"] = lambda: ops.two_shot_all_reduce_(tview.copy_(x), "sum", name).clone()
        lamport = comm.symm.lamport
        for algo, label in OUR_ALGOS.items():
            if algo == "lamport":
                if lamport is not None and lamport.fits(x.numel(), x.dtype):
                    impls[label] = lambda: lamport.all_reduce(x, torch.empty_like(x))
            elif k.fits("all_reduce", x.numel(), x.dtype, algo):  # push needs world slots of the message
                impls[label] = lambda algo=algo: k.all_reduce(x, torch.empty_like(x), algo)
        impls.update({name: (lambda c=c: c.all_reduce(x)) for name, c in via.items()})
        return impls


def cpu_overhead(impls: Impls, device) -> list[str]:
    """Host microseconds per eager call of each layer of the symm path (8 KiB bf16), to see where the
    launch time goes. Every rank runs the same calls (they are collectives)."""
    import time

    comm, k = impls.comm, impls.comm.symm.kernels
    x = torch.randn(4096, device=device).to(torch.bfloat16)
    out = torch.empty_like(x)
    plan = k.plan("push", x.numel(), x.dtype)
    probes = {
        "torch.empty_like": lambda: torch.empty_like(x),
        "is_current_stream_capturing": torch.cuda.is_current_stream_capturing,
        "plan launch only (push)": lambda: plan(x.data_ptr(), out.data_ptr()),
        "kernels.all_reduce(push)": lambda: k.all_reduce(x, out, "push"),
        "symm.all_reduce": lambda: comm.symm.all_reduce(x),
        f"Communicator.all_reduce (auto -> {comm.backend_for('all_reduce', x).name})": lambda: comm.all_reduce(x),
        "torch one_shot_all_reduce_copy": impls.for_op("all_reduce", x).get("torch-1shot"),
        "dist.all_reduce (in place)": lambda: dist.all_reduce(out),
        "NcclBackend.all_reduce (donated: in place)": lambda: comm.nccl.all_reduce(out, donate=True),
    }
    lines = []
    for name, fn in probes.items():
        if fn is None:
            continue
        for _ in range(20):
            fn()
        device_barrier(device)
        t0 = time.perf_counter()
        for _ in range(2000):
            fn()
        host = (time.perf_counter() - t0) / 2000 * 1e6
        device_barrier(device)
        lines.append(f"- {name}: {host:.2f} us host time per call")
    return lines


def close(a, b, dtype) -> bool:
    tol = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}[dtype]
    return bool(torch.allclose(a.float(), b.float(), rtol=tol, atol=tol * 4))


def measure(impls: Impls, op, dtype, sizes, names, scale, device, world, rank) -> dict:
    """{(size, impl, mode): us} (this rank) and {(size, impl): output matches NCCL}."""
    times, ok = {}, {}
    for nbytes in sizes:
        numel = nbytes // dtype.itemsize // (world if op == "all_gather" else 1)
        g = torch.Generator(device=device).manual_seed(1234 + rank + 17 * nbytes)
        x = torch.randn(numel, device=device, generator=g, dtype=torch.float32).to(dtype)
        calls = impls.for_op(op, x)
        ref = calls["nccl"]()
        k, reps = counts(nbytes, scale)
        for name in names:
            if name not in calls:
                continue
            out = calls[name]()
            ok[(nbytes, name)] = name == "nccl-raw" or close(out, ref, dtype)
            del out
            times[(nbytes, name, "eager")] = time_eager(calls[name], k, reps, device)
            times[(nbytes, name, "graph")] = time_graph(calls[name], k, reps, device)
        if rank == 0:  # progress, in case the run is cut short
            print(
                f"{op} {dtype} {nbytes}: "
                + " ".join(
                    f"{n}={times[(nbytes, n, 'eager')]:.1f}/{times[(nbytes, n, 'graph')]:.1f}"
                    for n in names
                    if (nbytes, n, "eager") in times
                ),
                flush=True,
            )
        del x, calls, ref
        torch.cuda.empty_cache()
    return {"times": times, "ok": ok}


def slowest_rank(local: dict, world: int) -> dict:
    everyone = [None] * world
    dist.all_gather_object(everyone, local)
    times = {key: max(r["times"][key] for r in everyone) for key in local["times"]}
    ok = {key: all(r["ok"][key] for r in everyone) for key in local["ok"]}
    return {"times": times, "ok": ok}


OUR_ALGOS = {"one_shot": "ours-1shot", "push": "ours-push", "two_shot": "ours-2shot", "lamport": "ours-lamport"}


def ours_best(times, op, nbytes, mode):
    if op == "all_reduce":
        return min(times[(nbytes, name, mode)] for name in OUR_ALGOS.values() if (nbytes, name, mode) in times)
    return times[(nbytes, "ours", mode)]


def thresholds_for(results: dict, world: int) -> dict:
    """This world size's threshold entries: section -> op -> world -> dtype -> mode -> value."""
    table = {"symm_ranges": {}, "all_reduce_algos": {}}

    def put(section, op, dkey, mode, value):
        table[section].setdefault(op, {}).setdefault(str(world), {}).setdefault(dkey, {})[mode] = value

    for (op, dname), res in results.items():
        t, sizes = res["times"], res["sizes"]
        dkey = select.DTYPE_NAMES[DTYPES[dname]]
        usable = {
            s: [a for a in OUR_ALGOS if fits_default_buffer(a, s, world) and (s, OUR_ALGOS[a], "graph") in t]
            for s in sizes
        }
        for mode in ("eager", "graph"):
            if op == "all_reduce":
                ours = [min([t[(s, OUR_ALGOS[a], mode)] for a in usable[s]] or [float("inf")]) for s in sizes]
            else:
                ours = [t[(s, "ours", mode)] for s in sizes]
            put(
                "symm_ranges",
                op,
                dkey,
                mode,
                ranges_from_winners(sizes, [o < t[(s, "nccl", mode)] for o, s in zip(ours, sizes)]),
            )
        if op == "all_reduce":  # the kernel choice by GPU time (graph replay), ties (< 3%) to the steadier pick
            picks = []
            for s in sizes:
                best = min(t[(s, OUR_ALGOS[a], "graph")] for a in usable[s]) if usable[s] else None
                near = [a for a in ALGO_PREFERENCE if a in usable[s] and t[(s, OUR_ALGOS[a], "graph")] <= 1.03 * best]
                picks.append(near[0] if near else "two_shot")
            put("all_reduce_algos", op, dkey, "graph", algos_from_winners(sizes, picks))
    return table


def ranges_from_winners(sizes: list[int], symm_wins: list[bool]) -> list[list[int | None]]:
    """Byte ranges where symm won, each ending halfway (geometric mean) to the nearest measured loss.

    sizes ascending. [4K: win, 8K: win, 16K: loss] -> [[0, ~11585]]; a win at the largest size
    leaves the range open (None)."""
    if len(sizes) != len(symm_wins) or any(b <= a for a, b in zip(sizes, sizes[1:])):
        raise ValueError(f"sizes must be ascending and match the winners: {sizes} / {symm_wins}")
    ranges, start = [], None
    for i, (size, win) in enumerate(zip(sizes, symm_wins)):
        if win and start is None:
            start = 0 if i == 0 else math.ceil(math.sqrt(sizes[i - 1] * size))
        if not win and start is not None:
            ranges.append([start, math.floor(math.sqrt(sizes[i - 1] * size))])
            start = None
    if start is not None:
        ranges.append([start, None])
    return ranges


def algos_from_winners(sizes: list[int], winners: list[str]) -> list[list]:
    """[[up_to_bytes, algo], ...] from the fastest algorithm at each measured size (ascending); each
    bound lies halfway (geometric mean) to the next measured size, the last is None."""
    if not sizes or len(sizes) != len(winners) or any(b <= a for a, b in zip(sizes, sizes[1:])):
        raise ValueError(f"sizes must be ascending and match the winners: {sizes} / {winners}")
    bounds = []
    for i, algo in enumerate(winners):
        last = i == len(winners) - 1
        if last or winners[i + 1] != algo:
            bounds.append([None if last else math.floor(math.sqrt(sizes[i] * sizes[i + 1])), algo])
    return bounds


ALGO_PREFERENCE = ("push", "one_shot", "two_shot", "lamport")  # ties (< 3%) go to the earlier


def fits_default_buffer(algo: str, nbytes: int, world: int) -> bool:
    """Whether an all-reduce kernel runs at this size with tpframe's default symmetric buffer: the
    thresholds describe the default set-up (a larger TPFRAME_SYMM_BUFFER_MB only adds headroom)."""
    from tpframe.comm.symm.backend import DEFAULT_BUFFER_BYTES
    from tpframe.comm.symm.lamport import DEFAULT_SEGMENT_BYTES

    if algo == "lamport":
        return nbytes <= DEFAULT_SEGMENT_BYTES
    need = world * nbytes if algo == "push" else nbytes + world * 16
    return need <= DEFAULT_BUFFER_BYTES


def merge_thresholds(path: Path, new: dict, world: int, meta: dict, covered: dict) -> dict:
    """The file's table with what this run measured replaced: per (op, dtype) of this world size, the sizes
    up to the largest measured one (covered[(op, dtype name)] bytes); the file's entries above it are kept."""
    table = json.loads(path.read_text()) if path.exists() else {}
    for section, by_op in new.items():
        for op, by_world in by_op.items():
            mine = table.setdefault(section, {}).setdefault(op, {}).setdefault(str(world), {})
            for dkey, by_mode in by_world[str(world)].items():
                old = mine.setdefault(dkey, {})
                for mode, value in by_mode.items():
                    top = covered[(op, dkey)]
                    splice = splice_algos if section == "all_reduce_algos" else splice_ranges
                    old[mode] = splice(value, old.get(mode), top) if old.get(mode) else value
    earlier = table.setdefault("measured", {}).get(str(world))
    if earlier is not None:  # a partial run keeps the record of the run that measured the rest
        meta = dict(meta, earlier={k: v for k, v in earlier.items() if k != "earlier"})
    table["measured"][str(world)] = meta
    return table


def splice_ranges(new: list, old: list, top: int) -> list:
    """Byte ranges: `new` (measured up to `top` bytes) below, `old` above, touching ranges joined."""
    out = [[lo, top if hi is None else min(hi, top)] for lo, hi in new if lo <= top]
    for lo, hi in old:
        if hi is None or hi > top:
            lo = max(lo, top + 1)
            if out and out[-1][1] >= lo - 1:
                out[-1][1] = hi
            else:
                out.append([lo, hi])
    return out


def splice_algos(new: list, old: list, top: int) -> list:
    """[[up_to_bytes, algo], ...]: `new` (measured up to `top`) below, `old` above, equal neighbours joined."""
    out = []
    for up, algo in new:  # `new` ends with None, so this reaches `top`
        out.append([top if up is None else min(up, top), algo])
        if out[-1][0] >= top:
            break
    for up, algo in old:
        if up is None or up > top:
            if out[-1][1] == algo:
                out[-1][0] = up
            else:
                out.append([up, algo])
    return out


def fmt_size(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // KIB} KiB"


def table_md(op, dname, res, world, mode) -> list[str]:
    t, ok, sizes, names = res["times"], res["ok"], res["sizes"], res["names"]
    base = "nccl-raw" if op == "all_reduce" else "nccl"
    cols = [n for n in names if (sizes[0], n, mode) in t]
    head = ["size"] + [f"{n} us" for n in cols] + [f"ours vs {base}", "auto vs best comm", "ours busbw GB/s"]
    lines = [f"**{op} {dname}, {mode}** (world {world})", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in sizes:
        best_ours = ours_best(t, op, s, mode)
        best = min(t.get((s, "comm-nccl", mode), t[(s, "nccl", mode)]), t.get((s, "comm-symm", mode), best_ours))
        row = [fmt_size(s)]
        for n in cols:
            if (s, n, mode) not in t:
                row.append("-")
                continue
            cell = f"{t[(s, n, mode)]:.1f}"
            row.append(cell if ok.get((s, n), True) else cell + " WRONG")
        row.append(f"{t[(s, base, mode)] / best_ours:.2f}x")
        row.append(f"{t[(s, 'auto', mode)] / best:.2f}")
        row.append(f"{FACTOR[op](world) * s / best_ours / 1e3:.1f}")
        lines.append("| " + " | ".join(row) + " |")
    return lines + [""]


def met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def targets_md(res, world) -> list[str]:
    """The issue's all-reduce bf16 targets, checked on these numbers."""
    t, sizes = res["times"], res["sizes"]
    lines = ["**Targets (all_reduce bf16)**", ""]
    for mode in ("eager", "graph"):
        small = [s for s in sizes if 4 * KIB <= s <= 256 * KIB]
        mid = [s for s in sizes if MIB <= s <= 4 * MIB]
        vs_nccl = min(t[(s, "nccl-raw", mode)] / ours_best(t, "all_reduce", s, mode) for s in small)
        torch_names = [n for n in ("torch-1shot", "torch-2shot") if (small[0], n, mode) in t]
        vs_torch = (
            min(min(t[(s, n, mode)] for n in torch_names) / ours_best(t, "all_reduce", s, mode) for s in small)
            if torch_names
            else float("nan")
        )
        vs_nccl_mid = (
            min(t[(s, "nccl-raw", mode)] / ours_best(t, "all_reduce", s, mode) for s in mid) if mid else float("nan")
        )
        auto_worst = max(
            t[(s, "auto", mode)] / min(t[(s, "comm-nccl", mode)], t[(s, "comm-symm", mode)]) for s in sizes
        )
        if (sizes[0], "nccl-donate", mode) in t:  # the lean NCCL path: the layers' call against the raw one
            extra = max(t[(s, "nccl-donate", mode)] - t[(s, "nccl-raw", mode)] for s in sizes)
            lines.append(
                f"- {mode}: tpframe's NCCL backend (donated input) minus raw dist.all_reduce, worst size: "
                f"{extra:+.1f} us (target <= 2 us: {met(extra <= 2)})"
            )
        decode = [s for s in sizes if 4 * KIB <= s <= 64 * KIB]
        if mode == "graph" and decode:
            vs = min(t[(s, "nccl-raw", mode)] / ours_best(t, "all_reduce", s, mode) for s in decode)
            ours = ", ".join(f"{ours_best(t, 'all_reduce', s, mode):.1f}" for s in decode)
            nccl = ", ".join(f"{t[(s, 'nccl-raw', mode)]:.1f}" for s in decode)
            lines.append(
                f"- graph, decode sizes 4-64 KiB: ours {ours} us, NCCL {nccl} us; min {vs:.2f}x "
                f"(target >= 2x: {met(vs >= 2)})"
            )
        lines.append(
            f"- {mode}: 4-256 KiB ours vs NCCL min {vs_nccl:.2f}x (target >= 3x: {met(vs_nccl >= 3)}); "
            f"vs torch symm min {vs_torch:.2f}x (target >= 1: {met(vs_torch >= 1)}); "
            f"1-4 MiB vs NCCL min {vs_nccl_mid:.2f}x (target >= 1.5x: {met(vs_nccl_mid >= 1.5)}); "
            f"auto worst {auto_worst:.2f} of the better backend (target <= 1.05: {met(auto_worst <= 1.05)})"
        )
    return lines + [""]


def nccl_window(args, device, world: int, rank: int) -> None:
    """NCCL all-reduce (bf16, in place) on torch symmetric-memory buffers of its NCCL backend (registered as
    NCCL symmetric windows) against ordinary buffers, eager and graph; appends one table."""
    import torch.distributed._symmetric_memory as symm_mem

    lines = []
    try:
        symm_mem.set_backend("NCCL")
        sizes, s = [], args.min_kib * KIB
        while s <= args.max_mib * MIB:
            sizes.append(s)
            s *= 2
        name = dist.group.WORLD.group_name
        for nbytes in sizes:
            n = nbytes // 2
            win = symm_mem.empty(n, dtype=torch.bfloat16, device=device)
            symm_mem.rendezvous(win, name)
            plain = torch.empty(n, dtype=torch.bfloat16, device=device)
            for buf in (win, plain):
                buf.copy_(torch.randn(n, device=device))
            ref = win.float()
            dist.all_reduce(ref)
            dist.all_reduce(win)
            ok = close(win, ref, torch.bfloat16)
            k, reps = counts(nbytes, args.scale)
            row = [fmt_size(nbytes)]
            for buf in (plain, win):
                for timer in (time_eager, time_graph):
                    local = timer(lambda buf=buf: dist.all_reduce(buf), k, reps, device)
                    everyone = [None] * world
                    dist.all_gather_object(everyone, local)
                    row.append(f"{max(everyone):.1f}")
            lines.append("| " + " | ".join(row + ["yes" if ok else "WRONG"]) + " |")
            if rank == 0:
                print(lines[-1], flush=True)
    except Exception as e:  # noqa: BLE001 - report what this torch / NCCL cannot do, and stop
        lines.append(f"(stopped: {type(e).__name__}: {e})")
    if rank == 0:
        props = torch.cuda.get_device_properties(device)
        head = [
            f"## NCCL on symmetric windows: {world}x {props.name}, {datetime.date.today().isoformat()}",
            "",
            "Command: `export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1; "
            f"torchrun "
            f"--nproc-per-node {world} benchmarks/comm.py {' '.join(sys.argv[1:])}`  ",
            f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}; "
            "bf16 all-reduce in place "
            "(dist.all_reduce), us, slower rank, median of R batches of K calls. window = a buffer from "
            "torch's symmetric memory with its NCCL backend (ncclCommWindowRegister).",
            "",
            "| size | plain eager | plain graph | window eager | window graph | matches |",
            "|---|---|---|---|---|---|",
        ]
        text = "\n".join(head + lines + [""])
        print(text, flush=True)
        with open(args.results, "a") as f:
            f.write("\n" + text + "\n")


def main():
    args = parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    world, rank = dist.get_world_size(), dist.get_rank()
    if args.nccl_window:
        nccl_window(args, device, world, rank)
        dist.destroy_process_group()
        return
    max_bytes = args.max_mib * MIB
    os.environ["TPFRAME_SYMM_BUFFER_MB"] = str(world * args.max_mib + 1)  # push all-reduce: world slots
    comm = Communicator(backend="auto")
    if comm.symm is None:
        raise SystemExit("symmetric memory did not set up on this machine: nothing to compare")
    impls = Impls(comm, max_bytes, device)
    sizes = []
    s = args.min_kib * KIB
    while s <= max_bytes:
        sizes.append(s)
        s *= 2

    results = {}
    ar_names = ["nccl-raw", "nccl", "nccl-donate", "torch-1shot", "torch-2shot"] + list(OUR_ALGOS.values())
    for dname in args.dtypes.split(","):  # bf16 first: the numbers that matter most come back first
        for op in args.ops.split(","):
            names = ar_names if op == "all_reduce" else ["nccl", "ours"]
            if op == "all_reduce" and dname != "bf16":
                names = [n for n in names if not n.startswith("torch")]
            sz = [s for s in sizes if op != "reduce_scatter" or s % (world * 16) == 0]
            local = measure(impls, op, DTYPES[dname], sz, names, args.scale, device, world, rank)
            res = slowest_rank(local, world)
            res.update(sizes=sz, names=names + ["auto"])
            results[(op, dname)] = res
            if rank == 0:  # partial results in the log, in case the run is cut short
                res["times"].update({(s_, "auto", m): float("nan") for s_ in sz for m in ("eager", "graph")})
                for mode in ("eager", "graph"):
                    print("\n".join(table_md(op, dname, res, world, mode)), flush=True)

    # thresholds from these numbers, then `auto` timed with them
    new = thresholds_for(results, world)
    covered = {(op, select.DTYPE_NAMES[DTYPES[d]]): res["sizes"][-1] for (op, d), res in results.items()}
    props = torch.cuda.get_device_properties(device)
    meta = {
        "device": f"{world}x {props.name}",
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["benchmarks/comm.py"] + sys.argv[1:]),
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    path = Path(args.thresholds)
    if rank == 0:
        table = merge_thresholds(path, new, world, meta, covered)
        path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    device_barrier(device)
    os.environ[select.THRESHOLDS_ENV] = str(path.resolve())
    select.clear_cache()
    comm._plans.clear()
    comm.symm._algos.clear()
    # auto against the two backends it chooses between, all through the same Communicator dispatch and
    # interleaved size by size (the machine drifts by ~10% between passes a minute apart)
    comm._plans.clear()
    impls.forced = {name: forced(comm, name) for name in ("nccl", "symm")}
    for (op, dname), res in results.items():
        local = measure(impls, op, DTYPES[dname], res["sizes"], COMM_NAMES, args.scale, device, world, rank)
        got = slowest_rank(local, world)
        res["times"].update(got["times"])
        res["ok"].update(got["ok"])
        res["names"] = [n for n in res["names"] if n != "auto"] + COMM_NAMES

    overhead = cpu_overhead(impls, device)  # after the thresholds: auto takes its real path
    if rank == 0:
        print("\n".join(["host overhead per call (8 KiB bf16 all-reduce):"] + overhead), flush=True)
        cmd = "torchrun --nproc-per-node {} {}".format(world, meta["command"])
        lines = [
            f"## Collectives: {meta['device']}, {meta['date']}",
            "",
            f"Command: `export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1; {cmd}`  ",
            f"torch {meta['torch']}, triton {meta.get('triton', '-')}, NCCL {meta['nccl']}; NVLink multicast off; "
            f"symm: peer pointers and signal pads only.  ",
            "Latency (us): median over R batches of K back-to-back calls, slower rank; eager = launched from "
            "Python, graph = the K calls captured in one CUDA graph and replayed. Random normal data.  ",
            "Bus bandwidth = 2(n-1)/n * bytes / t for all-reduce, (n-1)/n * bytes / t for all-gather and "
            "reduce-scatter; bytes = the largest tensor (all-reduce input, all-gather output, reduce-scatter input).  ",
            "nccl-raw = dist.all_reduce in place; nccl = tpframe's NCCL backend (out of place: clone + all-reduce); "
            "nccl-donate = the same backend on a donated input (in place, no copy: what the layers call); "
            "torch-1shot = torch.ops.symm_mem.one_shot_all_reduce_copy (staging included); torch-2shot = copy into "
            "the symmetric buffer + two_shot_all_reduce_out; ours-1shot (pull from peers), ours-push (write into "
            "peers), ours-2shot, ours = tpframe symm kernels (staging fused in the kernel); "
            "auto = Communicator(backend='auto') with the thresholds this run wrote. "
            "comm-nccl / comm-symm = the same Communicator forced to one backend (same dispatch cost). "
            "'ours vs X' = X time / our fastest kernel's time; 'auto vs best comm' = auto time / "
            "min(comm-nccl, comm-symm).",
            "",
        ]
        if ("all_reduce", "bf16") in results:
            lines += targets_md(results[("all_reduce", "bf16")], world)
        lines += ["**Host time per eager call** (8 KiB bf16 all-reduce; the eager floor)", ""] + overhead + [""]
        for (op, dname), res in results.items():
            for mode in ("eager", "graph"):
                lines += table_md(op, dname, res, world, mode)
        bad = [(op, d, key) for (op, d), res in results.items() for key, good in res["ok"].items() if not good]
        lines.append(f"Correctness against NCCL in this run: {'all outputs matched' if not bad else bad}")
        lines.append("")
        text = "\n".join(lines)
        print(text, flush=True)
        with open(args.results, "a") as f:
            f.write("\n" + text + "\n")
    device_barrier(device)
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
