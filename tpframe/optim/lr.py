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


SCHEDULE_KEYS = ("lr", "min_lr", "warmup_steps", "decay", "decay_fraction")


def schedule_change(step: int, cfg: OptimConfig, total_steps: int, saved: OptimConfig, saved_steps: int) -> str | None:
    """What changed in the learning-rate schedule since a checkpoint written with (`saved`, `saved_steps`), as one
    line for a run resuming at `step` under (`cfg`, `total_steps`); None when nothing did. A shorter or longer
    train.steps moves the whole decay: the next step's rate is no longer the one the interrupted run would have used."""
    changed = [f"train.steps {saved_steps} -> {total_steps}"] if saved_steps != total_steps else []
    changed += [
        f"optim.{k} {getattr(saved, k)} -> {getattr(cfg, k)}"
        for k in SCHEDULE_KEYS
        if getattr(saved, k) != getattr(cfg, k)
    ]
    if not changed:
        return None
    now, before = lr_at(step, cfg, total_steps), lr_at(step, saved, saved_steps)
    return (
        f"the learning-rate schedule changed since the checkpoint ({', '.join(changed)}): step {step + 1} runs "
        f"at lr {now:.3g}" + (f", not {before:.3g}" if now != before else " as before, later steps differ")
    )
