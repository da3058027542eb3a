"""The `optim:` section of a run config: AdamW and its learning-rate schedule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class OptimConfig:
    lr: float = 3e-4
    min_lr: float = 3e-5
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping
    warmup_steps: int = 100
    decay: Literal["cosine", "linear", "constant"] = "cosine"
