"""Data-parallel strategies, full optimizer steps: step time and peak memory per GPU, ours side by side.

    python benchmarks/data_parallel.py                 # driver: DP=1, then DP=2 with each strategy; table -> RESULTS.md
    NPROC=4 python benchmarks/data_parallel.py         # DP=4 (and DP=1) on a 4-GPU machine
    CKPT=1 python benchmarks/data_parallel.py          # with activation checkpointing (activations no longer dominate)
    APPEND=0 LAYERS=2 HIDDEN=64 HEADS=4 SEQ=64 MB=2 STEPS=3 python benchmarks/data_parallel.py   # CPU dry run (gloo)
    ROWS="DP=1;ddp, overlap on" PROFILE=/tmp/dp python benchmarks/data_parallel.py   # some rows; a profiled step each
    GRAPH=1 LAYERS=12 HIDDEN=768 HEADS=12 SEQ=1024 MB=16 python benchmarks/data_parallel.py  # GPT-125M, CUDA-graphed
    PHASES=1 ROWS="DP=1;ddp, overlap on" python benchmarks/data_parallel.py   # each rank's step split into phases

Each row is one `torchrun` worker run: a GPT (LayerNorm, rotary, GELU, biases, tied, V=50304; GPT-1.3B
shape by default: L=24 H=2048 16 heads, seq 2048, micro-batch 8 per GPU, bf16) trained on random
tokens with the real step (schedule -> grad sync -> clip -> AdamW), 3 warm-up steps, then the median
of STEPS timed steps. Every GPU does the same work in every row (micro-batch MB, ACCUM micro-batches),
so a perfect DP=N step takes as long as DP=1's. FLOPs per step per GPU: (72*L*H^2*T + 12*L*H*S*T +
6*H*V*T) with T = MB*ACCUM*SEQ tokens. Peak memory is torch.cuda.max_memory_allocated on rank 0; "resident" is
what stays allocated between steps (weights, gradient buffer, optimizer state: what the strategies shard), and
peak - resident is what a step adds on top (activations, the bf16 gradients in flight, collective buffers),
which no DP strategy shards: it sets how far zero1/fsdp can bring the peak down. Each row also gives every
rank's own median step (a slower GPU paces the whole DP group). PROFILE=folder profiles one more step per row
(rank 0's chrome trace and op table there) and adds its GPU timeline: busy time, how long the collectives ran
and how much of that no computation hid. GRAPH=1 replays each micro-batch from a CUDA graph (train.cuda_graph's
schedule, tpframe/parallel/graphed.py) after two eager steps, the gradient sync after the replays; fsdp rows are
skipped (not graphed); CUDA only. PHASES=1 (CUDA) prints, per
row and rank, the medians of every timed step split at its phases (forward+backward, the grad sync's wait, clip,
optimizer), by the host's clock and by CUDA events on the compute stream: whether a DP step's extra time is a slower
backward, a wait for the gradients, or the host.
The "torch ... peer" rows run benchmarks/peer_dp.py: the same model in plain PyTorch under torch's DDP (nanoGPT's
way: fp32 weights, bf16 autocast, fp32 gradient all-reduce overlapped with backward) or FSDP2 (torchtitan's way);
their "vs its DP=1" divides by the peer's own DP=1 row: how much gradient traffic PyTorch's own DP hides here.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ROWS = [  # (name, strategy, overlap_grad_sync, nproc: "1" = DP=1 baseline, "N" = NPROC, "1xN" = N independent DP=1
    #        runs, parallel.grad_reduce_dtype)
    ("DP=1", "ddp", True, "1", "float32"),
    ("DP=1 on every GPU at once (no DP traffic)", "ddp", True, "1xN", "float32"),
    ("ddp, overlap off", "ddp", False, "N", "float32"),
    ("ddp, overlap on", "ddp", True, "N", "float32"),
    ("ddp, overlap on, bf16 reduce", "ddp", True, "N", "bfloat16"),
    ("zero1", "zero1", True, "N", "float32"),
    ("zero1, bf16 reduce", "zero1", True, "N", "bfloat16"),
    ("fsdp", "fsdp", True, "N", "float32"),
    ("fsdp, bf16 reduce", "fsdp", True, "N", "bfloat16"),
    # PyTorch's own DP on the same model (benchmarks/peer_dp.py), each divided by its own DP=1 row
    ("torch peer, DP=1", "peer:ddp", True, "1", "float32"),
    ("torch DDP peer (nanoGPT's way)", "peer:ddp", True, "N", "float32"),
    ("torch FSDP2 peer (torchtitan's way)", "peer:fsdp", True, "N", "float32"),
]


def env(name: str, default) -> int:
    return type(default)(os.environ.get(name, default))


def worker(strategy: str, overlap: bool, reduce_dtype: str = "float32") -> None:
    import torch

    from tpframe.models import BuildContext, build_model
    from tpframe.models.config import ModelConfig
    from tpframe.optim import OptimConfig, build_strategy
    from tpframe.parallel import destroy_parallel, initialize_parallel, seed_parallel_rng
    from tpframe.parallel.graphed import GraphedForwardBackward
    from tpframe.parallel.schedules import forward_backward_no_pipelining

    state = initialize_parallel(tp=1)
    cuda = state.device.type == "cuda"
    H, L, NH, S, MB, ACCUM, STEPS = (
        env("HIDDEN", 2048),
        env("LAYERS", 24),
        env("HEADS", 16),
        env("SEQ", 2048),
        env("MB", 8),
        env("ACCUM", 1),
        env("STEPS", 10),
    )
    V = 50304
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = ModelConfig(vocab_size=V, hidden=H, layers=L, heads=NH, max_seq_len=S, position="rotary", vocab_multiple=128)
    tracker = seed_parallel_rng(1234)
    model = build_model(
        cfg,
        BuildContext(
            state.tp_comm,
            rng_tracker=tracker,
            device=state.device,
            dtype=torch.float32 if strategy == "fsdp" else dtype,
            activation_checkpointing=env("CKPT", 0) == 1,
        ),
    )
    opt = build_strategy(
        strategy,
        model,
        OptimConfig(lr=1e-4, warmup_steps=0),
        state,
        bucket_mb=env("BUCKET_MB", 40.0),
        overlap_grad_sync=overlap,
        compute_dtype=dtype,
        reduce_dtype=getattr(torch, reduce_dtype),
    )

    class RandomBatches:  # random tokens, a fresh batch every micro-step
        g = torch.Generator(device=state.device).manual_seed(state.dp_rank)

        def next(self):
            t = torch.randint(0, V, (MB, S + 1), device=state.device, generator=self.g)
            return t[:, :-1], t[:, 1:]

    batches = RandomBatches()
    schedule = GraphedForwardBackward(warmup_steps=2) if env("GRAPH", 0) == 1 else forward_backward_no_pipelining

    phases = env("PHASES", 0) == 1 and cuda  # PHASES=1: where each timed step's time goes, host and GPU

    def step(marks: list | None = None):
        def mark(phase: str) -> None:
            if marks is not None:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                marks.append((phase, time.perf_counter(), event))

        mark("start")
        opt.zero_grad()
        loss = schedule(model, batches, ACCUM, grad_sync=opt, device=state.device)
        mark("forward+backward")
        opt.finish_grad_sync()
        mark("grad sync wait")
        opt.clip_grad_norm(1.0)
        mark("clip")
        opt.step(1e-4)
        mark("optimizer")
        return loss

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    graphed = schedule is not forward_backward_no_pipelining
    for i in range(3):
        if graphed and i == 2:  # the capture allocates the graphs' memory, which replays reuse: count it in the peak
            sync()
            torch.cuda.reset_peak_memory_stats()
        step()
    sync()
    resident = torch.cuda.memory_allocated() / 2**30 if cuda else float("nan")  # between steps
    if cuda and not graphed:
        torch.cuda.reset_peak_memory_stats()
    times, split = [], []
    for _ in range(STEPS):
        torch.distributed.barrier()
        marks = [] if phases else None
        t0 = time.perf_counter()
        loss = step(marks)
        sync()
        times.append(time.perf_counter() - t0)
        if phases:  # per phase: the host's time and the compute stream's (event to event, waits included)
            split.append(
                {
                    "wall": times[-1] * 1e3,
                    "gpu": marks[0][2].elapsed_time(marks[-1][2]),
                    **{f"host {b[0]}": (b[1] - a[1]) * 1e3 for a, b in zip(marks, marks[1:])},
                    **{f"gpu {b[0]}": a[2].elapsed_time(b[2]) for a, b in zip(marks, marks[1:])},
                }
            )
    dt = statistics.median(times)
    if phases:
        mine = {k: round(statistics.median(d[k] for d in split), 2) for k in split[0]}
        every = [None] * state.world_size
        torch.distributed.all_gather_object(every, mine)
        if state.rank == 0:
            for r, m in enumerate(every):
                print(f"PHASES rank {r} (medians, ms): {json.dumps(m)}", flush=True)
    per_rank = [None] * state.world_size  # each rank's own median: a slower GPU paces every DP step
    torch.distributed.all_gather_object(per_rank, dt)
    T = MB * ACCUM * S
    flops = 72 * L * H * H * T + 12 * L * H * S * T + 6 * H * V * T
    bf16 = "-bf16" * (reduce_dtype != "float32")
    name = f"{strategy}-overlap{int(overlap)}{bf16}-dp{state.dp}"
    profiled = profile_step(step, os.environ.get("PROFILE"), name, state.rank, cuda, sync)
    if state.rank == 0:
        print(
            "RESULT "
            + json.dumps(
                {
                    "strategy": opt.describe(),
                    "overlap": overlap,
                    "dp": state.dp,
                    "step_s": dt,
                    "tflops": flops / dt / 1e12,
                    "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
                    "opt_state_gib": opt.state_bytes() / 2**30,
                    "loss": loss.item(),
                    "resident_gib": resident,
                    "rank_step_s": per_rank,
                    **profiled,
                }
            ),
            flush=True,
        )
    destroy_parallel()


def profile_step(step, folder: str | None, name: str, rank: int, cuda: bool, sync) -> dict:
    """PROFILE=folder: one more step under torch.profiler on every rank; rank 0 writes its chrome trace and op
    table there and returns the GPU timeline: span, busy, how long collectives ran and how much of that had no
    computation beside it (the DP traffic that overlap did not hide)."""
    if not folder:
        return {}
    import torch
    from torch.profiler import ProfilerActivity, profile

    from tpframe.observe.profiler import gpu_timeline, op_table

    torch.distributed.barrier()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        step()
        sync()
    if not cuda or rank != 0:
        return {}
    Path(folder).mkdir(parents=True, exist_ok=True)
    trace = Path(folder) / f"{name}.json"
    prof.export_chrome_trace(str(trace))
    (Path(folder) / f"{name}.txt").write_text(op_table(prof, cuda=True, rows=30))
    span, busy, comm, exposed = gpu_timeline(trace)
    return {"gpu_span_ms": span, "gpu_busy_ms": busy, "comm_ms": comm, "comm_exposed_ms": exposed}


def main() -> None:
    nproc = env("NPROC", 2)
    results = []
    only = [r.strip() for r in os.environ.get("ROWS", "").split(";") if r.strip()]
    unknown = [r for r in only if r not in [row[0] for row in ROWS]]
    if unknown:
        print(
            f"ROWS: no row named {unknown[0]!r}; the rows are {'; '.join(row[0] for row in ROWS)} "
            "(separate several with ';')",
            file=sys.stderr,
        )
        raise SystemExit(2)
    for name, strategy, overlap, n, reduce_dtype in ROWS:
        if only and name not in only:
            continue
        if env("GRAPH", 0) == 1 and (strategy == "fsdp" or strategy.startswith("peer:")):
            print(f"{name}: skipped (GRAPH=1 graphs tpframe's ddp and zero1 steps only)", flush=True)
            continue
        procs = 1 if n.startswith("1") else nproc
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}"]
        cmd += (
            [str(ROOT / "benchmarks" / "peer_dp.py"), strategy[len("peer:") :]]
            if strategy.startswith("peer:")
            else [__file__, "--worker", strategy, str(int(overlap)), reduce_dtype]
        )
        # "1xN": one single-GPU run per GPU, all at once: the same per-GPU work and power draw as DP=N, no DP traffic
        copies = nproc if n == "1xN" else 1
        gpus = [
            {"CUDA_VISIBLE_DEVICES": str(i), "PROFILE": ""} if copies > 1 else {} for i in range(copies)
        ]  # DP=1 profiles
        running = [
            subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, **g}
            )
            for g in gpus
        ]
        outs = [(p.communicate(timeout=env("ROW_TIMEOUT", 300)), p.returncode) for p in running]
        (stdout, stderr), code = outs[0]
        lines = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
        if any(c for _, c in outs) or not lines:
            print(f"{name}: failed (exit {[c for _, c in outs]})\n{stderr[-2000:]}", flush=True)
            continue
        result = json.loads(lines[-1][len("RESULT ") :])
        for x in stdout.splitlines():  # PHASES=1: each rank's split of the step
            if x.startswith("PHASES "):
                print(f"{name}: {x}", flush=True)
        if copies > 1:  # one DP=1 run per GPU: each GPU's own median (a DP group is paced by its slowest GPU)
            each = [[x for x in out.splitlines() if x.startswith("RESULT ")] for (out, _), _ in outs]
            result["rank_step_s"] = [json.loads(x[-1][len("RESULT ") :])["step_s"] if x else float("nan") for x in each]
        results.append((name, result))
        print(name, results[-1][1], flush=True)
    base = next((r for n, r in results if n == "DP=1"), None)
    peer_base = next((r for n, r in results if n == "torch peer, DP=1"), None)
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    shape = (
        f"L={env('LAYERS', 24)} H={env('HIDDEN', 2048)} heads={env('HEADS', 16)} seq={env('SEQ', 2048)} "
        f"micro-batch {env('MB', 8)} x {env('ACCUM', 1)} per GPU"
        + (", activation checkpointing" if env("CKPT", 0) == 1 else "")
        + (", each micro-batch replayed from a CUDA graph" if env("GRAPH", 0) == 1 else "")
    )
    keys = "NPROC LAYERS HIDDEN HEADS SEQ MB ACCUM STEPS CKPT GRAPH BUCKET_MB ROWS PHASES NCCL_MAX_NCHANNELS".split()
    given = " ".join(
        f"{k}={os.environ[k]!r}" if k == "ROWS" else f"{k}={os.environ[k]}" for k in keys if k in os.environ
    )
    head = [
        f"\n### Data parallelism, full optimizer steps ({device} x{nproc}, torch {torch.__version__}, {shape})",
        f"`{given} python benchmarks/data_parallel.py`; median step of STEPS after 3 warm-up; every GPU does the "
        "same work per row.",
        "",
        "| run | dp | step (s) | vs its DP=1 | TFLOP/s per GPU | peak GiB | peak vs ddp | resident GiB "
        "| peak - resident GiB | optimizer state GiB | each GPU's median step (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ddp = next((r for n, r in results if n == "ddp, overlap on"), None)

    def own_base(r):  # a peer is divided by the peer's DP=1 step, tpframe's rows by tpframe's
        return peer_base if r["strategy"].startswith("torch ") else base

    rows = (
        [
            f"| {n} | {r['dp']} | {r['step_s']:.3f} | "
            f"{r['step_s'] / own_base(r)['step_s'] if own_base(r) else float('nan'):.3f}x | {r['tflops']:.0f} | "
            f"{r['peak_gib']:.1f} | {r['peak_gib'] / ddp['peak_gib'] if ddp else float('nan'):.2f}x "
            f"| {r['resident_gib']:.1f} | {r['peak_gib'] - r['resident_gib']:.1f} | {r['opt_state_gib']:.2f} "
            f"| {' / '.join(f'{t:.3f}' for t in r['rank_step_s'])} |"
            for n, r in results
        ]
        if base or peer_base
        else []
    )
    if any("comm_ms" in r for _, r in results):  # PROFILE: the profiled step's GPU timeline, rank 0
        rows += [
            "",
            "| run | profiled step: GPU span ms | GPU busy ms | collectives ms | collectives with no compute "
            "beside them ms |",
            "|---|---|---|---|---|",
        ]
        rows += [
            f"| {n} | {r['gpu_span_ms']:.1f} | {r['gpu_busy_ms']:.1f} | {r['comm_ms']:.1f} | "
            f"{r['comm_exposed_ms']:.1f} |"
            for n, r in results
            if "comm_ms" in r
        ]
    table = "\n".join(head + rows)
    print(table)
    if env("APPEND", 1):  # APPEND=0: print only (dry runs)
        with open(ROOT / "benchmarks" / "RESULTS.md", "a") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__)
    elif len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3] == "1", sys.argv[4])
    else:
        main()
