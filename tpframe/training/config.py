"""Typed run configuration: YAML file + `section.key=value` overrides, validated before any process group.

    cfg = load_config("configs/tiny_cpu.yaml", ["parallel.tp=2", "train.steps=50"])
    validate(cfg, world_size=2)   # ConfigError naming the key, the value and the fix

Every section is a dataclass; unknown keys fail with a did-you-mean, wrong types fail naming the
expected type, and impossible combinations (tp not dividing heads, batch sizes that do not divide)
fail in `validate` before any process is wired up.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tpframe.data.config import DataConfig
from tpframe.errors import ConfigError, shown
from tpframe.models.config import ModelConfig, ffn_hidden_size, head_dim, moe_ffn_hidden_size
from tpframe.observe.logger import LoggingConfig
from tpframe.observe.profiler import ProfileConfig
from tpframe.optim.config import OptimConfig
from tpframe.training.validate import check_env, check_numbers, parse_override_value, read_yaml_file


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor-parallel size: ranks that split every layer (adjacent ranks)
    pp: int = 1  # pipeline-parallel size
    cp: int = 1  # context-parallel size: ranks that split each sequence (README: context parallelism)
    # expert-parallel size (MoE models): ranks of dp x cp that split the experts (README: mixture of experts)
    ep: int = 1
    sequence_parallel: bool = False  # keep activations [s/tp, b, h] between TP regions (less memory)
    # recompute in backward (README: activation recompute): false; true or "full" (whole blocks: least memory,
    # ~1/4 more time); "selective" (norms and activation functions only: ~1/3 less memory, +3-4% time eager,
    # about none with train.compile)
    activation_checkpointing: bool | Literal["full", "selective"] = False
    recompute_layers: int | None = None  # with full: only the first N blocks of each pipeline chunk; None: all
    dp_strategy: Literal["ddp", "zero1", "fsdp"] = "ddp"  # gradients + optimizer over DP (README: data parallelism)
    grad_bucket_mb: float = 40.0  # ddp/zero1: gradients are synced in buckets of about this many MiB (fp32)
    overlap_grad_sync: bool = True  # ddp/zero1: launch each bucket's collective during the last backward
    overlap_param_gather: bool = False  # zero1: all-gather updated params in the background, waited for in forward
    # the dtype the DP gradient sync moves: float32, or bfloat16 (half the bytes; micro-batches still accumulate in
    # fp32 and only the sum over DP is rounded). Megatron-LM's --grad-reduce-in-bf16, torchtitan's
    # mixed_precision_reduce
    grad_reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    pp_schedule: Literal["1f1b", "afab", "interleaved_1f1b", "zb_h1"] = "1f1b"  # README: pipeline parallelism
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved_1f1b: 2 or more)
    layers_per_stage: list[int] | None = None  # layers of each (virtual) stage in model order; None: even split
    pp_timeout_s: float = 300.0  # a stage waiting longer than this for its neighbour stops the run, naming both
    # with sequence_parallel: each GEMM overlaps its TP collective (tpframe/layers/async_tp.py): "ring" (= true;
    # NCCL send/receive pipelined under the GEMM's blocks; 1.02x at GPT-1.3B TP=2 + SP on 2x H200) or
    # "copy_engine" (blocks pushed into the peers' memory by DMA, no SM held: tpframe/layers/async_tp_ce.py; one
    # host's GPUs)
    async_tp: bool | Literal["ring", "copy_engine"] = False

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
    fp8: bool = False  # float8 GEMMs in the blocks' linear layers (tensorwise scales; bf16 only; CUDA 8.9+ or CPU)
    fp8_small_layers: bool = False  # train.fp8 also in layers too small to gain (per rank out <= 4096 and in <= 1024)
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
class CheckpointConfig:
    dir: str | None = None  # default: <run_dir>/checkpoints
    interval: int = 0  # save every N steps; 0: only at the end and on preemption signals
    keep_last: int = 3  # published checkpoints kept; older ones are deleted
    load: str | None = None  # a checkpoint directory (or a checkpoints root with `latest`) to resume from
    auto_resume: bool = True  # resume from <dir>/latest when it exists
    init_from: str | None = None  # a new run's weights: exported .safetensors or an HF dir (ignored when resuming)
    verify: Literal["size", "crc"] = "crc"  # how shard files are checked before loading
    async_save: bool = False  # write in a background thread while training goes on
    save_on_signal: bool = True  # SIGTERM / SIGUSR1: save and exit cleanly
    save_at_end: bool = True  # save after the last step


@dataclass
class CommConfig:
    backend: Literal["auto", "nccl", "symm"] = "auto"  # TP collectives; env TPFRAME_COMM_BACKEND overrides
    timeout_s: float = 300.0  # every process group: a collective waiting longer ends the run (exit code 4)
    # SMs the GEMMs that hide a TP collective (parallel.async_tp=ring) leave free for it
    # (tpframe/comm/margin.py); 0: those GEMMs use every SM
    overlap_sm_margin: int = 32


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


# -- parsing ----------------------------------------------------------------------------------


def _did_you_mean(word: str, options, prefix: str = "") -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    if close:
        return f" (did you mean '{prefix}{close[0]}'?)"
    return f" (known: {', '.join(prefix + o for o in sorted(options))})"


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    """`value` as the field's type, or a ConfigError naming the key and the expected type."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, key)
            except ConfigError as e:
                errors.append(str(e))
        if bool in options and len(errors) == 2 and typing.get_origin(options[1]) is Literal:  # bool | Literal[...]
            choices = ", ".join(map(repr, typing.get_args(options[1])))
            raise ConfigError(f"{key}={shown(value)} is not allowed; choose true, false or one of {choices}")
        raise ConfigError(errors[0] if errors else f"{key}: invalid value {shown(value)}")
    if origin is Literal:
        choices = typing.get_args(annotation)
        if value not in choices:
            raise ConfigError(f"{key}={shown(value)} is not allowed; choose one of {', '.join(map(repr, choices))}")
        return value
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={shown(value)} must be true or false")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):  # YAML reads 1e10 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}={shown(value)} must be an integer")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}={shown(value)} must be a number")
    if annotation is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}={shown(value)} must be a string")
    if origin is list:
        (item,) = typing.get_args(annotation)
        if isinstance(value, (list, tuple)):
            return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        raise ConfigError(f"{key}={shown(value)} must be a list, e.g. [4, 4]")
    raise TypeError(f"unsupported config annotation {annotation!r} for {key}")


