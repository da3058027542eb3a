"""Models, and how train.py finds them: `model.name` is "gpt" or "package.module:spec".

`spec` is a `ModelSpec` (tpframe/models/protocol.py; a plain builder function is one with the `supports_*` flags
it carries as attributes). Its builder `build(cfg: ModelConfig, ctx: BuildContext) -> nn.Module` returns a module
implementing the protocol's `Model`: at least
    forward(input_ids [b, s], labels [b, s]) -> per-token loss [b, s] (fp32)
    flops_per_token(seq_len) -> float         training FLOPs per token of the whole model, for TFLOP/s and MFU
and tags every parameter (tpframe.layers.utils.tag_param: `tp_dim`, ...; the layers do it for theirs), so
checkpoints know how each tensor is split. It hands `ctx.mode` (tpframe/layers/mode.py: fused kernels, float8,
async TP) to the layers it builds, which decide from it what they run.

A model that supports pipeline parallelism (parallel.pp > 1) says so with `supports_pipeline=True`
and builds only `ctx.stage` (see `Stage` and tpframe/models/gpt.py): the blocks of `stage.layers` under
their global layer index, the embedding only on the first stage, the final norm, head and loss only on
the last. Its forward then takes input_ids on the first stage and hidden states [s(/tp), b, h] (in the
compute dtype) on the others, and returns hidden states of that shape on every stage but the last
(labels are passed to the last stage only). A weight held by both the first and the last stage (a tied
embedding) is drawn identically on both and tagged `pipeline_tied=True`: its gradients are summed
over the two stages every step.

A model that supports context parallelism (parallel.cp > 1) says so with `supports_context_parallel=True`: it
is then given only this CP rank's tokens of each sequence (input_ids and labels [b, S/cp], the chunks of
tpframe/layers/context.py), places them at their global positions (`local_positions`) and
attends over the whole sequence through `ctx.cp_comm` (ParallelAttention does, given `cp_comm`); its
per-token loss is for the local tokens.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from tpframe.comm import Communicator
from tpframe.errors import ConfigError
from tpframe.layers.mode import DEFAULT_MODE, LayerMode
from tpframe.layers.utils import is_tagged
from tpframe.models.config import ModelConfig
from tpframe.models.protocol import ModelSpec
from tpframe.parallel.pipeline.layout import ModelChunks, local_stages, split_layers
from tpframe.parallel.rng import RNGStatesTracker
from tpframe.parallel.sharding import param_shards


@dataclass(frozen=True)
class Stage:
    """The part of the model one pipeline stage builds: its blocks (global layer indices, in order),
    and whether it is the first stage (owns the embedding) and the last (final norm, head, loss)."""

    layers: tuple[int, ...] | None = None  # None: every layer
    first: bool = True
    last: bool = True

    def layer_ids(self, num_layers: int) -> tuple[int, ...]:
        return tuple(range(num_layers)) if self.layers is None else self.layers


@dataclass
class BuildContext:
    """What a model builder needs from the run: the TP communicator, parallel switches, dtype, stage, layer mode."""

    comm: Communicator
    sequence_parallel: bool = False
    activation_checkpointing: bool = False  # recompute whole blocks in backward
    recompute_layers: int | None = None  # with activation_checkpointing: only the first N blocks built here
    # recompute norms and activation functions only (needs supports_selective_recompute)
    selective_recompute: bool = False
    rng_tracker: RNGStatesTracker | None = None
    dtype: torch.dtype = torch.float32
    device: torch.device | None = None
    seed: int = 1234
    stage: Stage = field(default_factory=Stage)
    mode: LayerMode = DEFAULT_MODE  # what the layers run: fused kernels, float8, async TP (tpframe/layers/mode.py)
    cp_comm: Communicator | None = None  # context parallelism (needs supports_context_parallel): the CP group
    ep_comm: Communicator | None = None  # expert parallelism (MoE models): the group that splits the experts

    @property
    def cp(self) -> tuple[int, int]:
        """(CP rank, CP size): which tokens of each sequence this rank holds (tpframe/layers/context.py)."""
        return (self.cp_comm.rank, self.cp_comm.size) if self.cp_comm is not None else (0, 1)

    def recomputes_block(self, n: int) -> bool:
        """Whether the n-th block built here (0-based, in forward order) is recomputed whole in training."""
        return self.activation_checkpointing and (self.recompute_layers is None or n < self.recompute_layers)


def _build_gpt(cfg: ModelConfig, ctx: BuildContext) -> nn.Module:
    from tpframe.models.gpt import GPT

    return GPT(cfg, ctx)


def _gpt_family(m: ModelConfig):
    from tpframe.models.hf import gpt_family

    return gpt_family(m)


build_gpt = ModelSpec(
    _build_gpt,
    supports_pipeline=True,
    supports_context_parallel=True,
    supports_document_mask=True,  # model.attention_mask=document (tpframe/layers/documents.py)
    supports_selective_recompute=True,
    supports_recompute_layers=True,
    hf_family=_gpt_family,
)
BUILTIN = {"gpt": build_gpt}
REQUIRED_METHODS = ("forward", "flops_per_token")


def check_pipeline_support(name: str, builder: Callable, pp: int) -> None:
    """A ConfigError when parallel.pp > 1 asks a model that cannot build pipeline stages."""
    if pp > 1 and not getattr(builder, "supports_pipeline", False):
        raise ConfigError(
            f"model.name={name!r} does not build pipeline stages, so parallel.pp={pp} cannot split it; use "
            "parallel.pp=1, or make its builder honour ctx.stage and set supports_pipeline = True on it (README)"
        )


def check_context_parallel_support(name: str, builder: Callable, cp: int) -> None:
    """A ConfigError when parallel.cp > 1 asks a model that cannot take a CP rank's tokens."""
    if cp > 1 and not getattr(builder, "supports_context_parallel", False):
        raise ConfigError(
            f"model.name={name!r} does not implement context parallelism, so parallel.cp={cp} cannot split its "
            "sequences; use parallel.cp=1, or place tokens at their global positions and attend with "
            "tpframe.layers.context (or pass ctx.cp_comm to ParallelAttention), then set "
            "supports_context_parallel = True on its builder (README)"
        )


