"""Consolidated weights: a tpframe checkpoint -> one safetensors file with plain full tensor names,
and such a file -> the shards of a model at any TP layout.

Names are the logical ones of tpframe.parallel.sharding (fused q/k/v and gate/up split, the
vocabulary without padding rows), e.g. `blocks.0.attn.qkv.q.weight`, `embedding.weight` [V, h].
Exporting needs no process group: DCP reads the global tensors in one process.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from tpframe.checkpoint.dcp_io import read_full_tensors
from tpframe.parallel.sharding import param_shards


def safetensors_module():
    try:
        import safetensors.torch
    except ImportError:
        raise RuntimeError("safetensors is not installed: pip install safetensors (or tpframe[dev])") from None
    return safetensors.torch


def read_model_tensors(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """Every model tensor of a checkpoint in full (vocabulary padding rows removed), on the CPU."""
    path = Path(checkpoint)
    meta = json.loads((path / "meta.json").read_text())
    vocab, vocab_tensors = meta["vocab"]["size"], set(meta["vocab"]["tensors"])
    out = {}
    for key, tensor in read_full_tensors(path, "model/").items():
        name = key[len("model/") :]
        out[name] = tensor[:vocab].contiguous() if name in vocab_tensors else tensor
    return out


def export_consolidated(checkpoint: str | Path, out_file: str | Path) -> dict[str, torch.Tensor]:
    tensors = read_model_tensors(checkpoint)
    meta = json.loads((Path(checkpoint) / "meta.json").read_text())
    header = {"format": "tpframe", "tpframe_version": meta["tpframe_version"], "step": str(meta["step"]),
              "model_config": json.dumps(meta["config"]["model"])}
    Path(out_file).parent.mkdir(parents=True, exist_ok=True)
    safetensors_module().save_file(tensors, str(out_file), metadata=header)
    return tensors


def load_consolidated(model: nn.Module, file: str | Path, tp_rank: int, tp: int, partial: bool = False) -> int:
    """Copy this rank's shard of every logical tensor in `file` into `model` (any TP layout). `partial`:
    the model is one pipeline stage (or chunks of several), so the file may hold tensors it does not."""
    return copy_logical_tensors(model, safetensors_module().load_file(str(file)), tp_rank, tp, source=str(file),
                                partial=partial)


@torch.no_grad()
def copy_logical_tensors(model: nn.Module, tensors: Mapping[str, torch.Tensor], tp_rank: int, tp: int, *,
                         source: str, partial: bool = False) -> int:
    """Copy this rank's shard of each full logical tensor in `tensors` (read lazily, name by name) into
    `model`; returns the number of logical parameters loaded. A pipeline stage or an expert-parallel rank
    (`partial`) takes only its own."""
    expected, loaded = set(), 0
    for name, param in model.named_parameters():
        for shard in param_shards(name, param, tp_rank, tp, trim_vocab=True):
            expected.add(shard.name)
            if shard.name not in tensors:
                raise ValueError(f"{source}: no tensor {shard.name!r}; was it exported from the same model "
                                 "architecture?")
            full = tensors[shard.name]
            if tuple(full.shape) != shard.global_shape:
                raise ValueError(f"{source}: {shard.name} has shape {tuple(full.shape)}, this model needs "
                                 f"{shard.global_shape}")
            target = shard.view(param.detach())
            piece = full
            if shard.tp_dim is not None:
                piece = full.narrow(shard.tp_dim, shard.offset[shard.tp_dim], target.shape[shard.tp_dim])
            target.copy_(piece)
            loaded += full.numel()
    extra = sorted(set(tensors) - expected)
    if extra and not partial:  # a pipeline stage (an EP rank) holds only some of the tensors
        raise ValueError(f"{source} has tensors this model does not: {extra[:5]}{' ...' if len(extra) > 5 else ''}")
    return loaded