def _section_types(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_dict(data: dict[str, Any]) -> Config:
    """Build a Config from nested dicts, checking every key and type."""
    if not isinstance(data, dict):
        raise ConfigError(f"the config must be a mapping of sections, got {type(data).__name__}")
    sections = _section_types(Config)
    kwargs = {}
    for section, values in data.items():
        if not isinstance(section, str):
            raise ConfigError(f"config section names are words (model, train, ...), got {shown(section)}")
        if section not in sections:
            raise ConfigError(f"unknown config section '{section}'{_did_you_mean(section, sections)}")
        cls = sections[section]
        if values is None:
            values = {}
        if not isinstance(values, dict):
            raise ConfigError(f"config section '{section}' must be a mapping of keys, got {shown(values)}")
        types_ = _section_types(cls)
        fields = {}
        for key, value in values.items():
            if not isinstance(key, str):
                raise ConfigError(f"keys of config section '{section}' are words, got {shown(key)}")
            if key not in types_:
                raise ConfigError(f"unknown config key '{section}.{key}'{_did_you_mean(key, types_, section + '.')}")
            fields[key] = _coerce(value, types_[key], f"{section}.{key}")
        kwargs[section] = cls(**fields)
    return Config(**kwargs)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `section.key=value` strings (values parsed as YAML) to nested dicts. A key given twice is refused, as
    in the YAML file: which one was meant cannot be known."""
    given: dict[tuple[str, str], str] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value (e.g. train.steps=100)")
        dotted, raw = item.split("=", 1)
        parts = dotted.strip().split(".")
        if len(parts) != 2 or not all(parts):
            raise ConfigError(f"override key {dotted!r} must be section.key (e.g. parallel.tp=2)")
        section, key = parts
        if (section, key) in given:
            raise ConfigError(
                f"override {section}.{key} is given twice ({given[section, key]!r} and {item!r}); give it once"
            )
        given[section, key] = item
        value = parse_override_value(item, raw)
        if section not in data or data[section] is None:
            data[section] = {}
        if not isinstance(data[section], dict):
            raise ConfigError(f"config section '{section}' must be a mapping of keys, got {shown(data[section])}")
        data[section][key] = value
    return data


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read YAML (or start from defaults when `path` is None) and apply the overrides."""
    data: dict[str, Any] = read_yaml_file(path) if path is not None else {}
    return from_dict(apply_overrides(data, overrides or []))


# -- validation -------------------------------------------------------------------------------


def validate(cfg: Config, world_size: int) -> None:
    """Every impossible combination, as one clear ConfigError, before any process group exists."""
    m, p, t, o = cfg.model, cfg.parallel, cfg.train, cfg.optim
    check_numbers(cfg)  # every float finite and in range (tpframe/training/validate.py)
    check_env(cfg.comm.backend)

    def positive(key: str, value: int) -> None:
        if value < 1:
            raise ConfigError(f"{key}={value} must be at least 1")

    for key, value in (
        ("model.vocab_size", m.vocab_size),
        ("model.hidden", m.hidden),
        ("model.layers", m.layers),
        ("model.heads", m.heads),
        ("model.max_seq_len", m.max_seq_len),
        ("model.vocab_multiple", m.vocab_multiple),
        ("parallel.tp", p.tp),
        ("parallel.pp", p.pp),
        ("train.seq_len", t.seq_len),
        ("train.micro_batch_size", t.micro_batch_size),
        ("train.global_batch_size", t.global_batch_size),
        ("checkpoint.keep_last", cfg.checkpoint.keep_last),
        ("logging.interval", cfg.logging.interval),
    ):
        positive(key, value)
    if t.steps < 0:
        raise ConfigError(f"train.steps={t.steps} must not be negative")
    if not t.run_dir.strip():  # "" would be the current directory, filled with checkpoints/ and config.yaml
        raise ConfigError("train.run_dir is empty; give the run a directory, e.g. train.run_dir=runs/my_run")
    _refuse_empty_paths(cfg)
    for key, value in (("model.ffn_hidden", m.ffn_hidden), ("model.moe_ffn_hidden", m.moe_ffn_hidden)):
        if value is not None and value < 1:
            raise ConfigError(f"{key}={value} must be at least 1 (null: sized from model.hidden)")
    if p.cp < 1:
        raise ConfigError(f"parallel.cp={p.cp} must be at least 1 (1: no context parallelism)")
    if world_size % (p.tp * p.cp * p.pp):
        what, names = (f"{p.tp}*{p.cp}*{p.pp}", "tp/cp/pp") if p.cp > 1 else (f"{p.tp}*{p.pp}", "tp/pp")
        raise ConfigError(
            f"world size {world_size} is not divisible by parallel.{names.replace('/', '*parallel.')} = {what}; "
            f"launch a multiple of {p.tp * p.cp * p.pp} processes (python -m tpframe.launch --nproc-per-node N) or change "
            f"parallel.{names}"
        )
    dp = world_size // (p.tp * p.cp * p.pp)
    if m.head_dim is None and m.hidden % m.heads:
        raise ConfigError(
            f"model.hidden={m.hidden} is not divisible by model.heads={m.heads}; give each head's width "
            "as model.head_dim, or pick heads that divide it"
        )
    if m.head_dim is not None and m.head_dim < 1:
        raise ConfigError(f"model.head_dim={m.head_dim} must be at least 1 (or null: model.hidden/model.heads)")
    kv = m.kv_heads if m.kv_heads is not None else m.heads
    if kv < 1 or m.heads % kv:
        raise ConfigError(f"model.kv_heads={kv} must divide model.heads={m.heads}")
    for key, value in (
        ("model.heads", m.heads),
        ("model.kv_heads", kv),
        ("model.hidden", m.hidden),
        ("model.ffn_hidden", ffn_hidden_size(m)),
    ):
        if value % p.tp:
            raise ConfigError(f"parallel.tp={p.tp} does not divide {key}={value}; pick a tp that divides it")
    if m.position == "rotary" and head_dim(m) % 2:
        raise ConfigError(
            f"rotary positions need an even head dim; model.{'hidden/model.heads' if m.head_dim is None else 'head_dim'} = {head_dim(m)}"
        )
    if m.rope_scaling_factor is not None:
        if m.position != "rotary":
            raise ConfigError(
                f"model.rope_scaling_factor={m.rope_scaling_factor} scales rotary positions; set "
                "model.position=rotary or leave model.rope_scaling_factor unset"
            )
        if not m.rope_high_freq_factor > m.rope_low_freq_factor:
            raise ConfigError(
                f"model.rope_high_freq_factor={m.rope_high_freq_factor} must exceed "
                f"model.rope_low_freq_factor={m.rope_low_freq_factor} (Llama 3.1's are 4 and 1)"
            )
        if m.rope_original_max_seq_len < 1:
            raise ConfigError(
                f"model.rope_original_max_seq_len={m.rope_original_max_seq_len} must be at least 1 "
                "(Llama 3.1's is 8192)"
            )
    if t.seq_len > m.max_seq_len:
        raise ConfigError(f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    if m.sliding_window is not None and (isinstance(m.sliding_window, bool) or m.sliding_window < 1):
        raise ConfigError(
            f"model.sliding_window={m.sliding_window} must be a number of tokens >= 1 (or null: full causal attention)"
        )
    if m.eod_id is not None and not 0 <= m.eod_id < m.vocab_size:
        raise ConfigError(
            f"model.eod_id={m.eod_id} is not a token id of model.vocab_size={m.vocab_size}; give the "
            "token that ends a document, or null for the data's own"
        )
    if p.async_tp and not p.sequence_parallel:
        raise ConfigError(
            "parallel.async_tp overlaps the sequence-parallel collectives; set parallel.sequence_parallel=true"
        )
    if p.cp > 1:
        _validate_context_parallel(cfg)
    elif p.sequence_parallel and t.seq_len % p.tp:
        raise ConfigError(f"parallel.sequence_parallel needs train.seq_len={t.seq_len} divisible by parallel.tp={p.tp}")
    per_step = t.micro_batch_size * dp
    if t.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by train.micro_batch_size*dp = "
            f"{t.micro_batch_size}*{dp} = {per_step}; make it a multiple of {per_step}"
        )
    for key, value in (("model.dropout", m.dropout), ("model.attention_dropout", m.attention_dropout)):
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"{key}={value} must be in [0, 1)")
    if o.lr <= 0 or o.min_lr < 0 or o.min_lr > o.lr:
        raise ConfigError(f"optim.lr={o.lr} and optim.min_lr={o.min_lr} need 0 <= min_lr <= lr and lr > 0")
    if o.warmup_steps < 0 or o.grad_clip < 0 or o.weight_decay < 0:
        raise ConfigError("optim.warmup_steps, optim.grad_clip and optim.weight_decay must not be negative")
    if o.decay_fraction is not None and not 0.0 < o.decay_fraction <= 1.0:
        raise ConfigError(
            f"optim.decay_fraction={o.decay_fraction} must be in (0, 1]: the last fraction of train.steps "
            "that decays (e.g. 0.2), or null for a decay right after warmup"
        )
    if o.decay_fraction is not None and o.decay == "constant":
        raise ConfigError(
            "optim.decay_fraction sets when the decay starts, and optim.decay=constant has none; "
            "set optim.decay=cosine or linear, or optim.decay_fraction=null"
        )
    if not (0.0 <= o.beta1 < 1.0 and 0.0 <= o.beta2 < 1.0):
        raise ConfigError(f"optim.beta1={o.beta1} and optim.beta2={o.beta2} must be in [0, 1)")
    _validate_data(cfg.data)
    if not 0.0 < cfg.data.valid_fraction < 1.0:
        raise ConfigError(f"data.valid_fraction={cfg.data.valid_fraction} must be in (0, 1)")
    if cfg.train.gc_interval < 0:
        raise ConfigError(
            f"train.gc_interval={cfg.train.gc_interval} must be a number of steps >= 0 (0: Python's "
            "automatic garbage collection)"
        )
    if cfg.train.time_limit_minutes is not None and not cfg.train.time_limit_minutes > 0:
        raise ConfigError(
            f"train.time_limit_minutes={cfg.train.time_limit_minutes} must be a positive number of minutes "
            "(or null: no limit)"
        )
    if cfg.logging.straggler_ratio and cfg.logging.straggler_ratio < 1:
        raise ConfigError(
            f"logging.straggler_ratio={cfg.logging.straggler_ratio} must be 0 (off) or at least 1: a "
            "rank slower than this many times its stage's median is named, e.g. 1.1"
        )
    if not 0 <= cfg.comm.overlap_sm_margin <= 64:
        raise ConfigError(
            f"comm.overlap_sm_margin={cfg.comm.overlap_sm_margin} must be between 0 and 64 SMs "
            "(0: GEMMs beside a collective use every SM)"
        )
    if not p.grad_bucket_mb > 0 or p.grad_bucket_mb != p.grad_bucket_mb:
        raise ConfigError(f"parallel.grad_bucket_mb={p.grad_bucket_mb} must be a positive number of MiB")
    if cfg.train.compare_replicas_every < 0:
        raise ConfigError(
            f"train.compare_replicas_every={cfg.train.compare_replicas_every} must be a number of steps >= 0 (0: off)"
        )
    if cfg.train.compare_replicas_every and p.dp_strategy == "fsdp":
        raise ConfigError(
            "train.compare_replicas_every compares the copies ddp and zero1 keep of each weight; fsdp keeps "
            "one shard per rank, so there is nothing to compare: set parallel.dp_strategy=ddp or zero1, "
            "or train.compare_replicas_every=0"
        )
    if p.overlap_param_gather and p.dp_strategy != "zero1":
        raise ConfigError(f"parallel.overlap_param_gather=true needs parallel.dp_strategy=zero1 (got {p.dp_strategy})")
    _validate_recompute(cfg)
    if t.cuda_graph is True and (why := cuda_graph_obstacle(cfg)):
        raise ConfigError(why)
    if t.fp8:
        _validate_fp8(cfg)
    if t.eval_interval < 0 or t.eval_steps < 0 or cfg.checkpoint.interval < 0:
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
    _validate_pipeline(cfg, dp)
    _validate_moe(cfg, dp)
    _validate_profile(cfg, world_size)