def check_document_mask_support(name: str, builder: Callable, attention_mask: str) -> None:
    """A ConfigError when model.attention_mask=document asks a model that would silently attend across documents."""
    if attention_mask == "document" and not getattr(builder, "supports_document_mask", False):
        raise ConfigError(
            f"model.name={name!r} does not implement model.attention_mask=document, so its attention would cross "
            "document ends; use model.attention_mask=causal, or attend with tpframe.layers.documents (pass "
            "documents= to ParallelAttention) and set supports_document_mask = True on its builder (README)"
        )


def check_recompute_support(name: str, builder: Callable, *, selective: bool, layers: int | None) -> None:
    """A ConfigError when the run asks for a recompute mode the model's builder does not honour."""
    if selective and not getattr(builder, "supports_selective_recompute", False):
        raise ConfigError(
            f"model.name={name!r} does not implement selective recompute; use parallel.activation_checkpointing=full "
            "or false, or honour ctx.selective_recompute and set supports_selective_recompute = True on its builder"
        )
    if layers is not None and not getattr(builder, "supports_recompute_layers", False):
        raise ConfigError(
            f"model.name={name!r} does not honour parallel.recompute_layers; remove it, or honour "
            "ctx.recompute_layers and set supports_recompute_layers = True on its builder"
        )


def check_experts_built(m: ModelConfig, model: nn.Module) -> None:
    """A ConfigError when model.moe_experts asks for experts but the built model has no MoE layer (a builder of
    one's own that ignores the key would train a dense model, logged as mixture-of-experts)."""
    from tpframe.layers.moe import MoE

    if m.moe_experts and not any(isinstance(layer, MoE) for layer in model.modules()):
        raise ConfigError(
            f"model.moe_experts={m.moe_experts}: model.name={m.name!r} built no mixture-of-experts layer, so the "
            "setting would be ignored; set model.moe_experts=0 (and parallel.ep=1), or build the MLPs as "
            "tpframe.layers.moe.MoE"
        )


