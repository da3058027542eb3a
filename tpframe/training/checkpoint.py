"""Sharded checkpoints with torch.distributed.checkpoint (DCP): atomic, resumable on any layout.

A checkpoint is one directory per step:

    <root>/step_00000100/            published only when complete
        __0_0.distcp ...             DCP shards: every rank writes only its own pieces
        .metadata                    DCP's index of every global tensor and its chunks
        rng_<rank>.pt                per-rank RNG states (CPU, CUDA, tracker streams)
        meta.json                    step, data position, layout, config, version, file sizes + CRC32
    <root>/latest                    the name of the newest published checkpoint

Every parameter and optimizer state is stored as its *global* logical tensor (fused q/k/v and
gate/up split apart, see tpframe.parallel.sharding), written through DTensor views of the local
shards, so DCP reshards on load to any TP or DP layout. Writing goes to `step_N.partial`; the
directory is renamed and `latest` rewritten only after every rank has finished and meta.json is
on disk, so a crash mid-save leaves the previous checkpoint as `latest`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from tpframe.errors import ConfigError
from tpframe.models.config import architecture, padded_vocab
from tpframe.parallel.rng import rng_state, set_rng_state
from tpframe.parallel.sharding import LogicalShard, param_shards
from tpframe.training.config import Config
from tpframe.version import __version__

FORMAT = 2  # 2: the untied head is `head.weight`, the architecture is recorded in meta.json
META = "meta.json"
LATEST = "latest"
FAULT_ENV = "TPFRAME_FAULT_KILL_DURING_SAVE"  # test hook: SIGKILL this rank mid-save at the given step


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used, explained: what is wrong and what to do."""


# -- finding and checking checkpoints (filesystem only: runs before any process group) ----------


def checkpoint_root(cfg: Config) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.train.run_dir) / "checkpoints"


def resolve(path: str | Path) -> Path:
    """A step directory, or a root holding `latest` -> the step directory it names."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    if (path / META).exists() or (path / ".metadata").exists() or path.name.endswith(".partial"):
        return path
    marker = path / LATEST
    if not marker.exists():
        raise CheckpointError(f"{str(path)!r} is neither a checkpoint (no {META}) nor a checkpoint root (no '{LATEST}')")
    target = path / marker.read_text().strip()
    if not (target / META).exists():
        raise CheckpointError(f"{marker} names {target.name!r}, which is missing or incomplete; point checkpoint.load at an older step_* directory")
    return target


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def verify(path: Path, mode: str = "crc") -> dict[str, Any]:
    """Read meta.json and check every recorded file (size, and CRC32 with mode="crc")."""
    meta_file = path / META
    if not meta_file.exists():
        raise CheckpointError(
            f"checkpoint {str(path)!r} is incomplete (no {META}): the save that wrote it never finished; "
            "it will not be loaded. Use an older step_* directory."
        )
    try:
        meta = json.loads(meta_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{meta_file} is corrupt ({e}); use an older step_* directory") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{str(path)!r} has checkpoint format {meta.get('format')!r}; this tpframe reads format {FORMAT}")
    for name, info in meta["files"].items():
        f = path / name
        if not f.exists():
            raise CheckpointError(f"checkpoint {str(path)!r} is missing its file {name}; it cannot be loaded")
        size = f.stat().st_size
        if size != info["size"]:
            raise CheckpointError(
                f"checkpoint file {f} is {size} bytes, expected {info['size']} (truncated or overwritten); "
                "this checkpoint cannot be loaded, use an older step_* directory"
            )
        if mode == "crc" and _crc32(f) != info["crc32"]:
            raise CheckpointError(f"checkpoint file {f} fails its CRC32 check (corrupt); use an older step_* directory")
    return meta


def check_compatible(cfg: Config, meta: dict[str, Any]) -> None:
    """Refuse, before loading anything, a checkpoint that cannot become this run's model."""
    mine, theirs = architecture(cfg.model), meta["architecture"]
    diffs = [f"model.{k}: checkpoint {theirs.get(k)!r}, config {mine.get(k)!r}" for k in sorted(set(mine) | set(theirs))
             if mine.get(k) != theirs.get(k)]
    if diffs:
        raise CheckpointError("checkpoint and config describe different models: " + "; ".join(diffs))
    padded = padded_vocab(cfg.model, cfg.parallel.tp)
    if padded != meta["vocab"]["padded"]:
        raise CheckpointError(
            f"the vocabulary was padded to {meta['vocab']['padded']} rows when saved but pads to {padded} at "
            f"parallel.tp={cfg.parallel.tp} with model.vocab_multiple={cfg.model.vocab_multiple}; set "
            f"model.vocab_multiple={meta['config']['model']['vocab_multiple']} (a multiple of both tp sizes)"
        )


