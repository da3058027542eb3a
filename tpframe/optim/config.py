"""The `optim:` section of a run config (AdamW and its learning-rate schedule) and its checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tpframe.config import check_ranges
from tpframe.errors import ConfigError


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
