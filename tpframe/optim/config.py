"""The `optim:` section of a run config (AdamW, its learning-rate schedule, LoRA's adapters) and its checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from tpframe.config import check_ranges
from tpframe.errors import ConfigError
from tpframe.layers.lora import TARGETS, LoRA


@dataclass
class OptimConfig:
    lr: float = 3e-4  # peak learning rate (after warmup)
    min_lr: float = 3e-5  # the schedule decays to this
    weight_decay: float = 0.1  # AdamW decoupled weight decay
    beta1: float = 0.9  # AdamW
    beta2: float = 0.95  # AdamW
    eps: float = 1e-8  # AdamW
    grad_clip: float = 1.0  # 0 disables clipping
    warmup_steps: int = 100  # linear warmup from 0 to lr
    decay: Literal["cosine", "linear", "constant"] = "cosine"  # from lr to min_lr over the remaining steps
    # warmup-stable-decay (WSD): hold lr after warmup and decay only over this last fraction of train.steps
    # (e.g. 0.2); None: decay from the end of warmup
    decay_fraction: float | None = None
    # LoRA (docs/finetuning.md): train rank-r adapters on the layers of lora_targets, the base frozen (it stays
    # checkpoint.init_from's); null: train every parameter
    lora_rank: int | None = None
    lora_alpha: float = 16.0  # the adapters' output is scaled by lora_alpha / lora_rank (PEFT's lora_alpha)
    # the layers that get adapters: qkv, proj (attention), fc1, fc2 (MLP; gate, up: SwiGLU's halves of fc1; down =
    # fc2), head (an untied output layer)
    lora_targets: list[Literal[TARGETS]] = field(default_factory=lambda: ["qkv", "proj", "fc1", "fc2"])

    def lora(self) -> LoRA | None:
        """The adapters the layers build (tpframe/layers/lora.py), or None without optim.lora_rank."""
        if self.lora_rank is None:
            return None
        return LoRA(self.lora_rank, self.lora_alpha, tuple(self.lora_targets))


# (key, lowest, highest, lowest included); every float is finite already (tpframe.config.check_finite)
RANGES = (("eps", 0.0, 1.0, False), ("weight_decay", 0.0, None, True), ("grad_clip", 0.0, None, True))


def check_optim(o: OptimConfig) -> None:
    """The `optim:` section: AdamW's numbers in range, a schedule that decays from lr to min_lr."""
    check_ranges("optim", o, RANGES)
    if o.lr <= 0 or o.min_lr < 0 or o.min_lr > o.lr:
        raise ConfigError(f"optim.lr={o.lr} and optim.min_lr={o.min_lr} need 0 <= min_lr <= lr and lr > 0")
    if o.warmup_steps < 0:  # grad_clip and weight_decay: RANGES
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
    if o.lora_rank is not None and o.lora_rank < 1:
        raise ConfigError(
            f"optim.lora_rank={o.lora_rank} must be a positive integer (the adapters' rank, e.g. 16), or null to "
            "train every parameter"
        )
    given = [f"optim.{k}" for k in ("lora_alpha", "lora_targets") if getattr(o, k) != getattr(OptimConfig(), k)]
    if o.lora_rank is None and given:
        raise ConfigError(
            f"{' and '.join(given)} set LoRA's adapters, but optim.lora_rank is null, which trains every parameter: "
            "set optim.lora_rank (e.g. 16), or leave those keys out for a full fine-tune"
        )
    if o.lora_rank is not None and (o.lora_alpha <= 0 or not o.lora_targets):
        raise ConfigError(
            f"optim.lora_alpha={o.lora_alpha} and optim.lora_targets={o.lora_targets} need a positive alpha and at "
            f"least one target of {', '.join(TARGETS)}"
        )
