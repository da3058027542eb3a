"""Pipeline parallelism on N GPUs: PP=N with each schedule next to TP=N+SP and DP=N, same global batch.

    python benchmarks/pipeline.py                          # 2 GPUs, GPT-1.3B shapes, bf16; nproc=4 or 8 for more
    python benchmarks/pipeline.py hidden=64 layers=4 heads=4 seq=64 vocab=512 dtype=float32 \\
        steps=3 warmup=1 append=0                          # CPU dry run (gloo)

The driver runs each layout as its own `torchrun --nproc-per-node nproc` worker (a fresh process group and
GPU memory per row, a row that fails or hangs past `row_timeout` seconds is reported and skipped), collects
the RESULT lines and prints one table.

Every layout runs full optimizer steps as train.py does (Trainer.train_step: schedule, DP sync, clip,
AdamW with fp32 masters, strategy ddp) on random tokens: `gbs` sequences of `seq` tokens per step, in
micro-batches of `mb` (PP=N and TP=N: gbs/mb micro-batches; DP=N: N times fewer per rank). Step time is
the median of `steps` steps after `warmup`. FLOPs per step = flops_per_token * gbs * seq with
flops_per_token = 3 * (L * (24 h^2 + 4 s h) + 2 h V) (Megatron's 72 L h^2 + 12 L h s + 6 h V per token).
Bubble: each pipeline rank's idle time (waiting on its neighbours' activations/gradients, and for the
loss at the end), timed with CUDA events around the waits, over the schedule's time; theory with equal
F, B, W costs: (p-1)/(m+p-1) for 1F1B and AFAB, (p-1)/(v*m+p-1) interleaved, (p-1)/(3m+p-1) ZB-H1.
Keys (argv key=value, or env in upper case): hidden layers heads seq vocab mb gbs steps warmup dtype
layouts (comma-separated: pp-afab pp-1f1b pp-interleaved pp-zb_h1 tp-sp dp; a non-pipelined one may end in
+compile (train.compile: every block compiled) and/or +graph (train.cuda_graph: forward+backward replayed from CUDA
graphs, captured in the third warm-up step, so warmup >= 3), e.g. tp-sp,tp-sp+compile,tp-sp+compile+graph) virtual
(chunks per rank for pp-interleaved) comm nproc row_timeout append (0: print only) fwdbwd (1: the non-pipelined
rows also time the same model's bare forward+backward, gradients dropped and no optimizer, as benchmarks/gpt.py
does, before the strategy exists, and the table gives the full step's overhead over it and where it goes: the
trainer's GPU-timeline phases grad_sync and optim) profile (a path: rank 0 writes a torch.profiler table of one more
train step there, one file per layout).
Appends the table, the command and the device to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
for _key, _value in NO_MULTICAST.items():
    os.environ.setdefault(_key, _value)  # never NVLink multicast on the GPU machines

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from train_runs import run_job  # noqa: E402

from tpframe.errors import ConfigError  # noqa: E402
from tpframe.models import BuildContext, build_stages  # noqa: E402
from tpframe.models.compile import compile_model  # noqa: E402
from tpframe.optim import build_strategy  # noqa: E402
from tpframe.parallel import destroy_parallel, initialize_parallel, seed_parallel_rng  # noqa: E402
from tpframe.parallel.graphed import GraphedForwardBackward  # noqa: E402
from tpframe.parallel.pipeline import StageTimer, build_pipeline, theoretical_bubble  # noqa: E402
from tpframe.parallel.schedules import forward_backward_no_pipelining  # noqa: E402
from tpframe.training.config import from_dict, validate  # noqa: E402
from tpframe.training.trainer import Trainer  # noqa: E402

DEFAULTS = dict(
    hidden=2048,
    layers=24,
    heads=16,
    seq=2048,
    vocab=50304,
    mb=2,
    gbs=16,
    steps=10,
    warmup=3,
    dtype="bfloat16",
    comm="auto",
    append=1,
    nproc=2,
    row_timeout=600,
    virtual=2,
    layouts="pp-afab,pp-1f1b,pp-interleaved,pp-zb_h1,tp-sp,dp",
    fwdbwd=0,
    profile="",
)


MODIFIERS = ("compile", "graph")


def split_name(name: str) -> tuple[str, set[str]]:
    """'tp-sp+compile+graph' -> ('tp-sp', {'compile', 'graph'})."""
    base, *mods = name.split("+")
    return base, set(mods)


def layout(name: str, world: int, virtual: int) -> tuple[int, int, str | None, int]:
    """(tp, pp, schedule, virtual stages) of a layout over `world` GPUs."""
    name = split_name(name)[0]
    if name.startswith("pp-"):
        schedule = {"pp-interleaved": "interleaved_1f1b"}.get(name, name[3:])
        return 1, world, schedule, virtual if schedule == "interleaved_1f1b" else 1
    return {"tp-sp": (world, 1, None, 1), "dp": (1, 1, None, 1)}[name]


LAYOUTS = ("pp-afab", "pp-1f1b", "pp-interleaved", "pp-zb_h1", "tp-sp", "dp")


def options(argv: list[str]) -> dict:
    opts = {k: type(v)(os.environ.get(k.upper(), v)) for k, v in DEFAULTS.items()}
    for item in argv:
        key, _, value = item.partition("=")
        if key not in DEFAULTS:
            raise SystemExit(f"unknown option {key!r}; known: {', '.join(DEFAULTS)}")
        opts[key] = type(DEFAULTS[key])(value)
    return opts


class RandomBatches:
    """Random tokens, one global stream sliced by DP rank like the trainer's data (so every layout
    trains on the same sequences and logs the same loss)."""

    def __init__(self, vocab: int, mb: int, seq: int, dp_rank: int, dp: int):
        self.vocab, self.mb, self.seq, self.dp_rank, self.dp = vocab, mb, seq, dp_rank, dp
        self.draws = 0  # the position: micro-steps drawn so far

    def next(self):
        gen = torch.Generator().manual_seed(1234 + self.draws)
        self.draws += 1
        tokens = torch.randint(0, self.vocab, (self.mb * self.dp, self.seq + 1), generator=gen)
        tokens = tokens[self.dp_rank * self.mb : (self.dp_rank + 1) * self.mb]
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def state_dict(self) -> dict:  # the trainer's step guard rewinds the data to re-run a non-finite step
        return {"draws": self.draws}

    def load_state_dict(self, state: dict) -> None:
        self.draws = state["draws"]


class Quiet:
    def info(self, message: str) -> None:
        print(message, flush=True)


def run_layout(name: str, o: dict, world: int) -> dict:
    tp, pp, schedule, v = layout(name, world, o["virtual"])
    mods = split_name(name)[1]
    dp = world // (tp * pp)
    cfg = from_dict(
        {
            "model": dict(
                vocab_size=o["vocab"],
                hidden=o["hidden"],
                layers=o["layers"],
                heads=o["heads"],
                max_seq_len=o["seq"],
                position="rotary",
                vocab_multiple=128,
            ),
            "parallel": dict(tp=tp, pp=pp, sequence_parallel=tp > 1, pp_schedule=schedule or "1f1b", virtual_stages=v),
            "train": dict(
                steps=o["warmup"] + o["steps"],
                seq_len=o["seq"],
                micro_batch_size=o["mb"],
                global_batch_size=o["gbs"],
                dtype=o["dtype"],
                compile="compile" in mods,
                cuda_graph="graph" in mods,
            ),
            "optim": dict(warmup_steps=0, decay="constant", lr=1e-4),
            "comm": dict(backend=o["comm"]),
        }
    )
    validate(cfg, world)
    dtype = getattr(torch, o["dtype"])
    state = initialize_parallel(tp=tp, pp=pp, comm_backend=o["comm"])
    try:
        tracker = seed_parallel_rng(1234)
        ctx = BuildContext(
            state.tp_comm, sequence_parallel=tp > 1, rng_tracker=tracker, dtype=dtype, device=state.device, seed=1234
        )
        model = build_stages(cfg.model, ctx, pp_rank=state.pp_rank, pp=pp, virtual_stages=v)
        if "compile" in mods:
            compile_model(model)
        bare_ms = time_forward_backward(model, o, state, dp) if o["fwdbwd"] and pp == 1 else None
        strategy = build_strategy("ddp", model, cfg.optim, state, compute_dtype=dtype)
        timer = StageTimer(state.device)
        forward_backward = GraphedForwardBackward() if "graph" in mods else forward_backward_no_pipelining
        if pp > 1:
            pipeline = build_pipeline(
                state,
                schedule=schedule,
                virtual_stages=v,
                seq_len=o["seq"],
                micro_batch_size=o["mb"],
                hidden=o["hidden"],
                sequence_parallel=False,
                dtype=dtype,
                timer=timer,
            )
            forward_backward = pipeline.forward_backward
        trainer = Trainer(
            cfg,
            state,
            model,
            strategy,
            RandomBatches(o["vocab"], o["mb"], o["seq"], state.dp_rank, dp),
            None,
            Quiet(),
            forward_backward=forward_backward,
        )
        cuda = state.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times, bubbles, loss = [], [], float("nan")
        for step in range(o["warmup"] + o["steps"]):
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            loss = trainer.train_step()["loss"]
            if cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            idle, span = timer.pop()
            if step == o["warmup"] - 1:
                trainer.timers.window()  # the phase means below cover the timed steps only
            if step >= o["warmup"]:
                times.append(elapsed)
                bubbles.append(idle / span if span > 0 else float("nan"))
        phases = trainer.timers.window()
        if o["profile"]:
            from gpt import profile_step  # benchmarks/gpt.py: the profiler table, trace and GPU idle time

            profile_step(trainer.train_step, f"{o['profile']}.{name.replace('+', '_')}.txt", state.rank)
        mine = {
            "stage": state.pp_rank,
            "bubble": statistics.median(bubbles) if pp > 1 else None,
            "mem": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
        }
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine)
        step_time = statistics.median(times)
        tokens = o["gbs"] * o["seq"]
        return {
            "name": name,
            "mods": sorted(mods),
            "tp": tp,
            "pp": pp,
            "dp": dp,
            "schedule": schedule,
            "v": v,
            "micro": o["gbs"] // (o["mb"] * dp),
            "step_ms": step_time * 1e3,
            "tokens_s": tokens / step_time,
            "tflops": model.flops_per_token(o["seq"]) * tokens / step_time / world / 1e12,
            "bubbles": [e["bubble"] for e in sorted(everyone, key=lambda e: e["stage"])] if pp > 1 else None,
            "mem": max(e["mem"] for e in everyone),
            "loss": loss,
            "fwd_bwd_ms": bare_ms,
            "phases": {k: round(v, 2) for k, v in phases.items()},
            "device": torch.cuda.get_device_name() if cuda else "cpu (gloo)",
        }
    finally:
        destroy_parallel()


def time_forward_backward(model, o: dict, state, dp: int) -> float:
    """Median ms of the bare forward+backward of one step's micro-batches (gradients dropped, no optimizer,
    no gradient buffer yet): what benchmarks/gpt.py times, on this row's model and data."""
    data = RandomBatches(o["vocab"], o["mb"], o["seq"], state.dp_rank, dp)
    micro = o["gbs"] // (o["mb"] * dp)
    batches = [tuple(t.to(state.device) for t in data.next()) for _ in range(micro)]
    cuda = state.device.type == "cuda"
    times = []
    for i in range(o["warmup"] + o["steps"]):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for inp, labels in batches:
            model(inp, labels).mean().backward()
        for p in model.parameters():
            p.grad = None
        if cuda:
            torch.cuda.synchronize()
        if i >= o["warmup"]:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def label(r: dict) -> str:
    return (
        f"tp={r['tp']} pp={r['pp']} dp={r['dp']}"
        + (" sp" if r["tp"] > 1 else "")
        + "".join(f" +{m}" for m in r.get("mods", []))
    )


