"""Where generation's weights come from: a training checkpoint (any TP/PP/DP layout), a consolidated
safetensors export, or a Hugging Face model directory (GPT-2, Llama, Qwen2, Qwen3, Mistral, Mixtral, Qwen3-MoE, Phi-3 in
safetensors: an HF export, or a model from the hub), read in full and cut into this rank's shards for the TP size of
the run.

    source = open_source("runs/x/checkpoints")     # filesystem only, before any process group
    tensors = read_weights(source)                 # {logical name: full tensor} on the CPU
    copy_logical_tensors(model, tensors, tp_rank, tp, source=...)  # this rank's piece of each (checkpoint/export.py)

Logical names are those of tpframe.parallel.sharding (fused q/k/v and gate/up split, vocabulary tables
without padding rows), which do not depend on the layout the checkpoint was written at.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from tpframe.checkpoint import resolve, verify
from tpframe.checkpoint.adapters import lora_of, model_tensors
from tpframe.checkpoint.finite import check_finite_weights
from tpframe.checkpoint.hf import HFWeights, hf_context, is_hf_dir, model_fields, read_config
from tpframe.errors import ConfigError
from tpframe.models.config import ModelConfig, read_model_config


@dataclass
class ModelSource:
    path: Path  # a checkpoint step directory, a .safetensors file or an HF model directory
    kind: str  # "checkpoint", "safetensors" or "hf"
    model: ModelConfig
    data: dict | None = None  # the run's data config (checkpoints only): how its tokens were made
    step: int | None = None
    cwd: str | None = None  # the folder the run was launched from: its data paths' base (checkpoints only)


def model_config_from(d: dict, where: str) -> ModelConfig:
    """The recorded `model:` section as a checked ModelConfig (the types and sizes a run's config would need)."""
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: the recorded model config is a {type(d).__name__}, not a mapping")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ConfigError(
            f"{where}: model settings {unknown} are unknown to this tpframe; "
            "generate with the tpframe version that wrote it"
        )
    try:
        cfg = read_model_config(d)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    bad = [
        f"model.{k}={getattr(cfg, k)}"
        for k in ("vocab_size", "hidden", "layers", "heads", "max_seq_len")
        if getattr(cfg, k) < 1
    ]
    if not bad and cfg.hidden % cfg.heads:
        bad = [f"model.hidden={cfg.hidden} is not divisible by model.heads={cfg.heads}"]
    if bad:
        raise ConfigError(f"{where}: the recorded model config cannot be built ({bad[0]}); was it written by tpframe?")
    return cfg


def open_source(path: str | Path) -> ModelSource:
    """Find and check the weights at `path` (a step directory, a checkpoints root with `latest`, or a
    .safetensors export); ConfigError when they cannot be used."""
    p = Path(path)
    if (
        p.is_file()
        and is_hf_dir(p.parent)
        and (p.suffix != ".safetensors" or "model_config" not in _safetensors_header(p))
    ):
        raise ConfigError(
            f"--checkpoint {str(p)!r} is a file of the Hugging Face model directory {str(p.parent)!r}; "
            "pass the directory"
        )
    if p.is_file():
        if p.suffix != ".safetensors":
            raise ConfigError(
                f"--checkpoint {str(p)!r} is a file but not a .safetensors export; pass a checkpoint "
                "directory or a file written by `tools/checkpoint.py export`"
            )
        header = _safetensors_header(p)
        if "model_config" not in header:
            raise ConfigError(
                f"--checkpoint {str(p)!r} has no model_config in its header: not a tpframe export "
                "(make one with `python tools/checkpoint.py export DIR --out FILE`)"
            )
        try:
            recorded, step = json.loads(header["model_config"]), header.get("step")
            step = int(step) if step is not None else None
        except ValueError as e:  # JSONDecodeError too
            raise ConfigError(
                f"--checkpoint {str(p)!r} has a corrupt header ({e}); export it again with "
                "`python tools/checkpoint.py export DIR --out FILE`"
            ) from None
        return ModelSource(p, "safetensors", model_config_from(recorded, str(p)), step=step)
    if is_hf_dir(p):
        return hf_source(p)
    step_dir = resolve(p)  # CheckpointError (a ConfigError) when it does not exist or names nothing
    meta = verify(step_dir, "crc")
    cfg = model_config_from(meta["config"]["model"], str(step_dir / "meta.json"))
    return ModelSource(
        step_dir, "checkpoint", cfg, data=meta["config"].get("data"), step=meta.get("step"), cwd=meta.get("cwd")
    )


def hf_source(path: Path, where: str | None = None) -> ModelSource:
    """An HF model directory: the model its config.json describes (the context is max_position_embeddings), its
    weights' names, shapes and dtypes checked from the safetensors headers; errors begin with `where`."""
    where = where or f"--checkpoint {str(path)!r}"
    config = read_config(path)
    fields = model_fields(config, f"{where}: its config.json")
    fields.setdefault("max_seq_len", hf_context(config))
    cfg = model_config_from(fields, f"{where}: its config.json")
    HFWeights(path, cfg).check(where)
    return ModelSource(path, "hf", cfg)


def _safetensors_header(path: Path) -> dict:
    try:
        from safetensors import safe_open
    except ImportError:
        raise ConfigError(
            "reading a .safetensors export needs the safetensors package: pip install safetensors"
        ) from None
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except Exception as e:  # noqa: BLE001 - the Rust side raises its own types
        raise ConfigError(f"--checkpoint {str(path)!r} is not a readable safetensors file ({e})") from None


def read_weights(source: ModelSource) -> dict[str, torch.Tensor]:
    """Every model tensor in full, on the CPU, by logical name (vocabulary padding removed); ConfigError when
    one holds NaN or inf."""
    if source.kind == "safetensors":
        import safetensors.torch

        tensors = safetensors.torch.load_file(str(source.path))
    elif source.kind == "hf":
        tensors = dict(HFWeights(source.path, source.model))  # views into each HF tensor, read once
    else:
        with warnings.catch_warnings():  # DCP notes that it reads without a process group: that is the intent
            warnings.simplefilter("ignore", UserWarning)
            lora = lora_of(json.loads((Path(source.path) / "meta.json").read_text()))
            tensors = model_tensors(source.path, merge_lora=lora is not None)  # a LoRA run's: merged with its base
    check_finite_weights(tensors.items(), f"--checkpoint {str(source.path)!r}")
    return tensors
