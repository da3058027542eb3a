"""Which layout to run: every (tp, pp, dp, cp, strategy, recompute, micro-batch) that fits in memory, ranked.

    python -m tpframe.plan --config configs/gpt_1.3b.yaml --gpus 4 [--gpu-gib 141] [--top 10] [--measure N]

A layout is refused with the config's own one-line reason (a size that does not divide, a schedule that needs more
micro-batches) or by the memory estimate the pre-flight uses (tpframe/run/memory.py). The rest are ranked by a cost
model of one optimizer step on one GPU (every term per micro-batch, then times the step's micro-batches):
    compute   model FLOPs (+ the recomputed forward) / (peak x efficiency), plus the launches; the efficiency falls
              as TP narrows the GEMMs, 0.72 - 154/(h/tp) (GPT-1.3B and 7B-class rows with their TP collectives
              free), and as the micro-batch shortens them, times rows/(rows + 512)
    TP        sequence-parallel all-gathers and reduce-scatters, 8 per layer per micro-batch of (tp-1)/tp * s*b*h*2
              bytes over NVLink, not overlapped; CP adds the keys' and values' all-gather
    PP        the 1F1B bubble: compute * (pp-1)/m with m micro-batches per step
    DP        the gradient sync over dp x cp, 3/4 of it exposed (the backward it runs beside slows by about that
              much); fsdp moves one and a half times the bytes; the optimizer step reads and writes its state once
The constants are H200/NVLink measurements (benchmarks/RESULTS.md); `--measure N` times the first N layouts with
train.py on the GPUs at hand and prints the table beside the prediction.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tpframe.errors import ArgumentParser, ConfigError

PEAK_TFLOPS = 989.0  # H100/H200 SXM, dense bf16
NVLINK_GBS = 360.0  # NCCL's all-gather/reduce-scatter bus bandwidth on 4x H200 (NV18), per GPU
HBM_GBS = 4000.0  # the optimizer step: state read and written, per GPU
LAUNCH_MS_PER_LAYER = 0.05  # host time a layer's forward+backward launches take, eager
RECOMPUTE = ("none", "selective", "full")
STRATEGIES = ("ddp", "zero1", "fsdp")


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    cp: int
    strategy: str
    recompute: str
    micro_batch: int

    def overrides(self) -> list[str]:
        """The train.py keys that run this layout."""
        ckpt = {"none": "false", "selective": "selective", "full": "full"}[self.recompute]
        return [
            f"parallel.tp={self.tp}",
            f"parallel.pp={self.pp}",
            f"parallel.cp={self.cp}",
            f"parallel.sequence_parallel={str(self.tp > 1).lower()}",
            f"parallel.dp_strategy={self.strategy}",
            f"parallel.activation_checkpointing={ckpt}",
            f"train.micro_batch_size={self.micro_batch}",
        ]

    def describe(self) -> str:
        return (
            f"tp {self.tp} pp {self.pp} dp {self.dp} cp {self.cp} {self.strategy} recompute {self.recompute} "
            f"mb {self.micro_batch}"
        )


@dataclass(frozen=True)
class Plan:
    layout: Layout
    memory_gib: float
    step_ms: float
    tflops: float  # model FLOPs per GPU per second, recompute not counted (MFU's numerator)


def _sizes(gpus: int) -> list[tuple[int, int, int, int]]:
    """Every (tp, pp, cp, dp) that multiplies to `gpus`, TP inside one NVLink node (at most 8)."""
    divisors = _divisors(gpus)
    return [
        (tp, pp, cp, gpus // (tp * pp * cp))
        for tp, pp, cp in itertools.product(divisors, divisors, divisors)
        if gpus % (tp * pp * cp) == 0 and tp <= 8
    ]


def layouts(cfg, gpus: int) -> list[Layout]:
    """Every combination of sizes that multiplies to `gpus`, with the micro-batches the global batch allows."""
    out = []
    for tp, pp, cp, dp in _sizes(gpus):
        per_rank = cfg.train.global_batch_size // dp if cfg.train.global_batch_size % dp == 0 else 0
        for mb, strategy, recompute in itertools.product(_divisors(per_rank), STRATEGIES, RECOMPUTE):
            if mb <= 32 and not (strategy != "ddp" and dp * cp == 1):  # zero1/fsdp shard over dp x cp: nothing at 1
                out.append(Layout(tp, pp, dp, cp, strategy, recompute, mb))
    return out


def unbatched(cfg, gpus: int) -> list[Layout]:
    """One layout (micro-batch 1) for each size whose DP does not divide the global batch: no micro-batch can, so
    `layouts` has none of them, and `plan` names them with the config's own line."""
    gb = cfg.train.global_batch_size
    return [Layout(tp, pp, dp, cp, "ddp", "none", 1) for tp, pp, cp, dp in _sizes(gpus) if gb % dp]


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def layout_config(cfg, layout: Layout):
    """`cfg` with `layout`'s keys."""
    p = dataclasses.replace(
        cfg.parallel,
        tp=layout.tp,
        pp=layout.pp,
        cp=layout.cp,
        sequence_parallel=layout.tp > 1,
        dp_strategy=layout.strategy,
        activation_checkpointing={"none": False}.get(layout.recompute, layout.recompute),
        recompute_layers=None,
        virtual_stages=cfg.parallel.virtual_stages if layout.pp > 1 else 1,  # the config's schedule, where it applies
        layers_per_stage=cfg.parallel.layers_per_stage if layout.pp == cfg.parallel.pp else None,
    )
    t = dataclasses.replace(cfg.train, micro_batch_size=layout.micro_batch)
    return dataclasses.replace(cfg, parallel=p, train=t)