# The path-valued keys besides train.run_dir, and what to give instead of "" (which is skipped as if unset, or read
# as the current directory): null (or leaving the key out) is how to say "none".
_PATH_KEYS = {
    "checkpoint.dir": "a folder, or leave it out (null) for <train.run_dir>/checkpoints",
    "checkpoint.load": "a step_* folder or a checkpoints folder holding 'latest', or leave it out (null)",
    "checkpoint.init_from": "a .safetensors file or a Hugging Face model folder, or leave it out (null)",
    "data.path": "a token file made by tools/prepare_data.py",
    "data.valid_path": "a held-out token file, or leave it out (null) to hold out the tail of data.path",
}


def _refuse_empty_paths(cfg: Config) -> None:
    """An empty string for a path key: refused like an empty train.run_dir (it was silently taken as unset)."""
    for key, hint in _PATH_KEYS.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        values = (
            [(key, value)]
            if not isinstance(value, (list, tuple))
            else [(f"{key}[{i}]", v) for i, v in enumerate(value)]
        )
        for where, v in values:
            if isinstance(v, str) and not v.strip():
                raise ConfigError(f"{where} is empty; give {hint}")


def _validate_data(d) -> None:
    if d.source == "tokens" and not d.paths:
        raise ConfigError("data.source=tokens needs data.path (a token file made by tools/prepare_data.py)")
    if d.source != "tokens" and (d.path or d.weights):
        raise ConfigError(
            f"data.path and data.weights are for data.source=tokens (got data.source={d.source}); "
            "set data.source=tokens or drop them"
        )
    if d.source != "tokens" and d.valid_path:  # it would be ignored
        raise ConfigError(
            f"data.valid_path is a held-out token file for data.source=tokens (got "
            f"data.source={d.source}); set data.source=tokens or drop it"
        )
    if d.weights is not None and isinstance(d.path, str):
        raise ConfigError(
            "data.weights blends several token files: give data.path as a list of as many files, "
            "e.g. data.path=[a.bin,b.bin] data.weights=[0.7,0.3]"
        )
    if d.weights is not None and len(d.weights) != len(d.paths):
        raise ConfigError(
            f"data.weights has {len(d.weights)} entries but data.path lists {len(d.paths)} files; "
            "give one weight per file"
        )
    if d.weights is not None and not all(0.0 < w < float("inf") for w in d.weights):
        raise ConfigError(f"data.weights={shown(d.weights)} must all be positive numbers (a share of samples per file)")


