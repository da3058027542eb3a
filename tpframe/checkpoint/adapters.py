"""A LoRA run's checkpoint (optim.lora_rank: the adapters only, and checkpoint.init_from, their base) as a whole model
or as a PEFT adapter directory.

    tensors = model_tensors(step_dir, merge_lora=True)   # base + (alpha/r) B A: what export and generate.py read
    export_peft(step_dir, out_dir)                       # adapter_config.json + adapter_model.safetensors

An adapter pair `<module>.lora_a` [r, in], `<module>.lora_b` [out, r] (logical names of tpframe.parallel.sharding:
`blocks.0.attn.qkv.q.lora_a`) adapts the base's `<module>.weight`. PEFT keeps the same pair as
`base_model.model.<HF module>.lora_A.weight` and `.lora_B.weight` and scales it by lora_alpha / r, as tpframe does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from tpframe.checkpoint.export import CheckpointWeights, write_safetensors
from tpframe.checkpoint.hf import rules
from tpframe.checkpoint.hf_export import MARKER, foreign_export_dir, publish
from tpframe.checkpoint.init_from import base_weights, check_base
from tpframe.errors import ConfigError
from tpframe.models.config import read_model_config
from tpframe.paths import link_target, recorded_path, refuse_existing, temporary_name

PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors", MARKER)  # all that export_peft writes


def lora_of(meta: dict) -> dict | None:
    """A checkpoint's LoRA settings (rank, alpha, targets and the base's path as the run was given it), or None."""
    optim, checkpoint = meta["config"].get("optim", {}), meta["config"].get("checkpoint", {})
    if optim.get("lora_rank") is None:
        return None
    base = recorded_path(checkpoint["init_from"], meta.get("cwd"))
    return {"rank": optim["lora_rank"], "alpha": optim["lora_alpha"], "targets": optim["lora_targets"], "base": base}


def checked_lora(step_dir: Path, meta: dict) -> dict | None:
    """lora_of(meta), its base checked to hold the weights the adapters were trained on (CheckpointError if not)."""
    lora = lora_of(meta)
    if lora is not None:
        check_base(lora["base"], meta.get("lora_base"), f"checkpoint {str(step_dir)!r}")
    return lora


def _adapted(adapters: dict[str, torch.Tensor]) -> list[str]:
    """The base weights the adapters adapt: `<module>.weight` of each `<module>.lora_a`."""
    return sorted(name.removesuffix("lora_a") + "weight" for name in adapters if name.endswith(".lora_a"))


def model_tensors(step_dir: str | Path, *, merge_lora: bool = False) -> dict[str, torch.Tensor]:
    """Every model tensor of a checkpoint in full, on the CPU, by logical name. A LoRA checkpoint's (with `merge_lora`)
    are its base's with W + (alpha/r) B A for each adapted W; ConfigError for a LoRA checkpoint without `merge_lora`,
    and for `merge_lora` on another."""
    weights = CheckpointWeights(step_dir)
    meta = json.loads((Path(step_dir) / "meta.json").read_text())
    lora = checked_lora(step_dir, meta) if merge_lora else lora_of(meta)
    if lora is None and merge_lora:
        raise ConfigError(f"--merge-lora: checkpoint {str(step_dir)!r} has no LoRA adapters (optim.lora_rank unset)")
    if lora is None:
        return weights.read_all()
    if not merge_lora:
        raise ConfigError(
            f"checkpoint {str(step_dir)!r} holds LoRA adapters (optim.lora_rank={lora['rank']}) without their base "
            f"{lora['base']}: export it with --merge-lora (the merged model) or --format peft (the adapters)"
        )
    adapters = weights.read_all()
    base = base_weights(lora["base"], read_model_config(meta["config"]["model"]))
    out = {name: base[name].clone() for name in base}
    scale = lora["alpha"] / lora["rank"]
    for weight in _adapted(adapters):
        module = weight.removesuffix("weight")
        delta = scale * adapters[module + "lora_b"].float() @ adapters[module + "lora_a"].float()
        if weight not in out or out[weight].shape != delta.shape:
            raise ConfigError(f"the LoRA base {lora['base']} has no {weight} of shape {tuple(delta.shape)}")
        out[weight] = (out[weight].float() + delta).to(out[weight].dtype)
    return out


def peft_tensors(adapters: dict[str, torch.Tensor], m) -> tuple[dict[str, torch.Tensor], list[str]]:
    """PEFT's adapter tensors and the HF modules they adapt; HFMappingError (one line) where PEFT's one adapter per
    HF tensor cannot hold tpframe's (GPT-2's c_attn holds q, k and v; its Conv1D is transposed)."""
    place = {part: r for r in rules(m) for part in r.parts}
    out, modules = {}, []
    for weight in _adapted(adapters):
        r = place[weight]
        if len(r.parts) > 1 or r.transpose:
            raise ConfigError(
                f"--format peft: {r.hf} holds {', '.join(r.parts)}{' transposed' if r.transpose else ''}, which PEFT "
                "adapts as one layer with one adapter; export with --merge-lora instead"
            )
        module, logical = r.hf.removesuffix(".weight"), weight.removesuffix("weight")
        modules.append(module)
        out[f"base_model.model.{module}.lora_A.weight"] = adapters[logical + "lora_a"].contiguous()
        out[f"base_model.model.{module}.lora_B.weight"] = adapters[logical + "lora_b"].contiguous()
    return out, modules


def export_peft(step_dir: str | Path, out_dir: str | Path, force: bool = False) -> dict[str, Any]:
    """A LoRA checkpoint (any layout) -> a directory `peft.PeftModel.from_pretrained(base, out_dir)` loads onto its
    base (the run's checkpoint.init_from, a Hugging Face directory). Written beside `out_dir`, moved into place."""
    step_dir, out_dir = Path(step_dir), link_target(Path(out_dir))
    if not force and (why := foreign_export_dir(out_dir, PEFT_FILES)):
        refuse_existing(f"--out {str(out_dir)!r}", why)
    meta = json.loads((step_dir / "meta.json").read_text())
    lora = checked_lora(step_dir, meta)
    if lora is None:
        raise ConfigError(f"--format peft: checkpoint {str(step_dir)!r} has no LoRA adapters (optim.lora_rank unset)")
    tensors, modules = peft_tensors(CheckpointWeights(step_dir).read_all(), read_model_config(meta["config"]["model"]))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(Path(lora["base"]).resolve()),
        "r": lora["rank"],
        "lora_alpha": lora["alpha"],
        "target_modules": modules,  # full module names: PEFT matches them exactly
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    new = temporary_name(out_dir)
    new.mkdir()
    try:
        (new / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        write_safetensors(tensors, new / "adapter_model.safetensors", {"format": "pt"})
        mark = {"exported_by": "tpframe", "tpframe_version": meta.get("tpframe_version"), "step": meta["step"]}
        (new / MARKER).write_text(json.dumps(mark, indent=2) + "\n")
        publish(new, out_dir, PEFT_FILES)
    finally:
        if new.exists():
            shutil.rmtree(new)
    return {"modules": len(modules), "params": sum(t.numel() for t in tensors.values()), "step": meta["step"], **lora}
