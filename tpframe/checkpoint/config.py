"""The `checkpoint:` section of a run config and its checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tpframe.config import check_at_least, check_paths_given


@dataclass
class CheckpointConfig:
    dir: str | None = None  # default: <run_dir>/checkpoints
    interval: int = 0  # save every N steps; 0: only at the end and on preemption signals
    keep_last: int = 3  # published checkpoints kept; older ones are deleted
    load: str | None = None  # a checkpoint directory (or a checkpoints root with `latest`) to resume from
    auto_resume: bool = True  # resume from <dir>/latest when it exists
    init_from: str | None = None  # a new run's weights: exported .safetensors or an HF dir (ignored when resuming)
    verify: Literal["size", "crc"] = "crc"  # how shard files are checked before loading
    async_save: bool = False  # write in a background thread while training goes on
    # every N steps (not a disk checkpoint's), a copy in host memory (/dev/shm) that a restart of
    # `python -m tpframe.launch --max-restarts K` resumes from when it is newer than the disk's: a restart loses at most
    # N steps without a disk write (docs/operations.md); one node; 0: off
    snapshot_interval: int = 0
    save_on_signal: bool = True  # SIGTERM / SIGUSR1: save and exit cleanly
    save_at_end: bool = True  # save after the last step


# what to give instead of "" for a path key (checked by tpframe.config.check_paths_given)
PATH_KEYS = {
    "dir": "a folder, or leave it out (null) for <train.run_dir>/checkpoints",
    "load": "a step_* folder or a checkpoints folder holding 'latest', or leave it out (null)",
    "init_from": "a .safetensors file or a Hugging Face model folder, or leave it out (null)",
}


def check_checkpoint(c: CheckpointConfig) -> None:
    """The `checkpoint:` section: checkpoints to keep, paths that are not empty (checkpoint.interval: with the
    train section's step counts)."""
    check_at_least("checkpoint", c, ("keep_last",))
    check_at_least("checkpoint", c, ("snapshot_interval",), 0)
    check_paths_given("checkpoint", c, PATH_KEYS)
