"""RNG states for tensor parallelism (activation recompute replays them: tpframe.parallel.recompute).

Two streams per process:
  - the default generator, seeded identically on every TP rank: dropout on replicated
    activations (e.g. after the row-parallel reduce) is the same on all TP ranks;
  - the tracker's "tp" stream, seeded differently per TP rank: dropout on TP-split activations
    (attention probabilities of this rank's heads) differs across TP ranks.
`recompute` (tpframe.parallel.recompute) replays all of them, so a recomputed block draws the same
dropout masks twice and gives bit-identical gradients.
"""

from __future__ import annotations

import contextlib

import torch

from tpframe.parallel.state import ParallelState, get_parallel_state

TP_STREAM = "tp"


def _get_device_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_device_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named RNG states for one device; `fork(name)` runs a block on that state and advances it."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG stream {name!r} already exists")
        saved = _get_device_state(self.device)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states[name] = _get_device_state(self.device)
        _set_device_state(saved, self.device)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {name: state.clone() for name, state in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = TP_STREAM):
        if name not in self.states:
            raise KeyError(f"RNG stream {name!r} was never added; call seed_parallel_rng() first")
        saved = _get_device_state(self.device)
        _set_device_state(self.states[name], self.device)
        try:
            yield
        finally:
            self.states[name] = _get_device_state(self.device)
            _set_device_state(saved, self.device)


def parallel_seeds(seed: int, tp_rank: int, pp_rank: int, cp_rank: int = 0) -> tuple[int, int]:
    """(default seed, tp-stream seed). Default: shared by a TP group (a CP rank holds other tokens than its
    CP peers, so it draws its own); tp stream: one per TP rank."""
    default = seed + 100 * pp_rank + 1_000_003 * cp_rank
    return default, default + 2718 + tp_rank


def seed_parallel_rng(seed: int, state: ParallelState | None = None) -> RNGStatesTracker:
    """Seed the default generators and build the tracker; stored on the parallel state."""
    state = state or get_parallel_state()
    default, tp_seed = parallel_seeds(seed, state.tp_rank, state.pp_rank, state.cp_rank)
    torch.manual_seed(default)  # CPU and every CUDA device
    tracker = RNGStatesTracker(state.device)
    tracker.add(TP_STREAM, tp_seed)
    state.rng_tracker = tracker
    return tracker


def rng_state(device: torch.device, tracker: RNGStatesTracker | None) -> dict:
    """Every RNG state of this process: CPU, the CUDA device's, and the tracker's streams."""
    return {
        "cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "tracker": tracker.get_states() if tracker is not None else None,
    }


def set_rng_state(saved: dict, device: torch.device, tracker: RNGStatesTracker | None) -> None:
    torch.set_rng_state(saved["cpu"])
    if saved["cuda"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(saved["cuda"], device)
    if saved["tracker"] is not None and tracker is not None:
        tracker.set_states(saved["tracker"])


class RNGState:
    """This process's RNG streams as a checkpointable object (state_dict / load_state_dict)."""

    def __init__(self, device: torch.device, tracker: RNGStatesTracker | None):
        self.device, self.tracker = device, tracker

    def state_dict(self) -> dict:
        return rng_state(self.device, self.tracker)

    def load_state_dict(self, saved: dict) -> None:
        set_rng_state(saved, self.device, self.tracker)
