"""Models, and how train.py finds them: `model.name` is "gpt" or "package.module:build_fn".

A model builder has the signature `build(cfg: ModelConfig, ctx: BuildContext) -> nn.Module`, and the
module it returns must provide
    forward(input_ids [b, s], labels [b, s]) -> per-token loss [b, s] (fp32)
    num_params() -> int                       parameters of the whole model (all TP shards)
    flops_per_token(seq_len) -> float         training FLOPs per token, for TFLOP/s and MFU
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from tpframe.comm import Communicator
from tpframe.training.config import ConfigError, ModelConfig


@dataclass
class BuildContext:
    """What a model builder needs from the run: the TP communicator, parallel switches, dtype."""

    comm: Communicator
    sequence_parallel: bool = False
    activation_checkpointing: bool = False
    rng_tracker: object = None
    dtype: torch.dtype = torch.float32
    device: torch.device | None = None
    seed: int = 1234


def build_gpt(cfg: ModelConfig, ctx: BuildContext) -> nn.Module:
    from tpframe.models.gpt import GPT

    return GPT(cfg, ctx.comm, ctx.sequence_parallel, ctx.activation_checkpointing, ctx.rng_tracker, ctx.dtype, ctx.device, ctx.seed)


BUILTIN = {"gpt": build_gpt}
REQUIRED_METHODS = ("forward", "num_params", "flops_per_token")


def resolve_builder(name: str) -> Callable[[ModelConfig, BuildContext], nn.Module]:
    """The builder for `model.name`; a ConfigError when it cannot be imported."""
    if name in BUILTIN:
        return BUILTIN[name]
    if ":" not in name:
        raise ConfigError(f"model.name={name!r} is neither a built-in model ({', '.join(BUILTIN)}) nor 'module:function'")
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
        raise ConfigError(f"model.name={cfg.name!r} built a {type(model).__name__} without {', '.join(missing)}() (see tpframe/models/__init__.py)")
    return model
