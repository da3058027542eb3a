"""Low-rank adapters on the tensor-parallel linear layers (optim.lora_*; LoRA, Hu et al. 2021).

A layer with an adapter computes y = x W^T + (alpha/r) (x A^T) B^T: W frozen, A [r, in] drawn as PEFT draws it
(uniform in +-1/sqrt(in)) and B [out, r] zero, so training starts from the base model. The split adds no collective
to the layer's own:
    column (W [out/tp, in]): A replicated, B [out/tp, r] split like W's rows. The adapter reads the input the layer
        has already entered (all-gathered under SP). Each rank sees only its out/tp columns of dy, so A's gradient is
        partial: tagged `sequence_parallel`, it is summed over TP after backward with the other partial gradients.
    row (W [out, in/tp]): A [r, in/tp] split like W's columns, B replicated [out, r]. Each rank's term
        (x_r A_r^T) B^T joins its partial product before the layer's one reduction (all-reduce or reduce-scatter),
        which sums both; B's gradient is partial, summed over TP likewise.
A fused layer (q/k/v, SwiGLU's gate/up) has one adapter per logical part (A's rows stacked, B block-diagonal): each
part is what PEFT keeps for q_proj, k_proj, ... (tools/checkpoint.py export --format peft).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tpframe.errors import ConfigError
from tpframe.layers.utils import tag_param

# optim.lora_targets' names: a layer's role, or a part of one (SwiGLU's gate and up in fc1; down is fc2, Llama's name)
TARGETS = ("qkv", "proj", "fc1", "fc2", "gate", "up", "down", "head")
_PART_OF = {"gate": ("fc1", "gate"), "up": ("fc1", "up"), "down": ("fc2", None)}


@dataclass(frozen=True)
class LoRA:
    """Which layers get adapters (`targets`, names of TARGETS), of rank `rank`, scaled by alpha / rank."""

    rank: int
    alpha: float
    targets: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def parts(self, role: str | None, parts: tuple[str, ...]) -> tuple[str, ...]:
        """Which of a layer's logical parts (its fused parts, or ("weight",)) get an adapter; `role`: what the layer
        is ("qkv", "proj", "fc1", "fc2", "head"; None: never adapted)."""
        chosen = set()
        for target in self.targets:
            layer, part = _PART_OF.get(target, (target, None))
            if layer == role:
                chosen |= set(parts) if part is None else {part}
        return tuple(p for p in parts if p in chosen)


def adapted(model: nn.Module) -> set[str]:
    """The targets a built model has adapters for (optim.lora_targets names, gate/up/down included)."""
    found = set()
    for m in model.modules():
        for part in getattr(m, "lora_parts", ()):
            found.add(m.lora_role)
            found.update(t for t, (layer, p) in _PART_OF.items() if layer == m.lora_role and p in (None, part))
    return found


def _draw(rows: int, in_features: int) -> torch.Tensor:
    """A's master [rows, in] (fp32, CPU), from a generator seeded off the default one without advancing it: the base
    weights are drawn as without adapters, and every TP size draws the same A."""
    g = torch.Generator()
    g.set_state(torch.default_generator.get_state())
    g = torch.Generator().manual_seed(int(torch.randint(2**62, (), generator=g, device="cpu")))  # under meta too
    bound = 1.0 / math.sqrt(in_features)
    return torch.empty(rows, in_features, device="cpu").uniform_(-bound, bound, generator=g)


def _none(layer: nn.Module) -> None:
    layer.lora_parts = ()
    layer.register_parameter("lora_a", None)
    layer.register_parameter("lora_b", None)


def column_adapter(layer: nn.Module, lora: LoRA | None, role: str | None, parts, *, fused: bool, **where) -> None:
    """Give a column layer (its weight's row blocks `parts` ((name, rows), ...), each split over TP; `fused`: several
    logical tensors) an adapter where `lora` targets `role`: lora_a [n*r, in] replicated, lora_b [rows/tp, r] split
    like the weight (n adapted parts). `where`: in_features, tp, rank, dtype, device, vocab_rows (a head's)."""
    chosen = lora.parts(role, tuple(n for n, _ in parts)) if lora is not None else ()
    tp, r = where["tp"], lora.rank if lora is not None else 0
    layer.lora_role, layer.lora_blocks = role, tuple((rows // tp, name in chosen) for name, rows in parts)
    if not chosen:
        return _none(layer)
    layer.lora_parts, layer.lora_scale = chosen, lora.scale
    sizes = [rows for name, rows in parts if name in chosen]
    a = _draw(len(chosen) * r, where["in_features"]).to(where["device"], where["dtype"])
    b = torch.zeros(sum(sizes) // tp, r, dtype=where["dtype"], device=where["device"])
    a_parts = tuple((n, r) for n in chosen) if fused else None
    b_parts = tuple(zip(chosen, sizes)) if fused else None
    layer.lora_a = tag_param(nn.Parameter(a), tp_dim=None, sequence_parallel=True, fused_parts=a_parts, lora=True)
    layer.lora_b = tag_param(
        nn.Parameter(b), tp_dim=0, fused_parts=b_parts, vocab_rows=where.get("vocab_rows"), lora=True
    )


def row_adapter(layer: nn.Module, lora: LoRA | None, role: str | None, out_features: int, **where) -> None:
    """Give a row layer an adapter where `lora` targets `role`: lora_a [r, in/tp] split like the weight's columns,
    lora_b [out, r] replicated. `where`: in_features, tp, rank, dtype, device."""
    layer.lora_role = role
    if lora is None or not lora.parts(role, ("weight",)):
        return _none(layer)
    tp, rank = where["tp"], where["rank"]
    layer.lora_parts, layer.lora_scale = ("weight",), lora.scale
    a = _draw(lora.rank, where["in_features"]).chunk(tp, dim=1)[rank].contiguous()
    b = torch.zeros(out_features, lora.rank, dtype=where["dtype"], device=where["device"])
    layer.lora_a = tag_param(nn.Parameter(a.to(where["device"], where["dtype"])), tp_dim=1, lora=True)
    layer.lora_b = tag_param(nn.Parameter(b), tp_dim=None, sequence_parallel=True, lora=True)


def column_delta(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """A column layer's adapter term [..., out/tp] of its entered input x [..., in]."""
    u = F.linear(x, layer.lora_a) * layer.lora_scale  # [..., n*r]
    if len(layer.lora_blocks) == 1:
        return F.linear(u, layer.lora_b)
    pieces = iter(layer.lora_b.split([rows for rows, on in layer.lora_blocks if on]))
    blocks = [next(pieces) if on else layer.lora_b.new_zeros(rows, 0) for rows, on in layer.lora_blocks]
    return F.linear(u, torch.block_diag(*blocks))


def row_delta(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """A row layer's adapter term [..., out] of its input shard x [..., in/tp]: this rank's part of the sum."""
    return F.linear(F.linear(x, layer.lora_a) * layer.lora_scale, layer.lora_b)


def merged_weight(layer: nn.Module) -> torch.Tensor:
    """W + (alpha/r) B A of a one-part column layer (the head: its chunked loss kernel takes a weight)."""
    if layer.lora_a is None:
        return layer.weight
    return layer.weight + layer.lora_scale * (layer.lora_b @ layer.lora_a)


def check_lora(cfg) -> None:
    """optim.lora_* against the rest of the run (`cfg`: the run's Config): one ConfigError for what cannot apply."""
    lora = cfg.optim.lora()
    if lora is None:
        return
    key = f"optim.lora_rank={lora.rank}"
    if not cfg.checkpoint.init_from:
        raise ConfigError(
            f"{key} trains adapters on a frozen base model, which checkpoints refer to: set checkpoint.init_from to "
            "it (a Hugging Face directory, an export or a checkpoint)"
        )
    if cfg.parallel.async_tp in (True, "copy_engine"):  # "auto": the adapted layers take the plain path
        raise ConfigError(
            f"{key} with parallel.async_tp={str(cfg.parallel.async_tp).lower()}: the adapters read the layer's "
            "gathered input, which async TP never holds; set parallel.async_tp=false"
        )
    if cfg.model.moe_experts:
        raise ConfigError(f"{key}: tpframe has no adapters for mixture-of-experts models yet; set optim.lora_rank=null")
    if cfg.parallel.pp > 1 and set(lora.targets) == {"head"}:
        raise ConfigError(
            f"optim.lora_targets={list(lora.targets)} with parallel.pp={cfg.parallel.pp}: the stages without the "
            "head would train nothing; add a block's layer (qkv, proj, fc1, fc2)"
        )


def check_targets(lora: LoRA | None, model: nn.Module, name: str) -> None:
    """Every optim.lora_targets name has a layer in `model` (the whole model, built on the meta device)."""
    missing = [t for t in lora.targets if t not in adapted(model)] if lora is not None else []
    if missing:
        roles = {m.lora_role for m in model.modules() if getattr(m, "lora_role", None)}
        raise ConfigError(
            f"optim.lora_targets names {missing[0]!r}, which model.name={name!r} has no layer for (a tied head is the "
            f"embedding; gate and up are SwiGLU's); its layers: {', '.join(sorted(roles)) or 'none'}"
        )
