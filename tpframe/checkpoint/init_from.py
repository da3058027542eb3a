"""`checkpoint.init_from`: start a new run's weights from a consolidated safetensors file, an HF directory, or a
tpframe checkpoint (a step directory or a checkpoints root: its weights only, any layout; Megatron's `--finetune`:
the optimizer state, step and data position start afresh).

    check_init_from(cfg)                                    # pre-flight: no process group, nothing loaded
    what = load_init_from(model, cfg, tp_rank, tp)          # this rank's shards; "<what was loaded>"

Every source is read as full logical tensors (tpframe.parallel.sharding names; an HF directory's are renamed
by tpframe.checkpoint.hf; a checkpoint's read from its shards one at a time), so any TP layout, and any pipeline
stage, takes its own pieces.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from tpframe.checkpoint import hf
from tpframe.checkpoint.export import CheckpointWeights, copy_logical_tensors, safetensors_module
from tpframe.checkpoint.files import LATEST, META, CheckpointError, resolve, verify
from tpframe.models.config import ModelConfig, architecture, architecture_diffs, read_model_config


def _consolidated_model(path: Path) -> dict | None:
    """The model section recorded in a tpframe-exported safetensors file's header (None if absent)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
    except Exception as e:  # safetensors raises its own error types for a file that is not safetensors
        raise CheckpointError(f"checkpoint.init_from={str(path)!r} is not a safetensors file ({e})") from None
    return json.loads(header["model_config"]) if header.get("format") == "tpframe" else None


def tpframe_checkpoint(path: Path) -> Path | None:
    """The step directory of a tpframe checkpoint at `path` (a step directory, or a root holding `latest`), or
    None when `path` is not one."""
    if path.is_dir() and ((path / META).is_file() or (path / LATEST).is_file()):
        return resolve(path)
    return None


def _refuse_other_model(key: str, m: ModelConfig, arch: dict, recorded: dict, source: str) -> None:
    """CheckpointError naming each architecture setting where `m` differs from the source's (`arch`, `recorded`)."""
    diffs = [
        f"model.{k}={mine!r} but the {source} has {other!r}" for k, mine, other in architecture_diffs(m, arch, recorded)
    ]
    if diffs:
        raise CheckpointError(f"{key} holds another model: " + "; ".join(diffs))


def check_init_from(cfg) -> None:
    """One CheckpointError for an init_from that cannot become this run's model."""
    path = Path(cfg.checkpoint.init_from)
    key = f"checkpoint.init_from={str(path)!r}"
    if hf.is_hf_dir(path):
        hf.check_hf_dir(cfg.model, path)
        return
    step = tpframe_checkpoint(path)
    if step is not None:
        meta = verify(step, cfg.checkpoint.verify)
        _refuse_other_model(key, cfg.model, meta["architecture"], meta["config"]["model"], "checkpoint")
        return
    if path.is_dir():
        raise CheckpointError(
            f"{key} is a directory without {hf.CONFIG} and not a tpframe checkpoint (no meta.json "
            "or latest): give a Hugging Face model directory, a tpframe checkpoint, or a "
            "safetensors file from tools/checkpoint.py export"
        )
    if not path.is_file():
        raise CheckpointError(f"{key} does not exist")
    recorded = _consolidated_model(path)
    if recorded is not None:
        theirs = read_model_config(recorded)
        _refuse_other_model(key, cfg.model, architecture(theirs), dataclasses.asdict(theirs), "file")


def base_weights(path: str | Path, m: ModelConfig) -> Mapping[str, torch.Tensor]:
    """The logical tensors of an init_from source (an HF directory, a checkpoint, a safetensors file), read lazily
    where the source allows."""
    path = Path(path)
    if hf.is_hf_dir(path):
        return hf.HFWeights(path, m)
    step = tpframe_checkpoint(path)
    if step is not None:
        return CheckpointWeights(step)
    return safetensors_module().load_file(str(path))


def base_fingerprint(path: str | Path) -> dict[str, list]:
    """A cheap record of the weights an init_from source holds (a LoRA run's base): [size, sha256 of 64 blocks spread
    over it (tpframe.data.tokenizer.sampled_sha256: 4 MiB read)] of each weight file, by its path under `path`."""
    from tpframe.data.tokenizer import sampled_sha256

    path = Path(path)
    root = tpframe_checkpoint(path) or path
    weights = (".safetensors", ".bin", ".distcp", ".index.json", "config.json", ".metadata")
    files = [f for f in sorted(root.iterdir()) if f.is_file() and f.name.endswith(weights)] if root.is_dir() else []
    files = [root] if root.is_file() else files
    return {str(f.relative_to(path)) if f != path else f.name: [f.stat().st_size, sampled_sha256(f)] for f in files}


def check_base(path: str | Path, recorded: dict | None, trained: str) -> None:
    """CheckpointError naming what changed when the init_from source at `path` no longer holds the weights that
    `recorded` (base_fingerprint; None: a checkpoint from before the record) says `trained` was trained on."""
    if recorded is None:
        return
    now = base_fingerprint(path)
    for name in sorted(recorded.keys() | now.keys()):
        was, new = recorded.get(name), now.get(name)
        if was != new:
            what = (
                "is missing" if new is None
                else "is new" if was is None
                else f"was {was[0]} bytes, is {new[0]}" if was[0] != new[0]
                else "has other content (sampled sha256)"
            )  # fmt: skip
            raise CheckpointError(
                f"the LoRA base {str(path)!r} is not the one {trained} was trained on: {name} {what}; restore that "
                "base, or train new adapters on this one"
            )


def load_init_from(
    model: nn.Module, m: ModelConfig, path: str | Path, tp_rank: int, tp: int, *, partial: bool = False
) -> str:
    """Copy this rank's shards from `path` into `model` (`partial`: a pipeline stage or an expert-parallel
    rank, which holds only some of the tensors); returns what was loaded, for the log."""
    path, tensors = Path(path), base_weights(path, m)
    source = str(tensors.path) if isinstance(tensors, CheckpointWeights) else str(path)
    n = copy_logical_tensors(model, tensors, tp_rank, tp, source=source, partial=partial)
    if hf.is_hf_dir(path):
        return f"Hugging Face {hf.read_config(path)['model_type']} model {path} ({n / 1e6:.2f}M parameters)"
    if isinstance(tensors, CheckpointWeights):
        return f"the weights of checkpoint {source} ({n / 1e6:.2f}M parameters; optimizer, step and data start afresh)"
    return f"consolidated weights {path} ({len(tensors)} tensors, {n / 1e6:.2f}M parameters)"
