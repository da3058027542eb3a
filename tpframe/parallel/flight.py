"""Which collective hung, and who never entered it: PyTorch's flight recorder, read while the run is alive.

Once `TORCH_FR_BUFFER_SIZE` is set before the process groups exist (`configure`), PyTorch records every collective
of every group, NCCL's on GPUs and gloo's on CPU (torch >= 2.8): its group, its sequence number on that group, its
op and sizes. A rank that stops (SIGSTOP, a wedged call) cannot dump its own record, so each rank's heartbeat
publishes its groups' counters, `<group>=<last entered>/<last completed>` (`status`, 0.2 ms), once a second; when a
collective waits too long, a live rank takes its oldest uncompleted collective and compares it with what each
member last published (`find_stuck`): the members that never entered it, and those that entered it but never
completed it. Every live rank also writes its whole record to `<run_dir>/comm_trace/rank_<r>` (`dump`), which
PyTorch's analyser reads: `python -m torch.distributed.flight_recorder.fr_trace <run_dir>/comm_trace -p rank_`.
"""

from __future__ import annotations

import os
import pickle
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

TRACE_PREFIX_ENV = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"  # where NCCL's own dump on a timeout goes, and ours
OURS_ENV = "TPFRAME_TRACE_PREFIX"  # the prefix configure set, seen by child processes too: replaced, a user's is kept
# the state's groups, most specific first: a group that is several of them (tp = world) is named by the first
KINDS = ("tp", "cp", "ep", "dp", "dp_cp", "edp", "pp", "embedding", "mp")


def configure(run_dir: str | Path) -> None:
    """Turn the flight recorder on (unless the user set it) with its dumps under the run dir; before any group."""
    if "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ:  # the old name: torch 2.11+ warns on every rank for it
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    if os.environ.get(TRACE_PREFIX_ENV) in (None, os.environ.get(OURS_ENV)):  # unset, or set by an earlier run
        os.environ[TRACE_PREFIX_ENV] = os.environ[OURS_ENV] = str(Path(run_dir) / "comm_trace" / "rank_")


def _records(**kwargs) -> list[dict]:
    """This rank's flight records: NCCL's (CUDA builds) and gloo's; [] where torch records nothing."""
    c10d = torch._C._distributed_c10d
    names = ("_dump_nccl_trace", "_dump_fr_trace") if torch.cuda.is_available() else ("_dump_fr_trace",)
    out = []
    for dump in filter(None, (getattr(c10d, n, None) for n in names)):
        try:
            out.append(pickle.loads(dump(**kwargs)))
        except Exception:  # noqa: BLE001 - a recorder that is off or failed: nothing to say from it
            pass
    return out


def status(ids: dict[str, str | None]) -> dict[str, tuple[int, int]]:
    """group name -> (the last collective this rank entered on it, the last it completed). The recorder keys its
    counters by a per-process backend id, which is not the group's name once a rank has skipped a group it is not in
    (new_group names every group on every rank); `ids` (id -> name, the caller's) is learned from the entries, which
    carry both, when an id is new."""
    records = _records(includeCollectives=False)
    if any(key not in ids for record in records for key in record.get("pg_status", {})):
        learned = _names(_records(includeStackTraces=False))
        ids.update({key: learned.get(key) for record in records for key in record.get("pg_status", {})})
    out = {}
    for record in records:
        for key, s in record.get("pg_status", {}).items():
            if ids.get(key) is not None:
                out[ids[key]] = (
                    int(s.get("last_enqueued_collective", -1)),
                    int(s.get("last_completed_collective", -1)),
                )
    return out


def _key(entry: dict) -> str:
    """The recorder's id of an entry's group: the key of its counters (the name on torch builds without ids)."""
    return str(entry.get("pg_id", entry["process_group"][0]))


def _names(records: list[dict]) -> dict[str, str]:
    """The recorder's group ids -> group names, from the entries (each carries both)."""
    return {_key(e): e["process_group"][0] for r in records for e in r.get("entries", [])}


def status_text(groups: dict[str, tuple[int, int]]) -> str:
    return ",".join(f"{name}={e}/{c}" for name, (e, c) in groups.items())


def parse_status(text: str) -> dict[str, tuple[int, int]]:
    out = {}
    for part in filter(None, text.split(",")):
        name, counts = part.rsplit("=", 1)
        entered, completed = counts.split("/")
        out[name] = (int(entered), int(completed))
    return out