def resolve_builder(name: str) -> Callable[[ModelConfig, BuildContext], nn.Module]:
    """The builder for `model.name`; a ConfigError when it cannot be imported."""
    if name in BUILTIN:
        return BUILTIN[name]
    if ":" not in name:
        raise ConfigError(
            f"model.name={name!r} is neither a built-in model ({', '.join(BUILTIN)}) nor 'module:function'"
        )
    module_name, fn_name = name.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"model.name={name!r}: cannot import {module_name!r} ({e}); is it on PYTHONPATH?") from None
    builder = getattr(module, fn_name, None)
    if not callable(builder):
        raise ConfigError(f"model.name={name!r}: {module_name!r} has no function {fn_name!r}")
    return builder


def build_model(cfg: ModelConfig, ctx: BuildContext) -> nn.Module:
    model = resolve_builder(cfg.name)(cfg, ctx)
    missing = [m for m in REQUIRED_METHODS if not callable(getattr(model, m, None))]
    if missing:
        raise ConfigError(
            f"model.name={cfg.name!r} built a {type(model).__name__} without {', '.join(missing)}() "
            "(see tpframe/models/__init__.py)"
        )
    if cfg.sliding_window is not None:  # a model that ignores the window would silently attend past it
        from tpframe.layers.attention import ParallelAttention

        layers = {n: m.window for n, m in model.named_modules() if isinstance(m, ParallelAttention)}
        other = [n for n, w in layers.items() if w != cfg.sliding_window]
        if not layers or other:
            raise ConfigError(
                f"model.sliding_window={cfg.sliding_window}: model.name={cfg.name!r} built "
                + (
                    f"attention without that window ({', '.join(other[:2])}{', ...' if len(other) > 2 else ''})"
                    if layers
                    else "no tpframe ParallelAttention to give it to"
                )
                + "; pass window=cfg.sliding_window to ParallelAttention, or leave model.sliding_window unset"
            )
    untagged = [n for n, p in model.named_parameters() if not is_tagged(p)]
    if untagged:  # an untagged TP shard would be saved as if replicated: a silent wrong resume
        raise ConfigError(
            f"model.name={cfg.name!r}: parameters {untagged[:3]} are not tagged; tag every parameter with "
            "tpframe.layers.utils.tag_param (tp_dim=None for replicated ones)"
        )
    if ctx.mode.lora is not None:  # LoRA: only the adapters train, the base stays checkpoint.init_from's
        for p in model.parameters():
            p.requires_grad_(p.lora)
    return model


class ShapeComm:
    """Stands in for a Communicator while a model is built on the meta device: sizes, no collectives."""

    def __init__(self, size: int):
        self.size, self.rank, self.device = size, 0, torch.device("meta")


def logical_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every logical tensor of the model `cfg` describes (tpframe.parallel.sharding's names, vocabulary unpadded) and
    its global shape, in the model's order: from the model itself, built on the meta device."""
    meta = torch.device("meta")
    with meta:
        model = build_model(cfg, BuildContext(ShapeComm(1), device=meta))
    return {s.name: s.global_shape for n, p in model.named_parameters() for s in param_shards(n, p, 0, 1)}


def build_stages(
    cfg, ctx, *, pp_rank: int, pp: int, virtual_stages: int = 1, layers_per_stage: list[int] | None = None
) -> nn.Module:
    """This rank's part of the model `cfg` describes: `build_model` once per local virtual stage, each
    with its `ctx.stage` (pp=1: the whole model, exactly as without pipelining)."""
    if pp == 1 and virtual_stages == 1:
        return build_model(cfg, ctx)
    stages = pp * virtual_stages
    layers = split_layers(cfg.layers, stages, layers_per_stage)
    chunks = [
        build_model(cfg, dataclasses.replace(ctx, stage=Stage(layers[s], first=s == 0, last=s == stages - 1)))
        for s in local_stages(pp_rank, pp, virtual_stages)
    ]
    return chunks[0] if virtual_stages == 1 else ModelChunks(chunks)
