"""The run's configuration: the sections (each a dataclass beside the package it configures), read from YAML and
`section.key=value` overrides, and validated before any process group exists.

    cfg = load_config("configs/tiny_cpu.yaml", ["parallel.tp=2", "train.steps=50"])
    validate(cfg, world_size=2)   # ConfigError naming the key, the value and the fix

Unknown keys fail with a did-you-mean and wrong types name the expected type (tpframe/config.py, the generic
parser); impossible combinations (tp not dividing heads, batch sizes that do not divide) fail in `validate`, which
calls each package's checks in a fixed order. The `parallel` section is declared here rather than in
tpframe/parallel/: its keys draw their names from registries on several floors (the pipeline's SCHEDULES,
optim's STRATEGIES, async TP's MODES), and this is the lowest module that sees them all.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tpframe.checkpoint.config import CheckpointConfig, check_checkpoint
from tpframe.comm.config import CommConfig, check_comm
from tpframe.config import check_at_least, check_finite, check_ranges, load, read_sections
from tpframe.data.config import DataConfig, check_data
from tpframe.errors import ConfigError
from tpframe.layers.async_tp import CHOICES as ASYNC_TP_CHOICES
from tpframe.layers.async_tp import check_async_tp
from tpframe.layers.context import CP_COMM_MODES, check_cp_comm, check_sequence_split
from tpframe.layers.fp8 import RECIPES, check_fp8
from tpframe.layers.lora import check_lora
from tpframe.models.config import ModelConfig, check_experts, check_model, check_tensor_parallel, gemm_widths
from tpframe.observe.logger import LoggingConfig, check_logging
from tpframe.observe.profiler import ProfileConfig, check_profile
from tpframe.optim import STRATEGIES, check_data_parallel
from tpframe.optim.config import OptimConfig, check_optim
from tpframe.parallel.graphed import cuda_graph_obstacle
from tpframe.parallel.pipeline.checks import check_pipeline
from tpframe.parallel.pipeline.orders import SCHEDULES
from tpframe.parallel.recompute import check_recompute
from tpframe.parallel.state import check_layout
from tpframe.training.health import check_fault_env


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor-parallel size: ranks that split every layer (adjacent ranks)
    pp: int = 1  # pipeline-parallel size
    cp: int = 1  # context-parallel size: ranks that split each sequence (README: context parallelism)
    # how CP attention meets the other ranks' tokens: "all_gather" (each rank gathers every key and value) or
    # "all_to_all" (Ulysses: heads traded for the sequence around attention; cp must divide model.heads/tp)
    cp_comm: Literal[CP_COMM_MODES] = "all_gather"
    # expert-parallel size (MoE models): ranks of dp x cp that split the experts (README: mixture of experts)
    ep: int = 1
    sequence_parallel: bool = False  # keep activations [s/tp, b, h] between TP regions (less memory)
    # recompute in backward (README: activation recompute): false; true or "full" (whole blocks: least memory, for
    # a second forward); "selective" (only norms and activation functions, cheap to redo: a few percent more time
    # eager, about none with train.compile; benchmarks/RESULTS.md, 'Activation recompute modes')
    activation_checkpointing: bool | Literal["full", "selective"] = False
    recompute_layers: int | None = None  # with full: only the first N blocks of each pipeline chunk; None: all
    dp_strategy: Literal[STRATEGIES] = "ddp"  # gradients + optimizer over DP (README: data parallelism)
    grad_bucket_mb: float = 40.0  # ddp/zero1: gradients are synced in buckets of about this many MiB (fp32)
    overlap_grad_sync: bool = True  # ddp/zero1: launch each bucket's collective during the last backward
    # the dtype the DP gradient sync moves: float32, or bfloat16 (half the bytes; micro-batches still accumulate in
    # fp32 and only the sum over DP is rounded). Megatron-LM's --grad-reduce-in-bf16, torchtitan's
    # mixed_precision_reduce
    grad_reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    pp_schedule: Literal[SCHEDULES] = "1f1b"  # README: pipeline parallelism
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved_1f1b: 2 or more)
    layers_per_stage: list[int] | None = None  # layers of each (virtual) stage in model order; None: even split
    pp_timeout_s: float = 300.0  # a stage waiting longer than this for its neighbour stops the run, naming both
    # with sequence_parallel: each GEMM overlaps its TP collective, the blocks pushed into the peers' memory by the
    # copy engines (true = "copy_engine"; CUDA, one host's GPUs; tpframe/layers/async_tp.py); "auto": on only where
    # tpframe/layers/async_tp_auto.json measured it faster than off for this GPU, TP and hidden size
    async_tp: bool | Literal[ASYNC_TP_CHOICES] = "auto"

    @property
    def recompute(self) -> str:
        """activation_checkpointing as one word: "none", "full" or "selective"."""
        value = self.activation_checkpointing
        return value if isinstance(value, str) else ("full" if value else "none")

    def recompute_context(self) -> dict:
        """The BuildContext fields that carry it to the model."""
        return dict(
            activation_checkpointing=self.recompute == "full",
            recompute_layers=self.recompute_layers,
            selective_recompute=self.recompute == "selective",
        )


@dataclass
class TrainConfig:
    steps: int = 1000  # optimizer steps to train for (the run's last step)
    seq_len: int = 128  # tokens per sequence
    micro_batch_size: int = 8  # sequences per rank per forward/backward
    global_batch_size: int = 8  # sequences per optimizer step over all DP ranks
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype (fp32 masters and grad accumulation either way)
    seed: int = 1234  # weights, dropout
    eval_interval: int = 100  # 0 disables evaluation
    # held-out micro-batches per evaluation on each DP rank: eval_steps*micro_batch_size*dp sequences, so two
    # layouts' eval losses compare only at the same micro_batch_size*dp
    eval_steps: int = 10
    # evaluate the loaded weights (a resumed checkpoint, checkpoint.init_from, or the fresh model) once on
    # eval_steps held-out micro-batches, then stop: no training step, no checkpoint (Megatron's --skip-train)
    eval_only: bool = False
    run_dir: str = "runs/default"  # metrics.jsonl, config.yaml, checkpoints/
    compile: bool = False  # torch.compile each transformer block (tpframe/models/compile.py); first steps compile
    # CUDA: replay each micro-batch's forward+backward from a CUDA graph after 2 eager steps; "auto": time 3 eager and
    # 3 replayed steps, keep the graphs only if they are faster (and run eagerly where they cannot be used)
    cuda_graph: bool | Literal["auto"] = False
    # float8 GEMMs in the blocks' linear layers (bf16 runs; CUDA 8.9+ or CPU): tensorwise or rowwise scales
    # (true: tensorwise); norms, attention and the head stay bf16 (docs/performance.md)
    fp8: bool | Literal[RECIPES] = False
    on_nonfinite: Literal["skip", "abort"] = "skip"  # a step whose loss/grad norm stays non-finite when re-run
    max_skipped_steps: int = 5  # consecutive skipped steps tolerated before training stops (exit code 3)
    loss_spike_z: float = 6.0  # log a loss above the recent median by this many robust deviations; 0: off
    check_memory: bool = True  # refuse a layout whose memory estimate exceeds the device's (README: operations)
    # save and stop (exit 0) after the first step that ends this many minutes after start-up, for the next job to
    # resume (a scheduler's wall-clock limit, minus a save's time); Megatron's --exit-duration-in-mins. None: no limit
    time_limit_minutes: float | None = None
    # Python's automatic garbage collector off while training; the young generations collected every N steps on every
    # rank at once (an automatic pause on one rank stalls the others at the next collective). 0: automatic
    gc_interval: int = 50
    # TP > 1: in each launch's first step, weights replicated over TP must get the same gradient on every TP rank
    # (tpframe/training/replicas.py: a layer missing its sequence_parallel tag stops with exit code 2)
    check_replicas: bool = True
    # every N steps, after the update: the copies of each weight (over DP, CP, TP, expert replicas) must still be
    # bit-identical; a copy that drifted (a bit flip, a rank that computed another update) stops training, exit
    # code 3 (tpframe/training/replica_weights.py; Megatron's --check-weight-hash-across-dp-replicas-interval). 0: off
    compare_replicas_every: int = 0


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def from_dict(data: dict[str, Any]) -> Config:
    """A Config from nested dicts (sections of keys), every key and type checked."""
    return read_sections(Config, data)


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read YAML (or start from defaults when `path` is None) and apply the overrides."""
    return load(Config, path, overrides or [])


