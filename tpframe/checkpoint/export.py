"""Consolidated weights: a tpframe checkpoint -> one safetensors file with plain full tensor names,
and such a file -> the shards of a model at any TP layout.

Names are the logical ones of tpframe.parallel.sharding (fused q/k/v and gate/up split, the
vocabulary without padding rows), e.g. `blocks.0.attn.qkv.q.weight`, `embedding.weight` [V, h].
Exporting needs no process group: DCP reads the global tensors in one process.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from tpframe.checkpoint.dcp_io import read_full_tensors, read_index
from tpframe.errors import ConfigError
from tpframe.parallel.sharding import param_shards
from tpframe.paths import link_target, refuse_existing, replacing


def safetensors_module():
    try:
        import safetensors.torch
    except ImportError:
        raise RuntimeError("safetensors is not installed: pip install safetensors (or tpframe[dev])") from None
    return safetensors.torch


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """safetensors' `save_file`, with the permissions any other new file gets (the library creates it 0600: a
    serving process or another user could not read the export)."""
    from safetensors import SafetensorError

    try:
        safetensors_module().save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as e:  # its I/O errors, as the OSError they are (a full disk: ENOSPC)
        code = re.search(r"os error (\d+)", str(e))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from None
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


class CheckpointWeights(Mapping):
    """The model tensors of a tpframe checkpoint (any layout) under their logical names, each read in full when
    asked for (one at a time, on the CPU, vocabulary padding rows removed): what `copy_logical_tensors` loads into
    a model of any layout without holding the whole checkpoint in memory (checkpoint.init_from)."""

    def __init__(self, step_dir: str | Path):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path = Path(step_dir)
        meta = json.loads((self.path / "meta.json").read_text())
        self.vocab, self.vocab_tensors = meta["vocab"]["size"], set(meta["vocab"]["tensors"])
        self.index = {
            key: md
            for key, md in read_index(self.path, verify_hint=False).items()
            if key.startswith("model/") and isinstance(md, TensorStorageMetadata)
        }

    def _logical(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor[: self.vocab].contiguous() if name in self.vocab_tensors else tensor

    def __getitem__(self, name: str) -> torch.Tensor:
        key = f"model/{name}"
        if key not in self.index:
            raise KeyError(name)
        return self._logical(name, read_full_tensors(self.path, key, index={key: self.index[key]})[key])

    def read_all(self) -> dict[str, torch.Tensor]:
        """Every tensor at once (one read of the shards: an export's)."""
        return {
            key[len("model/") :]: self._logical(key[len("model/") :], tensor)
            for key, tensor in read_full_tensors(self.path, "model/", index=self.index).items()
        }

    def __iter__(self):
        return (key[len("model/") :] for key in self.index)

    def __len__(self) -> int:
        return len(self.index)


def read_model_tensors(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """Every model tensor of a checkpoint in full (vocabulary padding rows removed), on the CPU."""
    return CheckpointWeights(checkpoint).read_all()


def safetensors_metadata(path: str | Path) -> dict | None:
    """The `__metadata__` of a safetensors file's header ({} when it has none), read without the library; None when
    `path` is not a safetensors file (missing, a directory, too short, a header that is not JSON)."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 2 <= size <= 100_000_000:  # the format's own limit on the header
                return None
            header = json.loads(f.read(size))
    except (OSError, ValueError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None
    if not isinstance(header, dict):
        return None
    metadata = header.get("__metadata__", {})
    return metadata if isinstance(metadata, dict) else None


def foreign_export_file(out: str | Path) -> str | None:
    """Why writing a consolidated export to `out` would destroy something tpframe did not write, or None when `out`
    is missing or an earlier export (its header's format is "tpframe", as export_consolidated has always written)."""
    if not Path(out).exists():
        return None
    if (safetensors_metadata(out) or {}).get("format") != "tpframe":
        return "exists and is not a tpframe export (a .safetensors file whose header says format=tpframe)"
    return None


def export_consolidated(
    checkpoint: str | Path, out_file: str | Path, force: bool = False, *, tensors: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Write `checkpoint`'s model tensors (or `tensors`: a LoRA run's, merged) to `out_file`. An existing file is
    replaced only when it is an earlier export (or with `force`); the new one is written under a temporary name beside
    it and renamed over it when complete."""
    out = link_target(Path(out_file))
    if not force and (why := foreign_export_file(out)):
        refuse_existing(f"--out {str(out)!r}", why)
    tensors = read_model_tensors(checkpoint) if tensors is None else tensors
    meta = json.loads((Path(checkpoint) / "meta.json").read_text())
    header = {
        "format": "tpframe",
        "tpframe_version": meta["tpframe_version"],
        "step": str(meta["step"]),
        "model_config": json.dumps(meta["config"]["model"]),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    with replacing(out) as tmp:
        write_safetensors(tensors, tmp, header)
    return tensors


@torch.no_grad()
def copy_logical_tensors(
    model: nn.Module, tensors: Mapping[str, torch.Tensor], tp_rank: int, tp: int, *, source: str, partial: bool = False
) -> int:
    """Copy this rank's shard of each full logical tensor in `tensors` (read lazily, name by name) into
    `model`; returns the number of logical parameters loaded. A pipeline stage or an expert-parallel rank
    (`partial`) takes only its own. ConfigError (one line) for a tensor missing, extra or of another shape."""
    expected, loaded = set(), 0
    for name, param in model.named_parameters():
        if param.lora:  # LoRA's adapters are not the base's: they start afresh, or from the run's checkpoint
            continue
        for shard in param_shards(name, param, tp_rank, tp, trim_vocab=True):
            expected.add(shard.name)
            if shard.name not in tensors:
                raise ConfigError(
                    f"{source}: no tensor {shard.name!r}; was it exported from the same model architecture?"
                )
            full = tensors[shard.name]
            if tuple(full.shape) != shard.global_shape:
                raise ConfigError(
                    f"{source}: {shard.name} has shape {tuple(full.shape)}, this model needs {shard.global_shape}"
                )
            target = shard.view(param.detach())
            piece = full
            if shard.tp_dim is not None:
                piece = full.narrow(shard.tp_dim, shard.offset[shard.tp_dim], target.shape[shard.tp_dim])
            target.copy_(piece)
            loaded += full.numel()
    extra = sorted(set(tensors) - expected)
    if extra and not partial:  # a pipeline stage (an EP rank) holds only some of the tensors
        raise ConfigError(f"{source} has tensors this model does not: {extra[:5]}{' ...' if len(extra) > 5 else ''}")
    return loaded
