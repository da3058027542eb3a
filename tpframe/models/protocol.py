"""What the trainer, the generator, the pre-flight and the Hugging Face paths need from a model.

A model is named by `model.name`: "gpt", or "package.module:spec" for a `ModelSpec` (or a plain builder function, a
ModelSpec with no capability but the `supports_*` attributes it carries). The module it builds implements `Model`;
the methods below `flops_per_token` are optional (a model without them trains, and does not generate).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from tpframe.comm import Communicator
    from tpframe.models.config import ModelConfig
    from tpframe.models.hf.family import Family


@dataclass(frozen=True)
class KVCacheSpec:
    """The KV cache generation allocates (tpframe/inference/kv_cache.py): per layer id, [b, kv_heads, L, head_dim]."""

    layers: tuple[str, ...]  # the ids `cache.layer(i)` is asked for, in forward order
    kv_heads: int  # key/value heads per TP rank
    head_dim: int


class Model(Protocol):
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *, cache=None) -> torch.Tensor:
        """labels [b, s]: per-token loss [b, s] fp32; none: local logits [b, s, V/tp]; `cache` (generation): the
        local logits of the last position [b, V/tp], keys and values appended to the cache."""

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token of the whole model, for TFLOP/s and MFU."""

    def kv_cache_spec(self) -> KVCacheSpec: ...

    def start_step(self, micro_batches: int) -> None:
        """Before each try of a training step (MoE: load counts reset, auxiliary losses weighed 1/micro_batches)."""

    def finish_step(self, dp_comm: Communicator) -> dict[str, float]:
        """After the optimizer update, on every rank (MoE: the expert biases move, their loads summed over
        `dp_comm`); metrics to log."""

    def aux_losses(self) -> dict[str, torch.Tensor]:
        """{metric: [sum, count]} of the last micro-batch's auxiliary losses on this rank; the log shows the mean
        over every rank. The same keys on every rank."""


@dataclass(frozen=True)
class ModelSpec:
    """One model: its builder, the run options it honours, and its Hugging Face family (torchtitan's TrainSpec)."""

    build: Callable[..., Any]  # (ModelConfig, BuildContext) -> nn.Module implementing Model
    supports_pipeline: bool = False  # builds only ctx.stage (tpframe/models/__init__.py)
    supports_context_parallel: bool = False  # honours ctx.cp_comm
    supports_document_mask: bool = False  # honours model.attention_mask=document
    supports_selective_recompute: bool = False  # honours ctx.selective_recompute
    supports_recompute_layers: bool = False  # honours ctx.recompute_layers
    # the Hugging Face family a config is exported as and read from (tpframe/models/hf); None: no HF path
    hf_family: Callable[[ModelConfig], Family] | None = None

    def __call__(self, cfg, ctx):
        return self.build(cfg, ctx)
