"""torch.distributed.checkpoint (DCP) over `LogicalChunks`: every rank writes and reads rectangles of global tensors.

DCP already understands objects with `__create_write_items__` / `__create_chunk_list__` /
`__get_tensor_shard__` (its `_Checkpointable` hooks); the two planners here only make DCP look a
piece up through them, and keep the load planner's set-up from dropping non-tensor values. DCP then
de-duplicates replicated pieces on save and, on load, reads for each local rectangle whatever saved
rectangles overlap it: that is what lets any layout and strategy read any checkpoint.
"""

from __future__ import annotations

import warnings
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from tpframe.checkpoint.files import read_cause, unreadable
from tpframe.parallel.sharding import LogicalChunks


class ChunkSavePlanner(DefaultSavePlanner):
    def lookup_object(self, index):
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, LogicalChunks) else super().lookup_object(index)


class ChunkLoadPlanner(DefaultLoadPlanner):
    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # DefaultLoadPlanner's set-up rewrites every value that is not a tensor (to None): keep ours
        chunks = {k: v for k, v in state_dict.items() if isinstance(v, LogicalChunks)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        state_dict.update(chunks)
        self.state_dict.update(chunks)

    def lookup_tensor(self, index):
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, LogicalChunks) else super().lookup_tensor(index)


def to_cpu(state: dict) -> dict:
    """A CPU copy of a flat state (pieces stay pieces): what an async save writes while training goes on."""
    copy = lambda t: t.detach().to("cpu", copy=True)  # noqa: E731
    return {
        k: v.map(copy) if isinstance(v, LogicalChunks) else copy(v) if isinstance(v, torch.Tensor) else v
        for k, v in state.items()
    }


class CpuStager:
    """dcp.async_save's stager (the AsyncStager protocol): copy to CPU on the caller's thread, then return."""

    should_synchronize_after_execute = False

    def stage(self, state_dict: dict) -> dict:
        return to_cpu(state_dict)

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def save(state: dict, path, group: dist.ProcessGroup) -> None:
    dcp.save(state, checkpoint_id=str(path), planner=ChunkSavePlanner(), process_group=group)


def async_save(state: dict, path, group: dist.ProcessGroup) -> Future:
    """Stage `state` to CPU now and write it in a background thread (its collectives on `group`)."""
    return dcp.async_save(
        state, checkpoint_id=str(path), planner=ChunkSavePlanner(), process_group=group, async_stager=CpuStager()
    )


def load(state: dict, path, group: dist.ProcessGroup) -> None:
    dcp.load(state, checkpoint_id=str(path), planner=ChunkLoadPlanner(), process_group=group)


def read_index(path, *, verify_hint: bool = True) -> dict:
    """DCP's index of a checkpoint directory (its .metadata): every tensor and object, by name. A corrupt one is a
    CheckpointError naming it (a size check lets a flipped byte through; unpickling raises many types)."""
    try:
        return FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001
        raise unreadable(Path(path), ".metadata", read_cause(e), verify_hint=verify_hint) from None


def saved_keys(path) -> set[str]:
    """The names of every tensor and object a checkpoint directory holds."""
    return set(read_index(path))


def read_full_tensors(path, prefix: str = "model/", *, index: dict | None = None) -> dict[str, torch.Tensor]:
    """Every tensor under `prefix` in full, on the CPU, in one process (no process group needed). `index`: the
    checkpoint's (read_index), when the caller has it already."""
    index = read_index(path, verify_hint=False) if index is None else index
    wanted = {
        key: torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in index.items()
        if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # DCP warns that it reads without a process group: that is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(wanted, checkpoint_id=str(path), no_dist=True)
    return wanted
