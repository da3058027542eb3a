"""`auto` backend choice: symm or nccl per call, from thresholds measured on the device.

The table (tpframe/comm/symm/thresholds.json, written by benchmarks/comm.py) holds
  - symm_ranges, per op, world size, dtype and mode ("eager" or "graph": launched from Python or
    replayed from a CUDA graph): byte ranges [lo, hi] (hi None: no upper end) where our symm
    kernels beat NCCL;
  - all_reduce_algos, per world size and dtype, mode "graph" only: [[up_to_bytes, algorithm], ...]
    (last bound None), the fastest symm all-reduce kernel by size, measured on GPU time (graph
    replay): in eager mode the launch, not the kernel, bounds small messages, so one table serves both.
Every section is nested the same way: section -> op -> world size -> dtype -> mode -> value.
Message size ("bytes") is the collective's largest tensor: the all-reduce input, the all-gather
output, the reduce-scatter input. Between measured sizes, each range ends halfway (geometrically)
between the last size symm won and the first it lost, so a call follows its nearest measurement.

Unmeasured cases: another world size uses the largest measured world size below it with its byte
limits scaled by measured/actual (each rank moves more data per byte in a larger group, so symm's
edge ends sooner), or, above none, the smallest measured world size as it is. An unmeasured dtype
borrows a measured dtype of the same element size; otherwise the answer is nccl.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

OPS = ("all_reduce", "all_gather", "reduce_scatter")
ALL_REDUCE_ALGORITHMS = ("lamport", "one_shot", "push", "two_shot")  # the symm all-reduce kernels
MODES = ("eager", "graph")
THRESHOLDS_ENV = "TPFRAME_COMM_THRESHOLDS"
DEFAULT_PATH = Path(__file__).parent / "symm" / "thresholds.json"
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def message_bytes(op: str, x: torch.Tensor, world_size: int) -> int:
    """The size `choose` is keyed on: all-gather output, all-reduce/reduce-scatter input."""
    nbytes = x.numel() * x.element_size()
    return nbytes * world_size if op == "all_gather" else nbytes


_TABLES: dict[str, dict] = {}  # path -> table, loaded once
_RESOLVED: dict = {}  # (section, op, world, dtype, mode) -> (value, scale): the per-call fast path


def load_thresholds(path: str | os.PathLike | None = None) -> dict:
    """The threshold table: `path`, else $TPFRAME_COMM_THRESHOLDS, else the packaged one ({} if absent)."""
    path = str(path or os.environ.get(THRESHOLDS_ENV) or DEFAULT_PATH)
    table = _TABLES.get(path)
    if table is None:
        if not Path(path).exists():
            if path != str(DEFAULT_PATH):
                raise ValueError(
                    f"comm thresholds file {path!r} does not exist (set by {THRESHOLDS_ENV} or the caller)"
                )
            table = {}
        else:
            with open(path) as f:
                table = json.load(f)
        _TABLES[path] = table
    return table


def clear_cache() -> None:
    """Forget loaded tables and lookups: the next call re-reads $TPFRAME_COMM_THRESHOLDS and the file."""
    _TABLES.clear()
    _RESOLVED.clear()


def _lookup(table: dict | None, section: str, op: str, world_size: int, dtype_name: str, graph: bool):
    mode = "graph" if graph else "eager"
    if table is not None:
        return _entry(table, section, op, world_size, dtype_name, mode)
    key = (section, op, world_size, dtype_name, mode)
    found = _RESOLVED.get(key)
    if found is None:  # $TPFRAME_COMM_THRESHOLDS is read here, on first use (and after clear_cache)
        found = _RESOLVED[key] = _entry(load_thresholds(), section, op, world_size, dtype_name, mode)
    return found


def _entry(table: dict, section: str, op: str, world_size: int, dtype_name: str, mode: str):
    """(value, scale) for the nearest measured (world, dtype), or (None, 1.0); see the module docstring."""
    by_world = table.get(section, {}).get(op, {})
    measured = sorted(int(w) for w in by_world)
    if not measured:
        return None, 1.0
    below = [w for w in measured if w <= world_size]
    world = below[-1] if below else measured[0]
    scale = world / world_size if below else 1.0
    by_dtype = by_world[str(world)]
    if dtype_name not in by_dtype:
        same_size = [d for d in by_dtype if _ITEMSIZE.get(d) == _ITEMSIZE.get(dtype_name)]
        if not same_size:
            return None, 1.0
        dtype_name = sorted(same_size)[0]
    by_mode = by_dtype[dtype_name]
    value = by_mode.get(mode, by_mode.get("eager"))
    return value, scale


def _check(op: str, nbytes: int, world_size: int, dtype) -> str:
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if nbytes < 0:
        raise ValueError(f"message size must be >= 0 bytes, got {nbytes}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def choose(op: str, nbytes: int, dtype, world_size: int, graph: bool = False, table: dict | None = None) -> str:
    """'symm' or 'nccl' for one call of `op` moving `nbytes` (see message_bytes) of `dtype`."""
    name = _check(op, nbytes, world_size, dtype)
    if world_size == 1 or name not in _ITEMSIZE:
        return "nccl"
    ranges, scale = _lookup(table, "symm_ranges", op, world_size, name, graph)
    for lo, hi in ranges or []:
        if lo * scale <= nbytes and (hi is None or nbytes <= hi * scale):
            return "symm"
    return "nccl"


# Without a measurement: one-shot up to 256 KiB at world size 2 (scaled by 2/world), then two-shot.
DEFAULT_ALGOS = [[256 * 1024, "one_shot"], [None, "two_shot"]]


def all_reduce_algorithm(nbytes: int, dtype, world_size: int, table: dict | None = None) -> str:
    """The fastest measured symm all-reduce kernel ('lamport', 'one_shot', 'push' or 'two_shot') for this size
    ('lamport' needs the backend's Lamport buffer; without it the backend takes 'push')."""
    name = _check("all_reduce", nbytes, world_size, dtype)
    bounds, scale = _lookup(table, "all_reduce_algos", "all_reduce", world_size, name, True)
    if bounds is None:
        bounds, scale = DEFAULT_ALGOS, min(1.0, 2 / world_size)
    for upper, algo in bounds:
        if upper is None or nbytes <= upper * scale:
            return algo
    return bounds[-1][1]
