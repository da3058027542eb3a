"""Long-context training on several GPUs: tpframe's context parallelism (parallel.cp, both parallel.cp_comm modes)
against PyTorch's `context_parallel` ring attention on the same model, and one GPU where it fits.

    torchrun --nproc-per-node 4 benchmarks/long_context.py  # env: SHAPE SEQ CP TP CP_COMM CKPT IMPL STEPS LAYERS
    python benchmarks/long_context.py --compare [--shapes 1.3b,llama3-8b] [--seqs 32768,65536,131072] [--budget-s 540]
                                         [--gpus 4|2] [--layers N]
    python benchmarks/long_context.py --train [--shapes llama3-8b] [--seqs 131072] [--gpus 4] [--set KEY=VALUE ...]
                                       # train.py: peak vs the pre-flight's estimate, CP = --gpus

One run: tpframe's GPT (models/gpt.py) of SHAPE, bf16, one sequence of SEQ tokens per step (micro-batch 1) split
over CP ranks (TP > 1: with sequence parallelism), CKPT=full|selective|none recompute, 2 warm-up steps then STEPS
timed forward+backward steps, gradients dropped, no optimizer (benchmarks/gpt.py's timing). IMPL=tpframe attends
with tpframe/layers/context.py (CP_COMM=all_gather) or ulysses.py (all_to_all). IMPL=torch is the peer, torchtitan's
way: the same model built without CP, its SDPA calls patched by torch.distributed.tensor.experimental
.context_parallel over the CP mesh (its head-tail split of the sequence is tpframe's; rotary at each token's global
position), ROTATE=alltoall (ring attention: keys and values passed around the ring) or
allgather (torch's default). Everything but attention is then identical (tpframe's kernels, fused head + loss).
    FLOPs per step = (flops_per_token(S) - 6*L*S*A) * S: the model's matmuls and causal attention counted as half
    (GPT.flops_per_token counts the whole S x S; A = heads * head_dim); TFLOP/s per GPU divides by CP*TP GPUs.
The RESULT line also gives the activations one forward keeps (measured once) and the pre-flight's estimate of them
(tpframe/run/memory.py: activation_bytes).

--compare runs each (shape, sequence) group's jobs as subprocesses in priority order until --budget-s is spent, prints
the table and appends it to RESULTS.md: tpframe CP=4 in both modes, torch's ring attention (and its all-gather) at
CP=4, one GPU at SEQ/4 (the CP scaling column's baseline: a CP=4 row's step time over this step scaled by
flops_per_token(S)/flops_per_token(S/4), the work per GPU being the same FLOPs), the same four at CP=2 x TP=2 + SP,
and one GPU at SEQ where it fits. With --gpus 2: CP=2 (both modes, both torch rows), one GPU at SEQ/2 as the scaling
baseline, and one GPU at SEQ; --layers N runs N of each shape's layers. --train runs train.py itself (CP over --gpus
ranks, zero1 over them, full recompute, AdamW, 3 steps on the synthetic corpus; --set adds overrides, e.g.
model.layers=8 to fit one GPU) and compares its measured peak (metrics.jsonl's mem_gib) with the pre-flight's estimate.
Every program gets NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import torch
from train_runs import run_job

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = {  # model.* keys
    "1.3b": dict(layers=24, hidden=2048, heads=16, vocab_size=50304),
    "llama3-8b": dict(
        layers=32,
        hidden=4096,
        heads=32,
        kv_heads=8,
        ffn_hidden=14336,
        vocab_size=128256,
        norm="rmsnorm",
        activation="swiglu",
        bias=False,
        tie_embeddings=False,
    ),
}
SHAPES["tiny"] = dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab_size=256)  # a CPU smoke test (gloo, fp32)
NAMES = {
    "1.3b": "GPT-1.3B (LayerNorm, GELU, MHA 16 heads)",
    "llama3-8b": "Llama-3-8B shape (GQA 8 kv heads)",
    "tiny": "tiny (CPU smoke test)",
}
NO_NVLS = dict(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
RESULT = re.compile(r"step ([\d.]+) ms, ([\d.]+) tok/s, ([\d.]+) TFLOP/s per GPU, peak ([\d.]+) GiB")


def overrides(shape: str, seq: int, *, cp: int, tp: int, cp_comm: str, ckpt: str) -> list[str]:
    """The train.py overrides of one layout (the model, the layout, one sequence per step)."""
    model = [f"model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in SHAPES[shape].items()]
    return model + [
        "model.position=rotary",
        f"model.max_seq_len={seq}",
        f"train.seq_len={seq}",
        "train.micro_batch_size=1",
        "train.global_batch_size=1",
        "train.dtype=bfloat16",
        f"parallel.cp={cp}",
        f"parallel.tp={tp}",
        f"parallel.sequence_parallel={str(tp > 1).lower()}",
        f"parallel.cp_comm={cp_comm}",
        f"parallel.activation_checkpointing={'false' if ckpt == 'none' else ckpt}",
    ]


def replaced(keys: list[str], later: list[str]) -> list[str]:
    """KEY=VALUE overrides `keys` with `later`'s keys replacing theirs (load_config refuses a key given twice)."""
    names = {kv.split("=", 1)[0] for kv in later}
    return [kv for kv in keys if kv.split("=", 1)[0] not in names] + list(later)


