"""The `optim:` section of a run config: AdamW and its learning-rate schedule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


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
