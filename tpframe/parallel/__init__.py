"""Parallel state (TP/DP/PP groups), RNG streams and activation checkpointing."""

from tpframe.parallel.random import RNGStatesTracker, checkpoint, seed_parallel_rng
from tpframe.parallel.state import (
    ParallelState,
    coords_of,
    destroy_parallel,
    get_parallel_state,
    initialize_parallel,
    is_initialized,
    rank_layout,
)

__all__ = [
    "ParallelState",
    "RNGStatesTracker",
    "checkpoint",
    "coords_of",
    "destroy_parallel",
    "get_parallel_state",
    "initialize_parallel",
    "is_initialized",
    "rank_layout",
    "seed_parallel_rng",
]
