"""Learning-rate schedule: linear warmup, then cosine (or linear, or constant) decay to min_lr; with
`decay_fraction` (warmup-stable-decay, as in MiniCPM and torchtitan's `decay_ratio`) the rate holds at lr after
warmup and the decay covers only the last `decay_fraction * total_steps` steps."""

from __future__ import annotations

import math

from tpframe.optim.config import OptimConfig


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """The learning rate for optimizer step `step` (0-based)."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return cfg.lr
    decay_start = cfg.warmup_steps
    if cfg.decay_fraction is not None:  # WSD: stable until the last fraction
        decay_start = max(cfg.warmup_steps, total_steps - round(cfg.decay_fraction * total_steps))
        if step < decay_start:
            return cfg.lr
    span = max(1, total_steps - decay_start)
    progress = min(1.0, (step - decay_start) / span)
    if cfg.decay == "linear":
        factor = 1.0 - progress
    else:
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * factor
