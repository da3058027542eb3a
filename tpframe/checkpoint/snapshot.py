"""checkpoint.snapshot_interval: every N steps each rank copies its own pieces of the model and optimizer state into a
file in host memory (/dev/shm), with no serialization, checksum or resharding; a restart of the same launch at the
same layout copies them back when the snapshot is newer than the disk's `latest` (tpframe/checkpoint/files.py
chooses). A checkpoint written into /dev/shm would cost as much as one on disk: DCP serializes every piece and the
files get CRC32s (benchmarks/RESULTS.md, 'Disk checkpoint vs host-memory snapshot'); a copy costs a memcpy.

    <folder>/rank_<r>.<slot>        this rank's pieces back to back (16-byte aligned); two slots, written in turn, so a
                                    rank killed while writing leaves the previous snapshot whole
    <folder>/rank_<r>.<slot>.index  each piece's key, dtype, shape and offset; the non-tensor entries; its RNG state
    <folder>/latest.json            the checkpoint's meta.json fields and {"snapshot", "slot", "job"}: written by rank 0
                                    once every rank has written its slot
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tpframe.checkpoint.files import SNAPSHOT_LATEST, CheckpointError, write_atomic
from tpframe.parallel.sharding import LogicalChunks

ALIGN = 16  # every piece starts at a multiple: a uint8 slice viewed as any dtype


def pieces(state: dict) -> list[tuple[str, torch.Tensor]]:
    """(key, tensor) of every piece of `state` (a strategy's state_dict), in its order."""
    out = []
    for key, value in state.items():
        if isinstance(value, LogicalChunks):
            out += [(f"{key}@{','.join(map(str, o))}", t) for o, t in value.pieces]
        elif isinstance(value, torch.Tensor):
            out.append((key, value))
    return out


def _layout(items: list[tuple[str, torch.Tensor]]) -> tuple[list[tuple[str, str, list[int], int]], int]:
    """Each piece's (key, dtype, shape, offset) and the bytes of all of them."""
    table, end = [], 0
    for key, t in items:
        table.append((key, str(t.dtype), list(t.shape), end))
        end += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return table, end


def _view(buf: torch.Tensor, offset: int, t: torch.Tensor) -> torch.Tensor:
    """The bytes of `buf` at `offset` seen as a tensor of `t`'s dtype and shape."""
    return buf[offset : offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)


class Snapshots:
    """This rank's side of the snapshots of one run: `save` (a collective over `group`) and `load`."""

    def __init__(self, folder: Path, *, rank: int, group, job: str | None):
        self.folder, self.rank, self.group, self.job = folder, rank, group, job
        self.slot = 0  # the slot the next save writes (not the one `latest` names)
        self.maps: dict[int, torch.Tensor] = {}  # slot -> its file, mapped: later saves copy into warm pages

    def _map(self, slot: int, nbytes: int) -> torch.Tensor:
        path = self.folder / f"rank_{self.rank}.{slot}"
        if slot not in self.maps or self.maps[slot].numel() != max(nbytes, 1):
            self.maps.pop(slot, None)
            self.folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:  # the pages reserved now: a full /dev/shm is ENOSPC here, not a SIGBUS in the middle of a copy
                os.posix_fallocate(fd, 0, max(nbytes, 1))
            finally:
                os.close(fd)
            self.maps[slot] = torch.from_file(str(path), shared=True, size=max(nbytes, 1), dtype=torch.uint8)
        return self.maps[slot]

    def save(self, state: dict, rng: dict, meta: dict[str, Any]) -> None:
        """Copy this rank's pieces into the free slot; when every rank has, rank 0 points `latest` at it. An OSError
        on any rank (/dev/shm full) is raised on every rank, `latest` unchanged."""
        items = pieces(state)
        table, nbytes = _layout(items)
        error = None
        try:
            buf = self._map(self.slot, nbytes)
            for (_, _, _, offset), (_, t) in zip(table, items):
                _view(buf, offset, t).copy_(t)
            objects = {k: v for k, v in state.items() if not isinstance(v, (LogicalChunks, torch.Tensor))}
            index = {"pieces": table, "bytes": nbytes, "objects": objects, "rng": rng}
            torch.save(index, self.folder / f"rank_{self.rank}.{self.slot}.index")
        except (OSError, RuntimeError) as e:  # a full tmpfs: SIGBUS is not raised for a file sized up front
            error = f"rank {self.rank}: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[-1]}"
        errors: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(errors, error, group=self.group)
        if failed := [e for e in errors if e]:
            raise OSError("; ".join(failed)[:400])
        if self.rank == 0:
            write_atomic(self.folder / SNAPSHOT_LATEST, json.dumps(dict(meta, snapshot=True, slot=self.slot)))
        dist.barrier(group=self.group)
        self.slot = 1 - self.slot

    def load(self, state: dict, meta: dict) -> dict:
        """Copy the snapshot `meta` names into `state`'s pieces (its non-tensor entries set); this rank's RNG state."""
        slot = meta["slot"]
        index = torch.load(self.folder / f"rank_{self.rank}.{slot}.index", weights_only=False)
        items = pieces(state)
        table, nbytes = _layout(items)
        if table != index["pieces"]:
            raise CheckpointError(
                f"the snapshot of step {meta['step']} in {self.folder} does not hold this run's pieces (was the "
                "config changed between the launch's attempts?); remove the folder to resume from the disk's latest"
            )
        path = self.folder / f"rank_{self.rank}.{slot}"
        buf = torch.from_file(str(path), shared=False, size=max(nbytes, 1), dtype=torch.uint8)
        for (_, _, _, offset), (_, t) in zip(table, items):
            t.copy_(_view(buf, offset, t))
        state.update(index["objects"])
        self.slot = 1 - slot
        return index["rng"]