# -- one run (under torchrun) ---------------------------------------------------------------------
def run_one() -> None:
    from tpframe.layers.context import local_positions, shard_sequence
    from tpframe.layers.mode import LayerMode
    from tpframe.models import BuildContext, build_model
    from tpframe.parallel import destroy_parallel, initialize_parallel, seed_parallel_rng
    from tpframe.run.memory import activation_bytes
    from tpframe.training.config import load_config

    e = os.environ.get
    shape, seq, cp, tp, impl = e("SHAPE", "1.3b"), int(e("SEQ", 32768)), int(e("CP", 4)), int(e("TP", 1)), e("IMPL")
    cp_comm, ckpt, steps = e("CP_COMM", "all_gather"), e("CKPT", "full"), int(e("STEPS", 3))
    layers = [f"model.layers={e('LAYERS')}"] if e("LAYERS") else []  # fewer of the shape's layers
    cfg = load_config(None, replaced(overrides(shape, seq, cp=cp, tp=tp, cp_comm=cp_comm, ckpt=ckpt), layers))
    state = initialize_parallel(tp=tp, cp=cp)
    ours, cuda = impl != "torch", state.device.type == "cuda"
    sync, allocated = (torch.cuda.synchronize, torch.cuda.memory_allocated) if cuda else (lambda: None, lambda: 0)
    ctx = BuildContext(
        state.tp_comm,
        sequence_parallel=tp > 1,
        **cfg.parallel.recompute_context(),
        rng_tracker=seed_parallel_rng(1234),
        dtype=torch.bfloat16 if cuda else torch.float32,
        device=state.device,
        mode=LayerMode(cp_comm=cp_comm),
        cp_comm=state.cp_comm if ours else None,
    )
    model = build_model(cfg.model, ctx)
    g = torch.Generator(device=state.device).manual_seed(0)  # the same sequence on every rank
    tokens = torch.randint(0, cfg.model.vocab_size, (1, seq + 1), device=state.device, generator=g)
    inp, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    mine = [shard_sequence(t, dim=1, rank=state.cp_rank, size=cp) for t in (inp, labels)]
    scope = lambda: torch.enable_grad()  # noqa: E731
    if not ours:  # the peer: torch's ring attention patches SDPA; rotary at the global positions it sharded
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import set_rotate_method

        set_rotate_method(e("ROTATE", "alltoall"))
        pos = local_positions(seq // cp, rank=state.cp_rank, size=cp, device=state.device)[None]
        model._rotary = lambda x, positions: model.rotary.at(pos, x.dtype)
        # it shards the buffers it is given head-tail, as tpframe does (`mine`); the model reads `mine` itself, since
        # torch 2.13's in-place sharding left one token of rank 0's tail chunk unmoved on CPU (2 ranks, 64 tokens)
        buffers = [inp.clone(), labels.clone()]
        scope = lambda: context_parallel(state.mesh["cp"], buffers=buffers, buffer_seq_dims=[1, 1])  # noqa: E731

    def forward():
        return model(*mine)

    def step():
        with scope():
            forward().mean().backward()
        for p in model.parameters():
            p.grad = None

    sync()
    before = allocated()
    with scope():  # the activations one forward keeps
        held = forward()
        held = (allocated() - before) / 2**30
    for _ in range(2):
        step()
    sync()
    torch.distributed.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    dt = (time.perf_counter() - t0) / steps
    m = cfg.model
    per_token = model.flops_per_token(seq) - 6 * m.layers * seq * m.heads * (m.hidden // m.heads)  # causal: half
    tflops = per_token * seq / dt / (cp * tp) / 1e12
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    estimate = activation_bytes(cfg, state.device.type) / 2**30 if ours else float("nan")
    if state.rank == 0:
        what = f"tpframe cp_comm={cp_comm}" if ours else f"torch context_parallel rotate={e('ROTATE', 'alltoall')}"
        print(
            f"RESULT {what} shape={shape} seq={seq} cp={cp} tp={tp} ckpt={ckpt}: step {dt * 1e3:.1f} ms, "
            f"{seq / dt:.1f} tok/s, {tflops:.1f} TFLOP/s per GPU, peak {peak:.2f} GiB, "
            f"activations {held:.2f} GiB (estimate {estimate:.2f})",
            flush=True,
        )
    destroy_parallel()


# -- the table (one device call) ------------------------------------------------------------------
def jobs(shape: str, seq: int, ckpt: str, gpus: int = 4, layers: int | None = None) -> list[dict]:
    """One (shape, sequence) group's runs on `gpus` GPUs (4: CP=4 and CP=2 x TP=2; 2: CP=2), most important first."""
    out, one_gpu = [], lambda s: dict(label=f"CP=1, one GPU, S={s}", gpus=1, env=dict(CP=1, TP=1, SEQ=s))  # noqa: E731
    for cp, tp in ((gpus, 1), (gpus // 2, 2)) if gpus >= 4 else ((gpus, 1),):
        layout = f"CP={cp}" + (f" x TP={tp} + SP" if tp > 1 else "")
        for label, extra in (
            ("tpframe all_gather", dict(CP_COMM="all_gather")),
            ("tpframe all_to_all", dict(CP_COMM="all_to_all")),
            ("torch ring attention", dict(IMPL="torch", ROTATE="alltoall")),
            ("torch all-gather", dict(IMPL="torch", ROTATE="allgather")),
        ):
            if label == "tpframe all_to_all" and SHAPES[shape]["heads"] // tp % cp:
                continue
            if "IMPL" in extra and not torch.cuda.is_available():  # torch's context_parallel attends on CUDA only
                continue
            out.append(dict(label=f"{layout}, {label}", gpus=gpus, env=dict(CP=cp, TP=tp, SEQ=seq, **extra)))
        if tp == 1:  # one GPU at S/gpus: the scaling column's baseline
            out.append(one_gpu(seq // gpus))
    out.append(one_gpu(seq))  # the whole sequence on one GPU, where it fits
    for job in out:
        job["env"].update(SHAPE=shape, CKPT=ckpt, **({"LAYERS": layers} if layers else {}))
    return out


def launch(job: dict, timeout: float, log: Path) -> dict:
    environ = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT), **NO_NVLS)
    environ.update({k: str(v) for k, v in job["env"].items()})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(job["gpus"])]
    cmd += [str(Path(__file__).resolve())]
    t0 = time.time()
    code, text = run_job(cmd, env=environ, timeout=timeout)
    status = f"timeout after {timeout:.0f} s" if code is None else "ok" if code == 0 else f"exit {code}"
    with open(log, "a") as f:
        f.write(f"\n===== {job['label']} | {status} | env {job['env']}\n" + "\n".join(text.splitlines()[-80:]) + "\n")
    lines = [ln for ln in text.splitlines() if ln.startswith("RESULT")]
    m = RESULT.search(lines[-1]) if lines else None
    row = dict(job, wall=time.time() - t0, status=status)
    if m:
        row.update(step_ms=float(m[1]), tokens=float(m[2]), tflops=float(m[3]), peak=float(m[4]), line=lines[-1])
    elif "out of memory" in text.lower():
        row["status"] = "out of memory"
    else:  # the first error line of the first rank that printed one
        errors = [ln.split("]: ", 1)[-1] for ln in text.splitlines() if "Error" in ln and ":" in ln]
        row["status"] += f": {errors[0][:160]}" if errors else ""
    print(f"  [{row['wall']:4.0f} s] {job['label']}: {row.get('line', row['status'])}", flush=True)
    return row


def flops_ratio(shape: str, seq: int, parts: int, layers: int | None = None) -> float:
    """flops_per_token(S) / flops_per_token(S/parts), causal attention counted half."""
    m = SHAPES[shape]
    a, d = m["heads"] * (m["hidden"] // m["heads"]), m["hidden"]
    f = m.get("ffn_hidden", 4 * d)
    kv = m.get("kv_heads", m["heads"]) * (d // m["heads"])
    mlp = d * f * (3 if m.get("activation") == "swiglu" else 2)
    n = layers or m["layers"]
    fixed = 2 * (d * (a + 2 * kv) + a * d + mlp) * n + 2 * d * m["vocab_size"]
    per = lambda s: fixed + 2 * s * a * n  # noqa: E731 - per token, forward; x3 cancels
    return per(seq) / per(seq // parts)


def compare(args) -> None:
    deadline, log = time.time() + args.budget_s, Path(args.logs) / "long_context_logs.txt"
    log.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in args.shapes.split(","):
        for seq in map(int, args.seqs.split(",")):
            group = []
            for job in jobs(shape, seq, args.recompute, args.gpus, args.layers):
                left = deadline - time.time()
                if left < 30:
                    group.append(dict(job, status="not run (budget spent)"))
                    continue
                group.append(launch(job, min(args.job_timeout_s, left), log))
            base = next((r for r in group if r["env"]["SEQ"] == seq // args.gpus and "step_ms" in r), None)
            for r in group:
                if base and "step_ms" in r and r["env"]["CP"] * r["env"]["TP"] == args.gpus:
                    r["scaling"] = r["step_ms"] / (base["step_ms"] * flops_ratio(shape, seq, args.gpus, args.layers))
            rows += [(shape, seq, r) for r in group]
    report(args, rows)


def report(args, rows) -> None:
    device = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "no GPU"
    lines = [
        f"## Long context: tpframe CP vs torch's context_parallel, {device}, {datetime.date.today().isoformat()}",
        "",
        f"Command: `python benchmarks/long_context.py --compare --gpus {args.gpus} --shapes {args.shapes} --seqs "
        f"{args.seqs} --recompute {args.recompute}" + (f" --layers {args.layers}" if args.layers else "") + "` "
        f"(one device call, every run a subprocess). torch {torch.__version__}, bf16, "
        "one sequence per step, forward+backward (no optimizer), 2 warm-up then 3 timed steps, random tokens, "
        f"recompute {args.recompute}. TFLOP/s per GPU = (flops_per_token(S) - 6*L*S*A) * S / step / GPUs (causal "
        "attention counted half). 'vs torch ring' = tokens/s over torch's ring attention (rotate=alltoall) at the "
        f"same layout. 'scaling' = step time over (the one-GPU step at S/{args.gpus}) x flops_per_token(S)/"
        f"flops_per_token(S/{args.gpus}): 1.00 is perfect, the target is <= 1.25 at CP=4. Peak GiB = "
        "torch.cuda.max_memory_allocated, rank 0.",
        "",
        "| shape | S | run | step ms | tokens/s | TFLOP/s per GPU | peak GiB | vs torch ring | scaling |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for shape, seq, r in rows:
        if "step_ms" not in r:
            lines.append(f"| {NAMES[shape]} | {seq} | {r['label']} | {r['status']} | | | | | |")
            continue
        layout = r["label"].split(",")[0]
        ring = next(
            (x for s2, q2, x in rows if (s2, q2) == (shape, seq) and x["label"] == f"{layout}, torch ring attention"),
            None,
        )
        vs = f"{r['tokens'] / ring['tokens']:.2f}x" if ring and "tokens" in ring and r["gpus"] > 1 else "-"
        scaling = f"{r['scaling']:.2f}" if "scaling" in r else "-"
        lines.append(
            f"| {NAMES[shape]} | {seq} | {r['label']} | {r['step_ms']:.0f} | {r['tokens']:,.0f} | {r['tflops']:.1f} | "
            f"{r['peak']:.1f} | {vs} | {scaling} |"
        )
    lines += ["", "Each run's RESULT line (with the activations held and the pre-flight's estimate of them):", ""]
    lines += [f"- `{r['line']}`" for _, _, r in rows if "line" in r]
    write(args, lines)


def write(args, lines: list[str]) -> None:
    text = "\n".join(lines)
    print(text, flush=True)
    if args.results:
        with open(args.results, "a") as f:
            f.write("\n" + text + "\n")


# -- train.py: measured peak against the pre-flight's estimate -------------------------------------
def train(args) -> None:
    """train.py at CP = --gpus (zero1 over the CP ranks, full recompute, AdamW), 3 steps on the synthetic corpus: its
    peak (metrics.jsonl's mem_gib, rank 0) against tpframe/run/memory.py's estimate for the same config."""
    n, sets = args.gpus, " ".join(args.set)
    modes = args.modes.split(",") if n > 1 else ["all_gather"]  # CP=1: no CP collective, one row
    lines = [
        f"## Long context: train.py's peak memory against the pre-flight's estimate, {datetime.date.today()}",
        "",
        f"Command: `python benchmarks/long_context.py --train --gpus {n} --shapes {args.shapes} --seqs {args.seqs} "
        f"--modes {args.modes}" + (f" --set {sets}" if sets else "") + f"`. train.py, {n} GPU(s), parallel.cp={n}, "
        "dp_strategy=zero1, full recompute, bf16, 3 steps of one sequence; peak = metrics.jsonl's mem_gib "
        "(torch.cuda.max_memory_allocated, rank 0) after step 3; estimate = tpframe/run/memory.py's total (what "
        "train.check_memory compares with the device; its 'overhead', the CUDA context and NCCL's buffers, is outside "
        "max_memory_allocated, so 'estimate / peak' leaves it out). Target: within 10%.",
        "",
        "| shape | S | cp_comm | tokens/s | TFLOP/s per GPU (train.py's count) | peak GiB | estimate GiB | "
        "estimate / peak | estimate parts |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for shape in args.shapes.split(","):
        for seq in map(int, args.seqs.split(",")):
            lines += [train_row(args, shape, seq, mode) for mode in modes]
    write(args, lines)


def train_row(args, shape: str, seq: int, mode: str) -> str:
    """One train.py run of `shape` at `seq` tokens, CP = --gpus with cp_comm `mode`: its table row."""
    from tpframe.run.memory import GIB
    from tpframe.run.preflight import dry_build, estimate_for
    from tpframe.training.config import load_config, validate

    n = args.gpus
    extra = ["parallel.dp_strategy=zero1", "data.source=synthetic", f"data.synthetic_tokens={64 * seq}"]
    extra += ["train.steps=3", "train.eval_interval=0", "logging.interval=1", "checkpoint.save_at_end=false"]
    over = replaced(overrides(shape, seq, cp=n, tp=1, cp_comm=mode, ckpt="full") + extra, args.set)
    cfg = load_config(None, over)
    validate(cfg, n)
    est = estimate_for(cfg, n, dry_build(cfg), device_type="cuda")
    run_dir = tempfile.mkdtemp(prefix="long_context_train_")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), str(ROOT / "train.py")]
    cmd += [*over, f"train.run_dir={run_dir}"]
    environ = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT), **NO_NVLS)
    code, text = run_job(cmd, env=environ, timeout=args.job_timeout_s)
    status = "timeout" if code is None else f"exit {code}"
    with open(Path(args.logs) / "long_context_logs.txt", "a") as f:
        f.write(f"\n===== train.py {shape} {seq} {mode} | {status}\n" + "\n".join(text.splitlines()[-60:]))
    metrics = Path(run_dir) / "metrics.jsonl"
    records = [json.loads(ln) for ln in metrics.read_text().splitlines()] if metrics.exists() else []
    last = next((r for r in reversed(records) if "mem_gib" in r), None)
    if last is None:
        tail = [ln for ln in text.splitlines() if ln.startswith("tpframe:")][:1] or text.splitlines()[-1:] or [status]
        return f"| {NAMES[shape]} | {seq} | {mode} | {status}: {tail[0][-120:]} | | | | | |"
    return (
        f"| {NAMES[shape]} | {seq} | {mode} | {last['tokens_per_s']:,.0f} | {last.get('tflops', 0):.1f} | "
        f"{last['mem_gib']:.1f} | {est.total / GIB:.1f} | {(est.total - est.overhead) / GIB / last['mem_gib']:.2f} | "
        f"{est.describe()} |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compare", action="store_true", help="tpframe's CP modes, torch's context_parallel, one GPU")
    p.add_argument("--train", action="store_true", help="train.py's measured peak against the pre-flight's estimate")
    p.add_argument("--shapes", default="1.3b,llama3-8b", help=f"comma list of {sorted(SHAPES)}")
    p.add_argument("--seqs", default="32768,65536,131072", help="sequence lengths, comma list")
    p.add_argument("--modes", default="all_gather,all_to_all", help="--train: parallel.cp_comm values")
    p.add_argument("--gpus", type=int, default=4, help="--train: GPUs, all CP ranks (1: no CP); --compare: 4 or 2")
    p.add_argument("--layers", type=int, help="--compare: fewer of each shape's layers (model.layers)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="--train: more train.py overrides")
    p.add_argument("--recompute", default="full", choices=("full", "selective", "none"))
    p.add_argument("--budget-s", type=float, default=540.0, help="stop starting jobs after this many seconds")
    p.add_argument("--job-timeout-s", type=float, default=240.0)
    p.add_argument("--logs", default=os.environ.get("OUT", "/tmp"), help="folder for long_context_logs.txt")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    args = p.parse_args()
    if args.compare and args.gpus not in (2, 4):
        p.error(f"--compare lays runs out on 4 GPUs (CP=4, CP=2 x TP=2) or 2 (CP=2), not --gpus {args.gpus}")
    if args.layers is not None and args.layers < 1:
        p.error(f"--layers must be at least 1, not {args.layers}")
    for key in args.shapes.split(","):
        if key not in SHAPES:
            p.error(f"--shapes: {key!r} is not one of {sorted(SHAPES)}")
    if args.train:
        train(args)
    elif args.compare:
        compare(args)
    else:
        run_one()


if __name__ == "__main__":
    main()