def _validate_profile(cfg: Config, world_size: int) -> None:
    """The `profile` section (tpframe/observe/profiler.py): a window inside the run, ranks that exist."""
    pr = cfg.profile
    if pr.start_step < 0 or pr.steps < 1:
        raise ConfigError(
            f"profile.start_step={pr.start_step} and profile.steps={pr.steps} need start_step >= 0 "
            "(0: no profiling) and steps >= 1"
        )
    if pr.start_step > cfg.train.steps:
        raise ConfigError(
            f"profile.start_step={pr.start_step} is after the last step (train.steps={cfg.train.steps}): "
            "nothing would be profiled; lower it, or set 0 to profile nothing"
        )
    bad = [r for r in pr.ranks if not 0 <= r < world_size]
    if bad or not pr.ranks:
        raise ConfigError(
            f"profile.ranks={shown(pr.ranks)} must name at least one rank, each in 0..{world_size - 1} "
            f"(world size {world_size})"
        )


def _validate_context_parallel(cfg: Config) -> None:
    """parallel.cp > 1 (tpframe/layers/context.py): each sequence in 2*cp equal chunks, two per CP rank."""
    p, t = cfg.parallel, cfg.train
    if t.seq_len % (2 * p.cp):
        raise ConfigError(
            f"parallel.cp={p.cp} cuts each sequence into 2*cp = {2 * p.cp} equal chunks; "
            f"train.seq_len={t.seq_len} is not divisible by {2 * p.cp}"
        )
    if p.sequence_parallel and (t.seq_len // p.cp) % p.tp:
        raise ConfigError(
            f"parallel.sequence_parallel splits each CP rank's train.seq_len/parallel.cp = "
            f"{t.seq_len // p.cp} tokens over parallel.tp={p.tp}; make train.seq_len a multiple of "
            f"{p.cp * p.tp * 2 // math.gcd(2, p.tp)}"
        )


def _validate_moe(cfg: Config, dp: int) -> None:
    """model.moe_* and parallel.ep (tpframe/layers/moe.py)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if m.moe_experts < 0:
        raise ConfigError(f"model.moe_experts={m.moe_experts} must not be negative (0: a dense MLP)")
    if p.ep < 1:
        raise ConfigError(f"parallel.ep={p.ep} must be at least 1 (1: every rank holds every expert)")
    if not m.moe_experts:
        if p.ep > 1:
            raise ConfigError(
                f"parallel.ep={p.ep} splits the experts of a mixture-of-experts model; set "
                "model.moe_experts (e.g. 8) or parallel.ep=1"
            )
        for key in ("moe_shared_ffn", "moe_z_loss", "moe_expert_bias"):
            if getattr(m, key):
                raise ConfigError(
                    f"model.{key}={getattr(m, key)} belongs to a mixture-of-experts model; set "
                    f"model.moe_experts (e.g. 8) or model.{key}=0"
                )
        return
    if not 1 <= m.moe_top_k <= m.moe_experts:
        raise ConfigError(f"model.moe_top_k={m.moe_top_k} must be in 1..model.moe_experts={m.moe_experts}")
    ffn = moe_ffn_hidden_size(m)
    if ffn < 1 or ffn % p.tp:
        raise ConfigError(f"parallel.tp={p.tp} must divide each expert's hidden size model.moe_ffn_hidden={ffn}")
    if m.moe_shared_ffn < 0 or m.moe_shared_ffn % p.tp:
        raise ConfigError(
            f"model.moe_shared_ffn={m.moe_shared_ffn} (the shared expert's hidden size; 0: none) must "
            f"be a non-negative multiple of parallel.tp={p.tp}"
        )
    if m.moe_z_loss < 0:
        raise ConfigError(f"model.moe_z_loss={m.moe_z_loss} must not be negative (0: no router z-loss)")
    if m.moe_aux_loss < 0:
        raise ConfigError(f"model.moe_aux_loss={m.moe_aux_loss} must not be negative (0: no load-balancing loss)")
    if m.moe_expert_bias and not 0 < m.moe_expert_bias_rate < math.inf:
        raise ConfigError(
            f"model.moe_expert_bias_rate={m.moe_expert_bias_rate} must be a positive number (how far "
            "each expert's bias moves per step; e.g. 0.001)"
        )
    if (dp * p.cp) % p.ep:
        raise ConfigError(
            f"parallel.ep={p.ep} must divide dp*cp = {dp}*{p.cp} = {dp * p.cp} (experts are split over "
            "ranks holding different data); change parallel.ep or the number of processes"
        )
    if m.moe_experts % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} must divide model.moe_experts={m.moe_experts}")
    if t.compile and p.ep > 1:
        raise ConfigError(
            "train.compile is not supported with parallel.ep > 1 yet (the all-to-all is sized on "
            "the host, every layer); set train.compile=false or parallel.ep=1"
        )


def _validate_recompute(cfg: Config) -> None:
    """parallel.activation_checkpointing and recompute_layers (README: activation recompute)."""
    p = cfg.parallel
    if p.recompute_layers is not None:
        if p.recompute != "full":
            raise ConfigError(
                f"parallel.recompute_layers={p.recompute_layers} picks which blocks recompute whole; it "
                "needs parallel.activation_checkpointing=full (got "
                f"{p.activation_checkpointing!r})"
            )
        if not 1 <= p.recompute_layers <= cfg.model.layers:
            raise ConfigError(
                f"parallel.recompute_layers={p.recompute_layers} must be in 1..model.layers="
                f"{cfg.model.layers} (null: every block)"
            )
    if p.recompute == "selective" and p.async_tp:
        raise ConfigError(
            "parallel.activation_checkpointing=selective re-gathers the norm outputs itself, which "
            "parallel.async_tp would overlap with the GEMM; turn one off"
        )
    if p.recompute == "selective" and cfg.train.fp8:
        raise ConfigError(
            "train.fp8 already keeps float8 copies of the GEMM inputs instead of the norm and "
            "activation outputs, so parallel.activation_checkpointing=selective would only add "
            "compute; use full or false"
        )


def cuda_graph_obstacle(cfg: Config) -> str | None:
    """Why train.cuda_graph cannot replay this run's step (tpframe/parallel/graphed.py replays a fixed,
    non-random forward+backward), as the line a ConfigError says for `true`; None if nothing in the config
    stands in the way (the device is checked at start-up: tpframe.run.preflight.check_device)."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    if p.pp > 1:
        return "train.cuda_graph graphs the non-pipelined step; set parallel.pp=1 or train.cuda_graph=false"
    if p.dp_strategy == "fsdp":
        return (
            "train.cuda_graph cannot capture FSDP's per-layer gathers; use parallel.dp_strategy=ddp or zero1, "
            "or set train.cuda_graph=false"
        )
    if p.overlap_param_gather:
        return (
            "train.cuda_graph cannot wait for zero1's background param all-gather inside the graph; "
            "set parallel.overlap_param_gather=false or train.cuda_graph=false"
        )
    if m.dropout > 0 or m.attention_dropout > 0:
        return (
            f"train.cuda_graph replays fixed random numbers, so it needs model.dropout=0 and "
            f"model.attention_dropout=0 (got {m.dropout:g} and {m.attention_dropout:g})"
        )
    if cfg.data.eod_mask_loss:
        return (
            "train.cuda_graph replays a fixed loss scale, and data.eod_mask_loss scales each step by its count of "
            "tokens that carry a loss; set train.cuda_graph=false or data.eod_mask_loss=false"
        )
    if m.attention_mask == "document":
        return (
            "train.cuda_graph cannot replay model.attention_mask=document: the documents' boundaries, read on the "
            "host, change every batch; set train.cuda_graph=false or model.attention_mask=causal"
        )
    if p.cp > 1:  # train.compile works: CP attention runs eager between the compiled parts of a block
        return (
            "train.cuda_graph is not supported with parallel.cp > 1 yet (context-parallel attention's all-gather "
            "and chunk kernels are not verified under capture); set train.cuda_graph=false or parallel.cp=1"
        )
    if m.moe_experts and p.ep > 1:
        return (
            "train.cuda_graph is not supported with parallel.ep > 1 yet (the all-to-all is sized on the host, "
            "every layer); set train.cuda_graph=false or parallel.ep=1"
        )
    if m.moe_experts and (t.dtype != "bfloat16" or t.fp8):
        return (
            "train.cuda_graph captures MoE experts only as grouped GEMMs, which need train.dtype=bfloat16 and "
            "train.fp8=false (otherwise each expert's GEMM is sized on the host); change those or set "
            "train.cuda_graph=false"
        )
    return None