def run_overrides(cfg, layout: Layout) -> list[str]:
    """The train.py keys that run `layout` on `cfg`: the layout's own, and those of `cfg`'s pipeline and recompute keys
    that `layout_config` changed."""
    planned, given = layout_config(cfg, layout).parallel, cfg.parallel
    changed = [
        k
        for k in ("virtual_stages", "layers_per_stage", "recompute_layers")
        if getattr(planned, k) != getattr(given, k)
    ]
    return layout.overrides() + [
        f"parallel.{k}={'null' if getattr(planned, k) is None else getattr(planned, k)}" for k in changed
    ]


def step_ms(cfg, layout: Layout, params: float) -> float:
    """The cost model of the module docstring: one optimizer step's milliseconds on one GPU (`params`: the trained
    parameters this rank holds)."""
    m, t = cfg.model, cfg.train
    s, b, h, tp = t.seq_len // layout.cp, layout.micro_batch, m.hidden, layout.tp
    micro = t.global_batch_size // (layout.micro_batch * layout.dp)
    flops = _flops_per_token(m, t.seq_len) * s * b / (tp * layout.pp)  # this GPU's share of one micro-batch
    flops *= {"none": 1.0, "selective": 1.03, "full": 4 / 3}[layout.recompute]
    rows = s * b  # the GEMMs' M: a small micro-batch fills the GPU less, and pays the launches more often
    efficiency = min(0.7, max(0.1, 0.72 - 154.0 / (h / tp))) * rows / (rows + 512)
    compute = flops / (PEAK_TFLOPS * 1e12 * efficiency) + LAUNCH_MS_PER_LAYER * 1e-3 * m.layers / layout.pp
    layers = m.layers / layout.pp
    tp_bytes = 8 * (tp - 1) / tp * s * b * h * 2 * layers * (1.5 if layout.recompute == "full" else 1.0)
    kv = (m.kv_heads or m.heads) * (m.head_dim or h // m.heads)
    cp_bytes = 2 * 2 * (layout.cp - 1) * s * b * kv * 2 * layers / tp
    comm = (tp_bytes + cp_bytes) / (NVLINK_GBS * 1e9)
    bubble = compute * (layout.pp - 1) / micro
    replicas = layout.dp * layout.cp  # the gradients' all-reduce (zero1, fsdp: their shards) spans dp x cp
    grads = 4 * params * (1.5 if layout.strategy == "fsdp" else 1.0)
    dp_sync = 0.75 * 2 * (replicas - 1) / replicas * grads / (NVLINK_GBS * 1e9)
    state = params * 16 / (replicas if layout.strategy != "ddp" else 1)
    optimizer = 2 * state / (HBM_GBS * 1e9)
    return 1e3 * ((compute + comm) * micro + bubble * micro + dp_sync + optimizer)


def _flops_per_token(m, seq_len: int) -> float:
    """Training FLOPs per token of a dense GPT/Llama-shaped model (the model's own formula, without building it)."""
    h, d = m.hidden, m.head_dim or m.hidden // m.heads
    q, kv = m.heads * d, (m.kv_heads or m.heads) * d
    ffn = m.ffn_hidden or (4 * h if m.activation != "swiglu" else 64 * math.ceil(8 * h / 3 / 64))
    mlp = h * (2 * ffn if m.activation == "swiglu" else ffn) + ffn * h
    layer = 2 * (h * (q + 2 * kv) + q * h + mlp) + 4 * seq_len * q
    return 3.0 * (m.layers * layer + 2 * h * m.vocab_size)


def plan(cfg, gpus: int, *, gpu_gib: float) -> tuple[list[Plan], list[tuple[Layout, str]]]:
    """(the layouts that fit, best first; the others with why not)."""
    from tpframe.run import preflight
    from tpframe.run.memory import GIB

    models: dict[int, object] = {}  # by tp: TP rank 0's whole model on the meta device (dry_build's; None: not there)
    sizes: dict[tuple, tuple[int, int, int, int] | None] = {}  # by (tp, pp): the fullest rank, as the pre-flight's
    fits, refused = [], []
    for layout in layouts(cfg, gpus) + unbatched(cfg, gpus):
        lcfg = layout_config(cfg, layout)
        try:
            check(lcfg, gpus)
            if layout.tp not in models:
                models[layout.tp] = preflight.dry_build(lcfg)
            if (layout.tp, layout.pp) not in sizes:
                model = models[layout.tp]
                sizes[layout.tp, layout.pp] = None if model is None else preflight.rank_sizes(lcfg, model)
        except ConfigError as e:
            refused.append((layout, str(e)))
            continue
        if sizes[layout.tp, layout.pp] is None:
            raise ConfigError(
                f"model.name={cfg.model.name!r} cannot be built on the meta device, so it cannot be sized"
            )
        need = preflight.estimate_for(lcfg, gpus, sizes[layout.tp, layout.pp], device_type="cuda").total / GIB
        if need > gpu_gib:
            refused.append((layout, f"needs {need:.1f} GiB per GPU, more than {gpu_gib:g}"))
            continue
        ms = step_ms(lcfg, layout, sizes[layout.tp, layout.pp][3])  # the trained parameters: synced and stepped
        tokens = cfg.train.global_batch_size * cfg.train.seq_len
        fits.append(Plan(layout, need, ms, _flops_per_token(cfg.model, cfg.train.seq_len) * tokens / gpus / ms / 1e9))
    fits.sort(key=lambda p: (p.step_ms, p.memory_gib, p.layout.tp, p.layout.pp))
    return fits, refused


def check(cfg, gpus: int) -> None:
    """What train.py's pre-flight checks of a layout before building it: the config, and that the model's builder
    supports its pipeline, context parallelism, document mask and recompute (train.py's `prepare`)."""
    from tpframe.models import (
        check_context_parallel_support,
        check_document_mask_support,
        check_pipeline_support,
        check_recompute_support,
        resolve_builder,
    )
    from tpframe.training.config import validate

    validate(cfg, gpus)
    name, p = cfg.model.name, cfg.parallel
    builder = resolve_builder(name)
    check_pipeline_support(name, builder, p.pp)
    check_context_parallel_support(name, builder, p.cp)
    check_document_mask_support(name, builder, cfg.model.attention_mask)
    check_recompute_support(name, builder, selective=p.recompute == "selective", layers=p.recompute_layers)


# a fresh run in a temporary train.run_dir that logs each step's time and neither resumes nor saves a checkpoint
MEASURED_RUN = (
    "train.eval_interval=0",
    "logging.interval=1",
    "logging.jsonl=true",
    "logging.progress=false",
    "checkpoint.dir=null",
    "checkpoint.load=null",
    "checkpoint.interval=0",
    "checkpoint.save_at_end=false",
    "checkpoint.snapshot_interval=0",
)


def measure(config: str | None, overrides: list[str], layout_keys: list[str], *, gpus: int, steps: int) -> float | str:
    """Median step milliseconds of `steps` train.py steps at a layout (`run_overrides`; the first two left out), or
    why there are none."""
    with tempfile.TemporaryDirectory() as run_dir:
        args = ["--config", config] if config else []
        keys = [*layout_keys, f"train.steps={steps}", f"train.run_dir={run_dir}", *MEASURED_RUN]
        set_here = {key.split("=", 1)[0] for key in keys}
        keys = [o for o in overrides if o.split("=", 1)[0].strip() not in set_here] + keys  # train.py: each key once
        train = str(Path(__file__).resolve().parents[1] / "train.py")  # run here: relative paths name files from here
        cmd = [sys.executable, "-m", "tpframe.launch", "--nproc-per-node", str(gpus), train, *args, *keys]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode:
            said = [line for line in run.stderr.splitlines() if line.strip()]
            return f"train.py exited with code {run.returncode}: {said[-1] if said else 'no message'}"
        metrics = Path(run_dir) / "metrics.jsonl"
        lines = metrics.read_text().splitlines() if metrics.is_file() else []
        times = sorted([r["step_ms"] for r in map(json.loads, lines) if r.get("kind") == "train"][2:])
        return times[len(times) // 2] if times else "train.py logged no step past the first two"


def _grouped(refused: list[tuple[Layout, str]]) -> list[tuple[str, list[Layout]]]:
    """The refusals by reason, most common first; the memory ones as one reason with the least memory asked."""
    groups: dict[str, list[Layout]] = {}
    memory = [(float(why.split()[1]), layout) for layout, why in refused if why.startswith("needs ")]
    for layout, why in refused:
        if not why.startswith("needs "):
            groups.setdefault(why, []).append(layout)
    if memory:
        least = min(need for need, _ in memory)
        groups[f"more memory than a GPU has (the least of them needs {least:.1f} GiB)"] = [
            layout for _, layout in memory
        ]
    return sorted(groups.items(), key=lambda item: -len(item[1]))


def _nowhere(gpus: int, gpu_gib: float, refused: list[tuple[Layout, str]]) -> str:
    """The line for a config that no layout fits: the most common reason (alone when every layout shares it: a
    mistake in the config), and how many layouts other reasons refused."""
    (why, most), *others = _grouped(refused)
    where = f"no layout fits on {gpus} GPUs of {gpu_gib:g} GiB"
    if not others:
        return f"{where}: {why}"
    rest = len(refused) - len(most)
    return (
        f"{where}: {len(most)} of {len(refused)} layouts because {why}, the other {rest} for {len(others)} other "
        "reason(s); another --gpus, a larger --gpu-gib or a smaller model may fit"
    )


def _check_args(args) -> None:
    """The numbers main was given, and GPUs enough for --measure (one node; on a machine without CUDA, CPU ranks)."""
    import torch

    if args.gpus < 1 or args.top < 1 or args.measure < 0:
        raise ConfigError("--gpus and --top must be at least 1, --measure at least 0")
    if not 0 < args.gpu_gib < math.inf:
        raise ConfigError(f"--gpu-gib={args.gpu_gib:g} must be a GPU's memory in GiB, e.g. 80 or 141")
    if args.steps < 3:
        raise ConfigError(f"--steps={args.steps} must be at least 3 (the first two steps are left out of the timing)")
    if args.measure and torch.cuda.is_available() and torch.cuda.device_count() < args.gpus:
        raise ConfigError(
            f"--measure runs train.py on {args.gpus} GPUs of this machine, which has {torch.cuda.device_count()} "
            "GPUs; measure on a node with that many, or leave --measure out"
        )


def main(argv: list[str] | None = None) -> int:
    from tpframe.training.config import load_config

    parser = ArgumentParser(prog="python -m tpframe.plan", description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="YAML config (its model, sequence and global batch are kept)")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs of the run")
    parser.add_argument("--gpu-gib", type=float, default=141.0, help="memory per GPU (default: an H200's)")
    parser.add_argument("--top", type=int, default=10, help="layouts listed")
    parser.add_argument("--measure", type=int, default=0, help="time the first N with train.py on these GPUs")
    parser.add_argument("--steps", type=int, default=8, help="train.py steps per measured layout")
    parser.add_argument("overrides", nargs="*", help="section.key=value, as train.py takes them")
    try:
        args = parser.parse_args(argv)
        _check_args(args)
        cfg = load_config(args.config, args.overrides)
        fits, refused = plan(cfg, args.gpus, gpu_gib=args.gpu_gib)
        if not fits:
            raise ConfigError(_nowhere(args.gpus, args.gpu_gib, refused))
    except ConfigError as e:
        print(f"tpframe.plan: {e}", file=sys.stderr)
        return 2
    print(f"{len(fits)} layouts fit on {args.gpus} GPUs of {args.gpu_gib:g} GiB, {len(refused)} do not; best first:")
    print(f"{'#':>3}  {'layout':58} {'GiB/GPU':>8} {'step ms':>9} {'TFLOP/s':>8} {'measured ms':>12}")
    for i, p in enumerate(fits[: args.top]):
        timed = (
            measure(args.config, args.overrides, run_overrides(cfg, p.layout), gpus=args.gpus, steps=args.steps)
            if i < args.measure
            else None
        )
        if isinstance(timed, str):  # the table goes on; why this one did not run, beside it
            print(f"tpframe.plan: #{i + 1} ({p.layout.describe()}) could not be measured: {timed}", file=sys.stderr)
        shown = f"{'-' if timed is None else 'failed' if isinstance(timed, str) else f'{timed:.1f}':>12}"
        print(
            f"{i + 1:>3}  {p.layout.describe():58} {p.memory_gib:8.1f} {p.step_ms:9.1f} {p.tflops:8.1f} {shown}",
            flush=True,
        )
    for why, layouts_ in _grouped(refused):
        print(f"  not placed ({len(layouts_)}): {why}; e.g. {layouts_[0].describe()}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        sys.exit(main())
    except BrokenPipeError:  # `| head` closed the table's reader: what it wanted was printed
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes stdout
        sys.exit(0)
