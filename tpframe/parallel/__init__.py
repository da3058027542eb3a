"""Parallel state (TP/DP/PP groups), RNG streams and activation recompute."""

from tpframe.parallel.recompute import recompute
from tpframe.parallel.rng import RNGStatesTracker, seed_parallel_rng
from tpframe.parallel.state import (
    ParallelState,
    coords_of,
    default_tp_comm,
    destroy_parallel,
    get_parallel_state,
    initialize_parallel,
    is_initialized,
    rank_layout,
)

__all__ = [
    "ParallelState",
    "RNGStatesTracker",
    "coords_of",
    "default_tp_comm",
    "destroy_parallel",
    "get_parallel_state",
    "initialize_parallel",
    "is_initialized",
    "rank_layout",
    "recompute",
    "seed_parallel_rng",
]