def preflight(cfg: Config) -> tuple[Path | None, dict | None]:
    """The checkpoint this run will resume from (explicit load, else `latest`), checked; or (None, None)."""
    if cfg.checkpoint.load:
        path = resolve(cfg.checkpoint.load)
    else:
        root = checkpoint_root(cfg)
        if not (cfg.checkpoint.auto_resume and (root / LATEST).exists()):
            if cfg.checkpoint.init_from and not Path(cfg.checkpoint.init_from).is_file():
                raise CheckpointError(f"checkpoint.init_from={cfg.checkpoint.init_from!r} does not exist")
            return None, None
        path = resolve(root)
    meta = verify(path, cfg.checkpoint.verify)
    check_compatible(cfg, meta)
    return path, meta


# -- the state a checkpoint holds ---------------------------------------------------------------


def _global_view(piece: torch.Tensor, shard: LogicalShard, mesh: DeviceMesh):
    if shard.tp_dim is None:
        return DTensor.from_local(piece, mesh, [Replicate()], run_check=False)
    shape = torch.Size(shard.global_shape)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(piece, mesh, [Shard(shard.tp_dim)], run_check=False, shape=shape, stride=stride)


def ensure_optimizer_state(trainer) -> None:
    """Create AdamW's state (zeros) so a load has somewhere to write, exactly as torch would."""
    opt = trainer.optimizer.optimizer
    fused = bool(opt.defaults.get("fused"))
    for master in trainer.optimizer.masters:
        state = opt.state[master]
        if not state:
            device = master.device if fused else "cpu"
            state["step"] = torch.zeros((), dtype=torch.float32, device=device)
            state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)


def training_state(trainer, mesh: DeviceMesh) -> dict[str, Any]:
    """Flat {key: DTensor} of every logical tensor piece of the model and optimizer on this rank."""
    ensure_optimizer_state(trainer)
    tp_rank, tp = trainer.state.tp_rank, trainer.state.tp
    opt_state = trainer.optimizer.optimizer.state
    out: dict[str, Any] = {}
    for name, param, master in trainer.optimizer.named_masters():
        moments = opt_state[master]
        for shard in param_shards(name, param, tp_rank, tp, trim_vocab=False):
            out[f"model/{shard.name}"] = _global_view(shard.view(param.detach()), shard, mesh)
            if master is not param:
                out[f"optim/{shard.name}/master"] = _global_view(shard.view(master.detach()), shard, mesh)
            out[f"optim/{shard.name}/exp_avg"] = _global_view(shard.view(moments["exp_avg"]), shard, mesh)
            out[f"optim/{shard.name}/exp_avg_sq"] = _global_view(shard.view(moments["exp_avg_sq"]), shard, mesh)
    first = opt_state[trainer.optimizer.masters[0]]["step"]
    out["optim/step"] = first.detach().reshape(1).cpu() if first.device.type != "cpu" else first.reshape(1)
    return out


def stage_to_cpu(state: dict[str, Any], cpu_mesh: DeviceMesh) -> dict[str, Any]:
    """A CPU copy of a checkpoint state (DTensors stay DTensors, on a CPU mesh of the same group)."""
    out = {}
    for key, value in state.items():
        if isinstance(value, DTensor):
            local = value.to_local().detach().to("cpu", copy=True)
            out[key] = DTensor.from_local(local, cpu_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride())
        else:
            out[key] = value.detach().to("cpu", copy=True)
    return out


# -- the checkpointer ---------------------------------------------------------------------------


