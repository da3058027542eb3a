"""Activation recompute (activation checkpointing): keep a block's input, recompute the rest in backward.

torch's non-reentrant checkpoint replays the CPU and CUDA default RNG states; `recompute` replays the
tracker's TP streams too, so every dropout mask matches the first pass and gradients are bit-identical.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.utils.checkpoint

from tpframe.parallel.rng import RNGStatesTracker
from tpframe.parallel.state import get_parallel_state, is_initialized


def recompute(fn: Callable[..., Any], *args, tracker: RNGStatesTracker | None = None, preserve_rng: bool = True):
    """Run `fn(*args)` without keeping its activations; recompute them in backward.

    torch's non-reentrant checkpoint replays the CPU and CUDA default RNG states; the context
    below replays the tracker's streams too, so every dropout mask matches the first pass.
    `tracker` defaults to the parallel state's. `preserve_rng=False` (a block that draws no random
    numbers: no dropout) saves and restores no RNG state, which also lets a CUDA graph capture it
    (setting a generator's state is a host operation a graph cannot replay).
    """
    if not preserve_rng:
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
    if tracker is None:
        tracker = get_parallel_state().rng_tracker if is_initialized() else None
    if tracker is None:
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True)
    saved: dict[str, dict] = {}

    @contextlib.contextmanager
    def forward_context():
        saved["streams"] = tracker.get_states()
        yield

    @contextlib.contextmanager
    def recompute_context():
        current = tracker.get_states()
        tracker.set_states(saved["streams"])
        try:
            yield
        finally:
            tracker.set_states(current)

    return torch.utils.checkpoint.checkpoint(
        fn,
        *args,
        use_reentrant=False,
        preserve_rng_state=True,
        context_fn=lambda: (forward_context(), recompute_context()),
    )