def validate(cfg: Config, world_size: int) -> None:
    """Every impossible combination, as one clear ConfigError, before any process group exists: each section by
    itself, then against the layout, each check beside what it checks. The order is fixed: a config with several
    mistakes names the same one first every time."""
    check_finite(cfg)  # every float finite and within float32
    check_comm(cfg.comm)  # with the env vars that override it
    check_fault_env()
    check_model(cfg.model)
    check_data(cfg.data)
    check_optim(cfg.optim)
    check_train(cfg)
    check_checkpoint(cfg.checkpoint)
    check_logging(cfg.logging)
    dp = check_layout(cfg.parallel, world_size)
    check_tensor_parallel(cfg.model, cfg.parallel.tp)
    check_async_tp(cfg.parallel)
    check_lora(cfg)
    check_sequence_split(cfg)
    check_cp_comm(cfg)
    check_global_batch(cfg.train, dp)
    check_data_parallel(cfg.parallel)
    check_recompute(cfg)
    if cfg.train.cuda_graph is True and (why := cuda_graph_obstacle(cfg)):
        raise ConfigError(why)
    if cfg.train.fp8:
        check_fp8(cfg, gemm_widths(cfg.model))
    check_pipeline(cfg, dp)
    check_experts(cfg, dp)
    check_profile(cfg, world_size)