class Checkpointer:
    """Saves on an interval, at the end and on SIGTERM/SIGUSR1; resumes from `latest` or checkpoint.load."""

    def __init__(self, cfg: Config, state, resume: tuple[Path | None, dict | None] = (None, None)):
        self.cfg, self.state = cfg, state
        self.root = checkpoint_root(cfg)
        self.resume_path, self.resume_meta = resume
        self.loaded_from: Path | None = None
        # Checkpoint bookkeeping runs over gloo groups of its own: object collectives need no GPU,
        # and the background writer of an async save must not share a group with the main thread.
        self.group = dist.new_group(backend="gloo")
        self.async_group = dist.new_group(backend="gloo") if cfg.checkpoint.async_save else None
        self.mesh = DeviceMesh.from_group(state.tp_group, state.device.type)
        self.cpu_mesh = DeviceMesh.from_group(state.tp_group, "cpu") if state.device.type != "cpu" else self.mesh
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tpframe-ckpt") if cfg.checkpoint.async_save else None
        self.pending: tuple[Any, int, Path, dict] | None = None  # (future, step, partial dir, meta) of an async save
        self.signal_received: int | None = None
        self.last_saved_step = -1

    # -- start-up --------------------------------------------------------------------------------
    def attach(self, trainer) -> None:
        """Install signal handlers; resume (or import weights) before the first step."""
        trainer.checkpointer = self
        if self.cfg.checkpoint.save_on_signal:
            for sig in (signal.SIGTERM, signal.SIGUSR1):
                signal.signal(sig, self._on_signal)
        if self.resume_path is not None:
            self.load(trainer, self.resume_path, self.resume_meta)
        elif self.cfg.checkpoint.init_from:
            from tpframe.training.export import load_consolidated

            load_consolidated(trainer.model, self.cfg.checkpoint.init_from, trainer.state.tp_rank, trainer.state.tp)
            trainer.optimizer.refresh_masters()
        if self.state.rank == 0:
            self._remove_stale_partials()

    def _on_signal(self, signum, frame) -> None:
        self.signal_received = signum

    # -- the hooks the trainer calls -------------------------------------------------------------
    def after_step(self, trainer) -> None:
        # One tiny all-reduce: did any rank get a preemption signal; has every rank finished its async write?
        pending_busy = self.pending is not None and not self.pending[0].done()
        flags = torch.tensor([float(self.signal_received is not None), float(pending_busy)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        if self.pending is not None and flags[1] == 0:
            self._finish_async()
        if flags[0] > 0:
            trainer.logger.info(f"preemption signal received: saving step {trainer.step} and stopping")
            self.save(trainer, blocking=True)
            trainer.stop_requested = True
            return
        interval = self.cfg.checkpoint.interval
        if interval and trainer.step % interval == 0 and trainer.step < self.cfg.train.steps:
            self.save(trainer, blocking=not self.cfg.checkpoint.async_save)

    def finish(self, trainer) -> None:
        """End of training: write the final checkpoint and wait for any background write."""
        if self.cfg.checkpoint.save_at_end and trainer.step != self.last_saved_step and not trainer.stop_requested:
            self.save(trainer, blocking=True)
        if self.pending is not None:
            self._finish_async()

    # -- saving ----------------------------------------------------------------------------------
    def save(self, trainer, blocking: bool = True) -> Path:
        if self.pending is not None:  # one write in flight at a time
            self._finish_async()
        step = trainer.step
        final = self.root / f"step_{step:08d}"
        partial = self.root / f"step_{step:08d}.partial"
        if self.state.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in (partial, final):
                if stale.exists():
                    shutil.rmtree(stale)
            partial.mkdir()
        dist.barrier(group=self.group)
        torch.save(rng_state(trainer.state.device, trainer.state.rng_tracker), partial / f"rng_{self.state.rank}.pt")
        meta = self._meta(trainer)
        state = training_state(trainer, self.mesh)
        if blocking:
            dcp.save(state, checkpoint_id=str(partial), process_group=self.group)
            self._fault_injection(step)
            self._publish(partial, final, meta)
        else:
            # Copy to CPU now (training may change the weights next step), write in the background.
            staged = stage_to_cpu(state, self.cpu_mesh)
            future = self.writer.submit(dcp.save, staged, checkpoint_id=str(partial), process_group=self.async_group)
            self.pending = (future, step, partial, meta)
        self.last_saved_step = step
        return final

    def _finish_async(self) -> None:
        future, step, partial, meta = self.pending
        self.pending = None
        future.result()  # re-raises a failed background write
        self._fault_injection(step)
        self._publish(partial, self.root / f"step_{step:08d}", meta)

    def _fault_injection(self, step: int) -> None:
        if os.environ.get(FAULT_ENV) == str(step) and self.state.rank == int(os.environ.get("TPFRAME_FAULT_RANK", "0")):
            os.kill(os.getpid(), signal.SIGKILL)  # a real kill: the shards are written, nothing is published

    def _meta(self, trainer) -> dict[str, Any]:
        cfg = self.cfg
        config = cfg.to_dict()
        return {
            "format": FORMAT,
            "tpframe_version": __version__,
            "torch_version": torch.__version__,
            "step": trainer.step,
            "tokens_seen": trainer.tokens_seen,
            "skipped_steps": trainer.skipped_steps,
            "data": trainer.train_data.state_dict(),
            "architecture": architecture(cfg.model),
            "layout": {"world": self.state.world_size, "tp": self.state.tp, "dp": self.state.dp, "pp": self.state.pp},
            "vocab": {
                "size": cfg.model.vocab_size,
                "padded": padded_vocab(cfg.model, cfg.parallel.tp),
                "tensors": [n for n, p in trainer.model.named_parameters() if getattr(p, "vocab_rows", None)],
            },
            "config": config,
        }

    def _publish(self, partial: Path, final: Path, meta: dict[str, Any]) -> None:
        """Every rank is done: record sizes and CRCs, write meta.json, rename, point `latest` at it."""
        mine = {}
        for f in sorted(partial.iterdir()):
            if f.name.startswith(f"__{self.state.rank}_") or f.name == f"rng_{self.state.rank}.pt" or (self.state.rank == 0 and f.name == ".metadata"):
                mine[f.name] = {"size": f.stat().st_size, "crc32": _crc32(f)}
        gathered: list[dict] = [None] * self.state.world_size  # type: ignore[list-item]
        dist.all_gather_object(gathered, mine, group=self.group)
        if self.state.rank == 0:
            meta = dict(meta, files={k: v for d in gathered for k, v in d.items()}, saved_at=time.time())
            _write_atomic(partial / META, json.dumps(meta, indent=1))
            os.rename(partial, final)
            _write_atomic(self.root / LATEST, final.name)
            self._prune()
        dist.barrier(group=self.group)

    def _prune(self) -> None:
        steps = sorted(p for p in self.root.glob("step_*") if p.is_dir() and not p.name.endswith(".partial"))
        for old in steps[: -self.cfg.checkpoint.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    def _remove_stale_partials(self) -> None:
        for stale in self.root.glob("step_*.partial"):
            shutil.rmtree(stale, ignore_errors=True)

    # -- loading ---------------------------------------------------------------------------------
    def load(self, trainer, path: Path, meta: dict[str, Any]) -> None:
        state = training_state(trainer, self.mesh)
        dcp.load(state, checkpoint_id=str(path), process_group=self.group)
        step = state["optim/step"].item()
        for master in trainer.optimizer.masters:
            trainer.optimizer.optimizer.state[master]["step"].fill_(step)
        trainer.step, trainer.tokens_seen = meta["step"], meta["tokens_seen"]
        trainer.skipped_steps = meta.get("skipped_steps", 0)
        trainer.train_data.load_state_dict(meta["data"])
        same_layout = meta["layout"] == {"world": self.state.world_size, "tp": self.state.tp, "dp": self.state.dp, "pp": self.state.pp}
        if same_layout:
            set_rng_state(torch.load(path / f"rng_{self.state.rank}.pt", weights_only=False), self.state.device, self.state.rng_tracker)
        else:
            trainer.logger.info(
                f"resharding checkpoint from layout {meta['layout']} to tp={self.state.tp} dp={self.state.dp}: "
                "model and optimizer restored; dropout RNG streams continue from this run's seed"
            )
        self.loaded_from = path
        self.last_saved_step = trainer.step
        dist.barrier(group=self.group)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