def _validate_fp8(cfg: Config) -> None:
    """train.fp8 (tpframe/layers/fp8.py): bf16 activations, the plain GEMM path, every GEMM dim a multiple of 16."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    if t.dtype != "bfloat16":
        raise ConfigError(
            f"train.fp8 computes in float8 with bf16 inputs and outputs; set train.dtype=bfloat16 (got {t.dtype})"
        )
    if p.async_tp:
        raise ConfigError(
            "train.fp8 and parallel.async_tp cannot be combined (the overlapped GEMMs are bf16); turn one off"
        )
    if p.pp > 1 and p.pp_schedule == "zb_h1":
        raise ConfigError(
            "train.fp8 cannot defer weight gradients (parallel.pp_schedule=zb_h1); use 1f1b, afab or interleaved_1f1b"
        )
    tokens = t.micro_batch_size * t.seq_len
    if tokens % 16:
        raise ConfigError(
            f"train.fp8 needs train.micro_batch_size*train.seq_len = {tokens} to be a multiple of 16 (float8 GEMM dims)"
        )
    for key, value in (
        ("model.hidden", m.hidden),
        ("the ffn width", ffn_hidden_size(m)),
        ("model.heads * head dim", m.heads * head_dim(m)),
        ("model.kv_heads * head dim", (m.kv_heads or m.heads) * head_dim(m)),
    ):
        if value % (16 * p.tp):
            raise ConfigError(
                f"train.fp8 needs {key} = {value} divisible by 16*parallel.tp = {16 * p.tp} "
                "(each rank's float8 GEMM dims are multiples of 16)"
            )


def _validate_pipeline(cfg: Config, dp: int) -> None:
    """parallel.pp, pp_schedule, virtual_stages and layers_per_stage against the model and the batch."""
    p, layers = cfg.parallel, cfg.model.layers
    v, schedule = p.virtual_stages, p.pp_schedule
    if v < 1:
        raise ConfigError(f"parallel.virtual_stages={v} must be at least 1")
    if p.pp == 1 and (v > 1 or p.layers_per_stage is not None):
        raise ConfigError("parallel.virtual_stages and parallel.layers_per_stage split a pipeline; set parallel.pp > 1")
    if p.pp == 1:
        return
    if schedule == "interleaved_1f1b" and v < 2:
        raise ConfigError("parallel.pp_schedule=interleaved_1f1b needs parallel.virtual_stages >= 2 (chunks per rank)")
    if schedule != "interleaved_1f1b" and v > 1:
        raise ConfigError(f"parallel.virtual_stages={v} needs parallel.pp_schedule=interleaved_1f1b (got {schedule})")
    stages = p.pp * v
    if p.layers_per_stage is None and layers % stages:
        raise ConfigError(
            f"model.layers={layers} is not divisible by parallel.pp*parallel.virtual_stages = {p.pp}*{v} = {stages}; "
            f"change them or give parallel.layers_per_stage ({stages} counts that add up to {layers})"
        )
    if p.layers_per_stage is not None:
        counts = p.layers_per_stage
        if len(counts) != stages or min(counts) < 1 or sum(counts) != layers:
            wrong = (
                f"it has {len(counts)}"
                if len(counts) != stages
                else f"a stage of {min(counts)} layers"
                if min(counts) < 1
                else f"they add up to {sum(counts)}"
            )
            raise ConfigError(
                f"parallel.layers_per_stage={shown(counts)} must be {stages} counts (parallel.pp*parallel.virtual_stages), "
                f"each at least 1, adding up to model.layers={layers} ({wrong})"
            )
    micro = cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp)
    if micro < p.pp or (schedule == "interleaved_1f1b" and micro % p.pp):
        need = f"a multiple of parallel.pp={p.pp}" if schedule == "interleaved_1f1b" else f"at least parallel.pp={p.pp}"
        raise ConfigError(
            f"parallel.pp_schedule={schedule} needs the micro-batches per step, train.global_batch_size/"
            f"(train.micro_batch_size*dp) = {micro}, to be {need}; raise train.global_batch_size or lower "
            "train.micro_batch_size"
        )
    if p.dp_strategy == "fsdp" and schedule == "zb_h1":
        raise ConfigError(
            "parallel.pp_schedule=zb_h1 defers weight gradients past FSDP's reduce-scatter; use "
            "parallel.dp_strategy=ddp or zero1 with it"
        )
    if not p.pp_timeout_s > 0:
        raise ConfigError(f"parallel.pp_timeout_s={p.pp_timeout_s} must be a positive number of seconds")


def grad_accumulation_steps(cfg: Config, world_size: int) -> int:
    dp = world_size // (cfg.parallel.tp * cfg.parallel.cp * cfg.parallel.pp)
    return cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp)