def table(rows: list[dict], o: dict, device: str) -> str:
    base = min(r["step_ms"] for r in rows)
    lines = [
        f"GPT L={o['layers']} h={o['hidden']} heads={o['heads']} V={o['vocab']} seq={o['seq']}, {o['dtype']}, "
        f"global batch {o['gbs']} x {o['seq']} tokens, micro-batch {o['mb']}, full optimizer steps (ddp, AdamW), "
        f"median of {o['steps']} after {o['warmup']} warm-up, on {device}",
        "",
        "| layout | schedule | micro-batches per rank | step ms | vs best | tokens/s | TFLOP/s per GPU | peak mem GiB "
        "| bubble per stage (measured) | bubble theory (p-1)/(m+p-1) | schedule theory | loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    bare = [r for r in rows if r.get("fwd_bwd_ms")]
    for r in rows:
        if r["pp"] > 1:
            m, p = r["micro"], r["pp"]
            measured = " / ".join(f"{b:.3f}" for b in r["bubbles"]) + f" (mean {statistics.mean(r['bubbles']):.3f})"
            theory = f"{(p - 1) / (m + p - 1):.3f}"
            own = f"{theoretical_bubble(r['schedule'], p, m, r['v']):.3f}"
            schedule = r["schedule"] + (f" v={r['v']}" if r["v"] > 1 else "")
        else:
            measured = theory = own = "-"
            schedule = "-"
        layout = label(r)
        lines.append(
            f"| {layout} | {schedule} | {r['micro']} | {r['step_ms']:.1f} | {r['step_ms'] / base:.2f}x "
            f"| {r['tokens_s']:.0f} | {r['tflops']:.1f} | {r['mem']:.1f} | {measured} | {theory} | {own} "
            f"| {r['loss']:.3f} |"
        )
    if bare:
        lines += [
            "",
            "Full optimizer step against the bare forward+backward of the same model and micro-batches "
            "(gradients dropped, no optimizer); phases: the trainer's GPU-timeline means over the timed steps.",
            "",
            "| layout | fwd+bwd ms | train step ms | overhead | train / fwd+bwd throughput | phases ms |",
            "|---|---|---|---|---|---|",
        ]
        for r in bare:
            layout = label(r)
            phases = ", ".join(f"{k.removesuffix('_ms')} {v:.1f}" for k, v in r["phases"].items())
            lines.append(
                f"| {layout} | {r['fwd_bwd_ms']:.1f} | {r['step_ms']:.1f} "
                f"| {r['step_ms'] - r['fwd_bwd_ms']:.1f} ms ({r['step_ms'] / r['fwd_bwd_ms'] - 1:.1%}) "
                f"| {r['fwd_bwd_ms'] / r['step_ms']:.3f}x | {phases} |"
            )
    return "\n".join(lines)


def worker(o: dict) -> None:
    """Under torchrun: run the one layout `o["layouts"]` names; rank 0 prints its RESULT line."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    try:
        row = run_layout(o["layouts"], o, dist.get_world_size())
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps(row), flush=True)
    except ConfigError as e:  # every rank alike, before any group is built
        if dist.get_rank() == 0:
            print("SKIPPED " + str(e), flush=True)
    dist.destroy_process_group()


def main(argv: list[str]) -> None:
    o = options(argv)
    if "RANK" in os.environ:
        return worker(o)
    names = [n for n in o["layouts"].split(",") if n]
    unknown = [n for n in names if split_name(n)[0] not in LAYOUTS or not split_name(n)[1] <= set(MODIFIERS)]
    if unknown:
        raise SystemExit(
            f"unknown layouts {unknown}; known: {', '.join(LAYOUTS)}, the non-pipelined ones with "
            f"+compile and/or +graph"
        )
    if any(split_name(n)[1] and n.startswith("pp-") for n in names):
        raise SystemExit("+compile and +graph apply to the non-pipelined layouts (tp-sp, dp) only")
    if any("graph" in split_name(n)[1] for n in names) and o["warmup"] < 3:
        raise SystemExit(f"a +graph layout captures in its third step; give warmup=3 or more (got {o['warmup']})")
    world = o["nproc"]
    rows, notes = [], []
    for name in names:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={world}",
            __file__,
            *[a for a in argv if not a.startswith("layouts=")],
            f"layouts={name}",
        ]
        env = {**os.environ, **NO_MULTICAST, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        code, output = run_job(cmd, env=env, timeout=o["row_timeout"])
        if code is None:
            notes.append(f"{name}: no result within row_timeout={o['row_timeout']}s")
            print(notes[-1], flush=True)
            continue
        lines = output.splitlines()
        result = [line[len("RESULT ") :] for line in lines if line.startswith("RESULT ")]
        skipped = [line[len("SKIPPED ") :] for line in lines if line.startswith("SKIPPED ")]
        if result:
            rows.append(json.loads(result[0]))
            r = rows[-1]
            print(
                f"{name}: step {r['step_ms']:.1f} ms, {r['tflops']:.1f} TFLOP/s per GPU, bubble {r['bubbles']}",
                flush=True,
            )
        else:
            notes.append(
                f"{name}: skipped ({skipped[0]})"
                if skipped
                else f"{name}: failed (exit {code}): {output.strip().splitlines()[-1:]}"
            )
            print(notes[-1] + ("" if skipped else "\n" + output[-3000:]), flush=True)
    device = f"{rows[0]['device'] if rows else '?'} x{world}"
    text = table(rows, o, device) if rows else "no layout ran"
    text += "".join(f"\n\n{n}" for n in notes)
    print("\n" + text, flush=True)
    if o["append"]:
        command = " ".join(["python benchmarks/pipeline.py", *argv])
        with open(Path(__file__).resolve().parent / "RESULTS.md", "a") as f:
            f.write(
                f"\n## Pipeline parallelism, {time.strftime('%Y-%m-%d')}\n\n`{command}` on {device}, "
                f"torch {torch.__version__}\n\n{text}\n"
            )


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__)
    else:
        main(sys.argv[1:])