def pending() -> list[dict]:
    """This rank's collectives not completed yet, oldest first."""
    entries = []
    for record in _records(includeStackTraces=False, onlyActive=True):
        done = {key: int(s.get("last_completed_collective", -1)) for key, s in record.get("pg_status", {}).items()}
        entries += [
            e
            for e in record.get("entries", [])
            if not e.get("is_p2p") and e["collective_seq_id"] > done.get(_key(e), -1)
        ]
    return sorted(entries, key=lambda e: e["time_created_ns"])


def group_table(state) -> dict[str, tuple[str, list[int]]]:
    """group name (the flight recorder's key) -> (its kind in the parallel state, its global ranks)."""
    table = {}
    for kind in (*KINDS, "world"):
        group = dist.group.WORLD if kind == "world" else getattr(state, f"{kind}_group", None)
        if group is not None:
            name = dist.distributed_c10d._get_process_group_name(group)
            table.setdefault(name, (kind, dist.get_process_group_ranks(group)))
    return table


@dataclass
class Stuck:
    """A collective this rank entered that did not complete, and the members it waits for, by what they published."""

    op: str
    seq: int
    group: str  # its name, the flight recorder's key
    kind: str
    ranks: list[int]
    sizes: str
    waited_s: float
    never_entered: list[int] = field(default_factory=list)  # had not entered it well after this rank had
    not_completed: list[int] = field(default_factory=list)  # had entered it, not completed it
    stopped: list[int] = field(default_factory=list)  # silent since before this rank entered it, not seen in it

    def describe(self) -> str:
        return f"{self.op} #{self.seq} on the {self.kind} group {self.ranks} ({self.sizes})"

    def waits_for(self) -> list[tuple[str, list[int]]]:
        labels = ("never entered it", "entered it, never completed it", "stopped before completing it")
        return [(label, r) for label, r in zip(labels, (self.never_entered, self.not_completed, self.stopped)) if r]


def find_stuck(entries: list[dict], table, peers: dict[int, tuple[dict, float]], rank: int) -> Stuck | None:
    """The oldest of `entries` (this rank's pending collectives) on one of the run's groups that a member is behind
    on, else the oldest; None without any. `peers`: rank -> (its published counters, seconds since it published).
    A member's counters older than this rank's entry may predate its own entry, so such a member that had not
    entered is only `stopped` (it stopped responding before completing it), not `never_entered`."""
    found = []
    for e in entries:
        name, seq = e["process_group"][0], e["collective_seq_id"]
        if name not in table:
            continue
        kind, ranks = table[name]
        waited = (time.time_ns() - e["time_created_ns"]) / 1e9
        sizes = ", ".join(f"{d}{list(s)}" for d, s in zip(e.get("input_dtypes", []), e.get("input_sizes", [])))
        stuck = Stuck(e["profiling_name"].split(":")[-1], seq, name, kind, ranks, sizes or "no tensors", waited)
        for r in (r for r in ranks if r != rank and r in peers):
            (entered, done), age = peers[r][0].get(name, (0, 0)), peers[r][1]
            if entered >= seq > done:
                stuck.not_completed.append(r)
            elif entered < seq:
                (stuck.never_entered if age < waited else stuck.stopped).append(r)
        found.append(stuck)
    return next((s for s in found if s.waits_for()), found[0] if found else None)


def _group_config(table) -> dict[str, dict[str, str]]:
    """Every group's name, kind (or torch's description) and global ranks, as the NCCL recorder writes them."""
    out = {}
    for group, name in dist.distributed_c10d._world.pg_names.items():
        try:
            ranks = dist.get_process_group_ranks(group)
        except (RuntimeError, ValueError):  # destroyed meanwhile
            continue
        out[name] = {"name": name, "desc": table.get(name, (group.group_desc,))[0], "ranks": str(ranks)}
    return out


def dump(rank: int, table) -> Path | None:
    """Write this rank's whole record (its groups' ranks filled in) to the configured prefix; None without one."""
    prefix = os.environ.get(TRACE_PREFIX_ENV)
    records = _records(includeStackTraces=False)  # with them, 500 entries took 12 s on CPU
    if prefix is None or not records:
        return None
    merged = {**records[0], "entries": [e for r in records for e in r.get("entries", [])]}
    merged["pg_config"] = _group_config(table)
    merged["pg_status"] = {k: v for r in records for k, v in r.get("pg_status", {}).items()}
    try:
        path = Path(f"{prefix}{rank}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(pickle.dumps(merged))
        return path
    except Exception:  # noqa: BLE001 - a failed dump must not hide the report
        return None