# -- the train section ---------------------------------------------------------------------------------

SEED_LIMIT = 2**63  # torch seeds are 64-bit and the model adds per-layer and per-rank offsets to train.seed


def check_train(cfg: Config) -> None:
    """The `train:` section (with the model's longest sequence and checkpoint.interval, which count steps too)."""
    t = cfg.train
    check_ranges("train", t, (("loss_spike_z", 0.0, None, True),))
    if t.seed < 0:
        raise ConfigError(f"train.seed={t.seed} must be a non-negative integer")
    if t.seed >= SEED_LIMIT:
        raise ConfigError(
            f"train.seed={t.seed} must be below 2**63 (torch's seeds are 64-bit and each layer and rank adds an offset)"
        )
    check_at_least("train", t, ("max_skipped_steps",), 0)
    check_at_least("train", t, ("seq_len", "micro_batch_size", "global_batch_size"))
    check_at_least("train", t, ("steps",), 0)
    if not t.run_dir.strip():  # "" would be the current directory, filled with checkpoints/ and config.yaml
        raise ConfigError("train.run_dir is empty; give the run a directory, e.g. train.run_dir=runs/my_run")
    if t.seq_len > cfg.model.max_seq_len:
        raise ConfigError(f"train.seq_len={t.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}")
    if t.gc_interval < 0:
        raise ConfigError(
            f"train.gc_interval={t.gc_interval} must be a number of steps >= 0 (0: Python's "
            "automatic garbage collection)"
        )
    if t.time_limit_minutes is not None and not t.time_limit_minutes > 0:
        raise ConfigError(
            f"train.time_limit_minutes={t.time_limit_minutes} must be a positive number of minutes (or null: no limit)"
        )
    _check_replica_comparison(t, cfg.parallel.dp_strategy)
    _check_eval(t, cfg.checkpoint.interval)


def _check_replica_comparison(t: TrainConfig, dp_strategy: str) -> None:
    """train.compare_replicas_every (tpframe/training/replica_weights.py)."""
    if t.compare_replicas_every < 0:
        raise ConfigError(
            f"train.compare_replicas_every={t.compare_replicas_every} must be a number of steps >= 0 (0: off)"
        )
    if t.compare_replicas_every and dp_strategy == "fsdp":
        raise ConfigError(
            "train.compare_replicas_every compares the copies ddp and zero1 keep of each weight; fsdp keeps "
            "one shard per rank, so there is nothing to compare: set parallel.dp_strategy=ddp or zero1, "
            "or train.compare_replicas_every=0"
        )


def _check_eval(t: TrainConfig, checkpoint_interval: int) -> None:
    """train.eval_interval, eval_steps and eval_only."""
    if t.eval_interval < 0 or t.eval_steps < 0 or checkpoint_interval < 0:
        raise ConfigError("train.eval_interval, train.eval_steps and checkpoint.interval must not be negative")
    if t.eval_only and not t.eval_steps:
        raise ConfigError(
            "train.eval_only=true evaluates on train.eval_steps=0 held-out micro-batches: nothing; "
            "set train.eval_steps to 1 or more"
        )
    if t.eval_interval and not t.eval_steps:  # every evaluation would read nothing: none would run
        raise ConfigError(
            f"train.eval_interval={t.eval_interval} evaluates on train.eval_steps=0 held-out "
            "micro-batches: no evaluation would run; set train.eval_steps to 1 or more, or "
            "train.eval_interval=0 to turn evaluation off"
        )


def check_global_batch(t: TrainConfig, dp: int) -> None:
    """train.global_batch_size: whole micro-batches on every DP rank."""
    per_step = t.micro_batch_size * dp
    if t.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by train.micro_batch_size*dp = "
            f"{t.micro_batch_size}*{dp} = {per_step}; make it a multiple of {per_step}"
        )


def grad_accumulation_steps(cfg: Config, world_size: int) -> int:
    dp = world_size // (cfg.parallel.tp * cfg.parallel.cp * cfg.parallel.pp)
    return cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp)
