"""The checkpointer: saves on an interval, at the end, on SIGTERM/SIGUSR1 and when `train.time_limit_minutes` has
passed (then training stops, for the next job to resume); resumes any layout.

It is handed the objects whose state a checkpoint holds, each with `state_dict()`/`load_state_dict()`
(torchtitan's Stateful pattern), and reaches into nothing else:
  - `tensors`: the gradient/optimizer strategy, whose state_dict is the model and optimizer as
    pieces of global logical tensors (tpframe/optim/strategy.py), written through DCP;
  - `meta`: small JSON-able states (the trainer's counters, the data position), in meta.json;
  - `rng`: this rank's RNG streams, in rng_<rank>.pt (restored only on the same layout).
Writing goes to `step_N.partial`; only when every rank has finished are sizes and CRC32s recorded in
meta.json, the directory renamed and `latest` rewritten, so a crash mid-save leaves the previous
checkpoint as `latest`. An async save copies the state to CPU and writes it with `dcp.async_save`.
A write that fails on any rank (a full disk, a folder made read-only) is agreed on by all of them after each
phase, the partial directory is removed, and every rank raises the same `SaveFailed` line: a rank never waits
in a collective for a peer that has given up, and the previous checkpoint stays `latest`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from tpframe.checkpoint import dcp_io
from tpframe.checkpoint.files import (
    CHECKPOINTS_KEY,
    FORMAT,
    JOB_ENV,
    LATEST,
    META,
    CheckpointError,
    SaveFailed,
    checkpoint_root,
    file_record,
    last_healthy,
    prune,
    read_cause,
    remove_stale_partials,
    restores_rng,
    snapshot_root,
    unreadable,
    write_atomic,
)
from tpframe.checkpoint.finite import all_finite
from tpframe.checkpoint.snapshot import Snapshots
from tpframe.models.config import architecture, padded_vocab
from tpframe.parallel.heartbeat import is_comm_failure
from tpframe.paths import free_space
from tpframe.version import __version__

FAULT_ENV = "TPFRAME_FAULT_KILL_DURING_SAVE"  # test hook: SIGKILL this rank mid-save at the given step


class Checkpointer:
    def __init__(
        self,
        cfg,
        parallel,
        *,
        tensors,
        meta: dict[str, Any],
        rng,
        vocab_tensors: list[str],
        resume: tuple = (None, None),
        log: Callable[[str], None] = print,
        health=None,
    ):
        self.cfg, self.parallel, self.log = cfg, parallel, log
        self.vocab_tensors = vocab_tensors  # logical names of the padded vocabulary tables (export trims them)
        self.tensors, self.meta_states, self.rng = tensors, meta, rng
        self.health = health  # a StepGuard (tpframe/training/health.py): whether a step may be called healthy
        self.root = checkpoint_root(cfg)
        self.resume_path, self.resume_meta = resume
        self.lora_base = None  # what a LoRA run's base held at its start (init_from.check_base compares it)
        if cfg.optim.lora_rank is not None and cfg.checkpoint.init_from:
            from tpframe.checkpoint.init_from import base_fingerprint

            # resuming: the record the pre-flight's check_resume just found the base still matches, not read again
            recorded = (self.resume_meta or {}).get("lora_base")
            self.lora_base = recorded if recorded is not None else base_fingerprint(cfg.checkpoint.init_from)
        self.loaded_from: Path | None = None
        # Bookkeeping runs over gloo groups of its own: object collectives need no GPU, and the
        # background writer of an async save must not share a group with the main thread.
        timeout = timedelta(seconds=cfg.comm.timeout_s)
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        self.async_group = dist.new_group(backend="gloo", timeout=timeout) if cfg.checkpoint.async_save else None
        self.groups = {"checkpoint": self.group, "checkpoint writer": self.async_group}  # named in hang reports
        self.pending: tuple[Any, int, Path, dict] | None = None  # (future, step, partial dir, meta) of an async save
        self.signal_received: int | None = None
        self.started = time.monotonic()  # train.time_limit_minutes counts from here
        self.last_saved_step = -1
        if cfg.checkpoint.save_on_signal:
            for sig in (signal.SIGTERM, signal.SIGUSR1):
                signal.signal(sig, self._on_signal)
        self.snapshots = None  # checkpoint.snapshot_interval: this rank's copies in host memory
        if cfg.checkpoint.snapshot_interval:
            folder = snapshot_root(self.root)
            self.snapshots = Snapshots(folder, rank=parallel.rank, group=self.group, job=os.environ.get(JOB_ENV))
            if parallel.rank == 0 and not (self.resume_meta or {}).get("snapshot"):
                shutil.rmtree(folder, ignore_errors=True)  # another launch's, or older than the disk's latest
        if parallel.rank == 0:
            remove_stale_partials(self.root)
            resumed = (self.resume_meta or {}).get("train", {}).get("step", -1)  # for the launcher's restart lines
            dist.distributed_c10d._get_default_store().set(CHECKPOINTS_KEY, f"{resumed} {self.root}")

    def _on_signal(self, signum, frame) -> None:
        self.signal_received = signum

    # -- the hooks the trainer calls -------------------------------------------------------------
    def after_step(self, step: int) -> bool:
        """Save if due (or on a preemption signal); True when training must stop."""
        # One tiny all-reduce: did any rank get a signal; has every rank finished its async write; has any rank's
        # clock passed train.time_limit_minutes?
        busy = self.pending is not None and not self.pending[0].done()
        limit = self.cfg.train.time_limit_minutes
        late = limit is not None and time.monotonic() - self.started >= 60 * limit
        flags = torch.tensor([float(self.signal_received is not None), float(busy), float(late)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        if self.pending is not None and flags[1] == 0:
            self._finish_async()
        if flags[0] > 0 or (flags[2] > 0 and step < self.cfg.train.steps):
            why = (
                "preemption signal received"
                if flags[0] > 0
                else f"train.time_limit_minutes={limit:g} reached ({(time.monotonic() - self.started) / 60:.1f} min)"
            )
            self.log(f"{why}: saving step {step} and stopping; launch the same command again to resume")
            self.save(step, blocking=True)
            return True
        interval, every = self.cfg.checkpoint.interval, self.cfg.checkpoint.snapshot_interval
        if interval and step % interval == 0 and step < self.cfg.train.steps:
            self.save(step, blocking=not self.cfg.checkpoint.async_save)
        elif self.snapshots is not None and step % every == 0 and step < self.cfg.train.steps:
            self._snapshot(step)
        return False

    def _snapshot(self, step: int) -> None:
        """A snapshot in host memory (tpframe/checkpoint/snapshot.py), never of a state a disk save would refuse; one
        that cannot be written (/dev/shm full) turns them off and training goes on: the disk's are the durable copy."""
        state = self.tensors.state_dict()
        if (self.health is not None and self.health.consecutive_skips) or not all_finite(state, self.group):
            return
        try:
            self.snapshots.save(state, self.rng.state_dict(), self._meta(step) | {"job": self.snapshots.job})
        except OSError as e:
            self.log(f"step {step}: snapshots are off for the rest of this run ({e}); disk checkpoints go on")
            self.snapshots = None

    def finish(self, step: int, stopped: bool) -> None:
        """End of training: write the final checkpoint and wait for any background write."""
        if self.cfg.checkpoint.save_at_end and step != self.last_saved_step and not stopped:
            self.save(step, blocking=True)
        if self.pending is not None:
            self._finish_async()
        if self.snapshots is not None and self.parallel.rank == 0:
            shutil.rmtree(self.snapshots.folder, ignore_errors=True)  # the run ended: no restart will read them

    # -- saving ----------------------------------------------------------------------------------
    def save(self, step: int, blocking: bool = True) -> Path | None:
        """Write step `step` (None inside a streak of skipped steps, or when its state is not finite on some rank:
        never published, so `latest` stays the last checkpoint a resume can trust)."""
        if self.pending is not None:  # one write in flight at a time
            self._finish_async()
        if self.health is not None and self.health.consecutive_skips:  # every rank alike: the step's verdict is agreed
            self.log(
                f"step {step}: inside a streak of {self.health.consecutive_skips} skipped non-finite steps: no "
                f"checkpoint is written; the last healthy one is {last_healthy(self.root) or 'none'}"
            )
            return None
        state = self.tensors.state_dict()
        if not all_finite(state, self.group):
            self.log(
                f"step {step}: the model or optimizer state holds non-finite values: no checkpoint is written; "
                f"the last one is {last_healthy(self.root) or 'none'}"
            )
            return None
        final, partial = self.root / f"step_{step:08d}", self.root / f"step_{step:08d}.partial"

        def make_partial() -> None:
            if self.parallel.rank == 0:
                self.root.mkdir(parents=True, exist_ok=True)
                for stale in (partial, final):
                    if stale.exists():
                        shutil.rmtree(stale)
                partial.mkdir()

        self._agreed(step, partial, make_partial)  # a collective: every rank waits for the folder
        self._agreed(step, partial, lambda: torch.save(self.rng.state_dict(), partial / f"rng_{self.parallel.rank}.pt"))
        meta = self._meta(step)
        if blocking:
            self._agreed(step, partial, lambda: dcp_io.save(state, partial, self.group))
            self._fault_injection(step)
            self._publish(partial, final, meta)
        else:  # staged to CPU now (the next step changes the weights), written in the background
            pending = None

            def start() -> None:
                nonlocal pending
                pending = dcp_io.async_save(state, partial, self.async_group)

            self._agreed(step, partial, start)
            self.pending = (pending, step, partial, meta)
        self.last_saved_step = step
        return final

    def _finish_async(self) -> None:
        future, step, partial, meta = self.pending
        self.pending = None
        self._agreed(step, partial, future.result)  # re-raises a failed background write
        self._fault_injection(step)
        self._publish(partial, self.root / f"step_{step:08d}", meta)

    def _agreed(self, step: int, partial: Path, work: Callable[[], Any]) -> None:
        """Run this rank's part of a save; when it failed on any rank, remove the partial checkpoint and raise the
        same SaveFailed on every rank (a collective: every rank calls it for every phase)."""
        error = None
        try:
            work()
        except CheckpointException as e:  # DCP's own collective failure: every rank holds every failing rank's cause
            error = "; ".join(f"rank {r}: {_cause(exc)}" for r, (exc, _) in sorted(e.failures.items()))
        except (OSError, RuntimeError) as e:  # torch.save's write failures are RuntimeErrors
            if is_comm_failure(e):  # a peer gone: the heartbeat's line (exit 4), not a disk's
                raise
            error = f"rank {self.parallel.rank}: {_cause(e)}"
        errors: list = [None] * self.parallel.world_size
        dist.all_gather_object(errors, error, group=self.group)
        failed = list(dict.fromkeys(e for e in errors if e))
        if not failed:
            return
        if self.parallel.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # its space back; `latest` never pointed at it
        dist.barrier(group=self.group)
        intact = (self.root / LATEST).read_text().strip() if (self.root / LATEST).is_file() else None
        raise SaveFailed(
            f"checkpoint step {step} could not be written to {str(self.root)!r} ({'; '.join(failed)[:400]}; "
            f"{free_space(self.root)}); "
            + (
                f"the last one, {intact}, is intact: free space (or set checkpoint.dir) and relaunch to resume from it"
                if intact
                else "no earlier checkpoint exists: free space or set checkpoint.dir, then relaunch"
            )
        )

    def _fault_injection(self, step: int) -> None:
        if os.environ.get(FAULT_ENV) == str(step) and self.parallel.rank == int(
            os.environ.get("TPFRAME_FAULT_RANK", "0")
        ):
            os.kill(os.getpid(), signal.SIGKILL)  # a real kill: the shards are written, nothing is published

    def _meta(self, step: int) -> dict[str, Any]:
        cfg, p = self.cfg, self.parallel
        return {
            "format": FORMAT,
            "tpframe_version": __version__,
            "torch_version": torch.__version__,
            "step": step,
            **{name: obj.state_dict() for name, obj in self.meta_states.items()},
            "architecture": architecture(cfg.model),
            "layout": self.layout(),
            "vocab": {
                "size": cfg.model.vocab_size,
                "padded": padded_vocab(cfg.model, p.tp),
                "tensors": self.vocab_tensors,
            },
            "config": cfg.to_dict(),
            "cwd": os.getcwd(),  # what the config's relative paths are relative to (tpframe.paths.recorded_path)
            "healthy": self.health.healthy_since(self.last_saved_step) if self.health is not None else True,
            **({"lora_base": self.lora_base} if self.lora_base is not None else {}),
        }

    def layout(self) -> dict[str, Any]:
        p = self.parallel
        return {"world": p.world_size, "tp": p.tp, "cp": p.cp, "dp": p.dp, "pp": p.pp, "ep": p.ep}

    def _publish(self, partial: Path, final: Path, meta: dict[str, Any]) -> None:
        """Every rank is done: record sizes and CRCs, write meta.json, rename, point `latest` at it."""
        rank = self.parallel.rank
        mine = {
            f.name: file_record(f)
            for f in sorted(partial.iterdir())
            if f.name.startswith(f"__{rank}_") or f.name == f"rng_{rank}.pt" or (rank == 0 and f.name == ".metadata")
        }
        gathered: list[dict] = [None] * self.parallel.world_size  # type: ignore[list-item]
        dist.all_gather_object(gathered, mine, group=self.group)

        def publish() -> None:
            if rank == 0:
                record = dict(meta, files={k: v for d in gathered for k, v in d.items()}, saved_at=time.time())
                write_atomic(partial / META, json.dumps(record, indent=1))
                os.rename(partial, final)
                write_atomic(self.root / LATEST, final.name)

        self._agreed(meta["step"], partial, publish)
        if rank == 0:
            prune(self.root, self.cfg.checkpoint.keep_last)
        dist.barrier(group=self.group)

    # -- loading ---------------------------------------------------------------------------------
    def load(self) -> int | None:
        """Resume from the checkpoint preflight chose (if any): every state, resharded to this layout.
        Returns the step resumed at, or None."""
        if self.resume_path is None:
            return None
        path, meta = self.resume_path, self.resume_meta
        if meta.get("snapshot"):
            return self._load_snapshot(path, meta)
        keys = self._read(path, meta, lambda: dcp_io.saved_keys(path))
        try:
            state = self.tensors.state_dict(available=keys)
        except KeyError as e:
            raise CheckpointError(f"{path}: {e.args[0]}") from None
        self._read(path, meta, lambda: dcp_io.load(state, path, self.group))
        self.tensors.load_state_dict(state)
        for name, obj in self.meta_states.items():
            if name in meta:  # a checkpoint older than a state (e.g. "health") leaves it fresh
                obj.load_state_dict(meta[name])
        if restores_rng(meta["layout"], self.layout()):
            self.rng.load_state_dict(
                self._read(path, meta, lambda: torch.load(path / f"rng_{self.parallel.rank}.pt", weights_only=False))
            )
        else:
            self.log(
                f"resharding checkpoint from layout {meta['layout']} to {self.layout()}: model and optimizer "
                "restored; dropout RNG streams continue from this run's seed"
            )
        self.loaded_from = path
        self.last_saved_step = meta["step"]
        dist.barrier(group=self.group)
        return meta["step"]

    def _load_snapshot(self, path: Path, meta: dict) -> int:
        """A restart at the snapshot's layout: every piece copied back, the data position and RNG as they were."""
        state = self.tensors.state_dict()
        rng = self._read(path, meta, lambda: self.snapshots.load(state, meta))
        self.tensors.load_state_dict(state)
        for name, obj in self.meta_states.items():
            obj.load_state_dict(meta[name])
        self.rng.load_state_dict(rng)
        self.loaded_from, self.last_saved_step = path.parent, meta["step"]
        dist.barrier(group=self.group)
        return meta["step"]

    def _read(self, path: Path, meta: dict, work: Callable[[], Any]) -> Any:
        """This rank's part of reading checkpoint `path` (every rank calls it for every part: a collective). A file that
        cannot be read on any rank (checkpoint.verify=size passes a flipped byte) ends every rank with the same
        CheckpointError naming it: no rank waits in a collective for a peer that has given up."""
        error, out = None, None  # (the line, when it names the file already; the cause otherwise)
        try:
            out = work()
        except CheckpointError as e:  # the file named (dcp_io.read_index)
            error = (str(e), None)
        except CheckpointException as e:  # DCP's: every rank holds every failing rank's cause
            if oom := next((exc for exc, _ in e.failures.values() if isinstance(exc, torch.OutOfMemoryError)), None):
                raise oom from None  # not the checkpoint's fault: exit code 6, on every rank alike
            error = (None, "; ".join(f"rank {r}: {read_cause(exc)}" for r, (exc, _) in sorted(e.failures.items())))
        except Exception as e:  # noqa: BLE001 - unpickling a damaged file raises many types
            if is_comm_failure(e) or isinstance(e, torch.OutOfMemoryError):  # exit codes 4 and 6, not a checkpoint's
                raise
            error = (None, f"rank {self.parallel.rank}: {read_cause(e)}")
        errors: list = [None] * self.parallel.world_size
        dist.all_gather_object(errors, error, group=self.group)
        failed = [e for e in errors if e]
        if not failed:
            return out
        if named := [line for line, _ in failed if line]:
            raise CheckpointError(named[0])
        raise self._unreadable(path, meta, "; ".join(dict.fromkeys(cause for _, cause in failed))[:400])

    def _unreadable(self, path: Path, meta: dict, cause: str) -> CheckpointError:
        """The error for a checkpoint that failed to load: the file whose CRC32 is not the recorded one (each rank
        checks a share of the files: a collective), else the cause as it is."""
        if meta.get("snapshot"):
            return CheckpointError(
                f"the snapshot of step {meta['step']} in {path.parent} cannot be loaded ({cause}); remove the folder "
                "and launch again to resume from the disk's latest checkpoint"
            )
        rank, world = self.parallel.rank, self.parallel.world_size
        bad = None
        for name in sorted(meta["files"])[rank::world]:
            try:
                if file_record(path / name)["crc32"] != meta["files"][name]["crc32"]:
                    bad = name
            except OSError:
                bad = name
            if bad:
                break
        found: list = [None] * world
        dist.all_gather_object(found, bad, group=self.group)
        bad = min((b for b in found if b), default=None)
        if bad is not None:
            return unreadable(path, bad, cause, fails_crc=True, verify_hint=self.cfg.checkpoint.verify != "crc")
        saved_by = meta.get("torch_version")
        return CheckpointError(
            f"checkpoint {str(path)!r} cannot be loaded ({cause}) although its files pass their "
            "CRC32 check"
            + (
                f"; it was saved by torch {saved_by}, this is torch {torch.__version__}"
                if saved_by != torch.__version__
                else ""
            )
        )


def _cause(e: BaseException) -> str:
    """An error's one-line cause, e.g. "[Errno 28] No space left on device: '.../__1_0.distcp'"."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"
