"""Finding, checking and publishing checkpoint directories: filesystem only, no process group.

    <root>/step_00000100/            published only when complete
        __0_0.distcp ...             DCP shards: every rank writes only its own pieces
        .metadata                    DCP's index of every global tensor and its chunks
        rng_<rank>.pt                per-rank RNG states (CPU, CUDA, tracker streams)
        meta.json                    step, data position, layout, architecture, config, file sizes + CRC32
    <root>/latest                    the name of the newest published checkpoint

Checks run in `preflight`, before any process group exists: a missing, half-written or corrupt
checkpoint, or one of another architecture, is one clear CheckpointError.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import zlib
from pathlib import Path
from typing import Any

from tpframe.errors import ConfigError, yaml_shown
from tpframe.models.config import architecture_diffs, padded_vocab

FORMAT = 2  # 2: the untied head is `head.weight`, the architecture is recorded in meta.json
META = "meta.json"
LATEST = "latest"
_STEP_NAME = re.compile(r"step_[0-9]+")  # what a save names its folder (step_00000100)
META_KEYS = ("step", "train", "data", "architecture", "layout", "vocab", "config", "files")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_dict(v) -> bool:
    return isinstance(v, dict)


# The shape of what resuming, exporting and generating read from meta.json (beyond META_KEYS being there).
_META_SHAPE = {
    "step": _is_int,
    "train": lambda v: _is_dict(v) and _is_int(v.get("step")),
    "data": _is_dict,
    "architecture": _is_dict,
    "layout": lambda v: _is_dict(v) and all(map(_is_int, v.values())),
    "vocab": lambda v: (
        _is_dict(v) and _is_int(v.get("size")) and _is_int(v.get("padded")) and isinstance(v.get("tensors"), list)
    ),
    "config": lambda v: _is_dict(v) and all(_is_dict(v.get(k)) for k in ("model", "data", "train")),
}


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used, explained: what is wrong and what to do."""


class SaveFailed(Exception):
    """A checkpoint could not be written (a full disk, a folder made read-only): raised on every rank alike, with
    one line naming the rank, the cause and the checkpoint still intact; the run stops (tpframe/exits.py)."""


def checkpoint_root(cfg) -> Path:
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
        steps = sorted(p.name for p in path.glob("step_*") if (p / META).is_file())
        hint = (
            f"; pass one of its step directories, e.g. {str(path / steps[-1])!r}"
            if steps
            else f"; pass its checkpoints folder, {str(path / 'checkpoints')!r}"
            if (path / "checkpoints").is_dir()
            else ""
        )
        raise CheckpointError(
            f"{str(path)!r} is neither a checkpoint (no {META}) nor a checkpoint root (no '{LATEST}'){hint}"
        )
    try:
        name = marker.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{marker} cannot be read ({e}); point checkpoint.load at a step_* directory") from None
    if not name:
        raise CheckpointError(f"{marker} is empty; point checkpoint.load at a step_* directory")
    target = path / name
    if not (target / META).exists():
        raise CheckpointError(
            f"{marker} names {target.name!r}, which is missing or incomplete; point checkpoint.load at an older "
            "step_* directory"
        )
    return target


_JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


# set by tpframe.launch once its pre-flight has CRC-checked this step directory: its workers check sizes only
VERIFIED_ENV = "TPFRAME_VERIFIED_CHECKPOINT"


def _first_corrupt(path: Path, files: dict[str, dict]) -> str | None:
    """The first of `files` (meta.json's order) whose CRC32 differs from its record; the files are read in threads
    (zlib and file reads release the GIL), so the check runs at the disk's pace rather than one core's."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        crcs = pool.map(_crc32, [path / name for name in files])
        return next((name for name, crc in zip(files, crcs) if crc != files[name]["crc32"]), None)


def verify(path: Path, mode: str = "crc") -> dict[str, Any]:
    """Read meta.json and check every recorded file (size, and CRC32 with mode="crc" unless `path` is the step
    directory VERIFIED_ENV names: tpframe.launch's pre-flight read it once for all its workers)."""
    meta_file = path / META
    if not meta_file.exists():
        raise CheckpointError(
            f"checkpoint {str(path)!r} is incomplete (no {META}): the save that wrote it never finished; "
            "it will not be loaded. Use an older step_* directory."
        )
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{meta_file} is corrupt ({e}); use an older step_* directory") from None
    if not isinstance(meta, dict):
        raise CheckpointError(
            f"{meta_file} holds a JSON {_JSON_TYPES.get(type(meta), type(meta).__name__)}, not an "
            "object: it is not a tpframe checkpoint's meta.json; use an older step_* directory"
        )
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"{str(path)!r} has checkpoint format {meta.get('format')!r}; this tpframe reads format {FORMAT}"
        )
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise CheckpointError(
            f"{meta_file} lacks {', '.join(missing)}: it was not written by a complete save; "
            "use an older step_* directory"
        )
    if not isinstance(meta["files"], dict) or not all(
        isinstance(v, dict) and {"size", "crc32"} <= set(v) for v in meta["files"].values()
    ):
        raise CheckpointError(f"{meta_file} has a malformed 'files' record; use an older step_* directory")
    malformed = [key for key, ok in _META_SHAPE.items() if not ok(meta[key])]
    if malformed:
        raise CheckpointError(
            f"{meta_file} is malformed (wrong type or missing fields in: {', '.join(malformed)}); "
            "use an older step_* directory"
        )
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
    verified = os.environ.get(VERIFIED_ENV) == str(path.resolve())
    bad = _first_corrupt(path, meta["files"]) if mode == "crc" and not verified else None
    if bad is not None:
        raise CheckpointError(
            f"checkpoint file {path / bad} fails its CRC32 check (corrupt); use an older step_* directory"
        )
    return meta


def read_cause(e: BaseException) -> str:
    """Why reading a file failed, in one short line (torch.load's advice about weights_only buries the cause)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    for i, line in enumerate(lines):
        if "WeightsUnpickler error:" in line:
            text = line.split("WeightsUnpickler error:", 1)[1].strip() or (lines[i + 1] if i + 1 < len(lines) else "")
            break
    return f"{type(e).__name__}: {text[:300]}"  # room for a path


def unreadable(
    step: Path, name: str, cause: str, *, fails_crc: bool = False, verify_hint: bool = True
) -> CheckpointError:
    """The line for a file of checkpoint `step` that cannot be read although it has its recorded size: it is
    corrupt. Names an older checkpoint beside it to resume from, when there is one."""
    older = [p for p in published_steps(step.parent) if p.name < step.name]
    fix = (
        f"resume from an older step_* folder (checkpoint.load={older[-1]})"
        if older
        else "no older checkpoint is beside it to resume from instead"
    )
    return CheckpointError(
        f"checkpoint file {step / name} cannot be read ({cause}): it is corrupt"
        + (" (it fails its CRC32 check)" if fails_crc else "")
        + f"; {fix}"
        + ("; checkpoint.verify=crc (the default) finds a corrupt file before the run starts" if verify_hint else "")
    )


def restores_rng(saved_layout: dict[str, Any], layout: dict[str, Any]) -> bool:
    """Whether a checkpoint's RNG files (rng_<rank>.pt) are restored: on the same layout only. The RNG streams follow
    tp, cp, dp and pp ranks, not ep; checkpoints from before CP (and EP) name neither."""
    same = lambda lay: {k: v for k, v in {"cp": 1, **lay}.items() if k != "ep"}  # noqa: E731
    return same(saved_layout) == same(layout)


def check_compatible(cfg, meta: dict[str, Any]) -> None:
    """Refuse, before loading anything, a checkpoint that cannot become this run's model."""
    diffs = [
        f"model.{k}: checkpoint {yaml_shown(theirs)}, config {yaml_shown(mine)}"
        for k, mine, theirs in architecture_diffs(
            cfg.model, meta["architecture"], meta.get("config", {}).get("model", {})
        )
    ]
    if diffs:
        raise CheckpointError("checkpoint and config describe different models: " + "; ".join(diffs))
    padded = padded_vocab(cfg.model, cfg.parallel.tp)
    if padded != meta["vocab"]["padded"]:
        raise CheckpointError(
            f"the vocabulary was padded to {meta['vocab']['padded']} rows when saved but pads to {padded} at "
            f"parallel.tp={cfg.parallel.tp} with model.vocab_multiple={cfg.model.vocab_multiple}; set "
            f"model.vocab_multiple={meta['config']['model']['vocab_multiple']} (a multiple of both tp sizes)"
        )


SNAPSHOTS = Path("/dev/shm/tpframe")  # host memory (Linux's tmpfs): checkpoint.snapshot_interval's copies
SNAPSHOT_LATEST = "latest.json"
JOB_ENV = "TORCHELASTIC_RUN_ID"  # one launch: a snapshot serves only the restarts of the launch that wrote it
CHECKPOINTS_KEY = "tpframe/checkpoints"  # the job store's "<step resumed from, or -1> <folder>", for the launcher


def snapshot_root(root: Path) -> Path:
    """Where the host-memory snapshots of checkpoint folder `root` go: a folder of /dev/shm named by its path."""
    return SNAPSHOTS / hashlib.sha1(str(Path(root).resolve()).encode()).hexdigest()[:16]


def latest_step(root: Path) -> int | None:
    """The step `root`'s `latest` names, or None (none, or unreadable: `resolve` says why when it matters)."""
    try:
        return int((Path(root) / LATEST).read_text().strip().rsplit("_", 1)[1])
    except (OSError, ValueError, IndexError):
        return None


def newer_snapshot(root: Path, job: str | None, world: int) -> tuple[Path, dict] | None:
    """(the file, its meta) of the snapshot of `root` that launch `job` wrote at world size `world`, when it is newer
    than `root`'s `latest`; else None. A snapshot holds each rank's own pieces: it serves only the world it was taken
    at."""
    path = snapshot_root(root) / SNAPSHOT_LATEST
    try:
        meta = json.loads(path.read_text()) if job is not None and path.is_file() else None
    except (OSError, ValueError):
        return None
    ok = isinstance(meta, dict) and meta.get("job") == job and meta.get("layout", {}).get("world") == world
    disk = latest_step(root)
    return (path, meta) if ok and meta["step"] > (-1 if disk is None else disk) else None


def preflight(cfg, *, restarted: bool = False) -> tuple[Path | None, dict | None]:
    """The checkpoint this run will resume from (explicit load, else `latest`), checked; or (None, None).
    `restarted` (a launcher started this run's workers again after a failure): the newer of the run's own `latest`
    and this launch's snapshot in host memory, first."""
    root = checkpoint_root(cfg)
    # a restart's own `latest` first: one naming a missing or incomplete checkpoint is refused, snapshot or not
    path = resolve(root) if restarted and (root / LATEST).exists() else None
    if restarted and cfg.checkpoint.snapshot_interval:
        snapshot = newer_snapshot(root, os.environ.get(JOB_ENV), int(os.environ.get("WORLD_SIZE", "1")))
        if snapshot is not None:
            check_compatible(cfg, snapshot[1])
            return snapshot
    if path is None and cfg.checkpoint.load:
        path = resolve(cfg.checkpoint.load)
    elif path is None:
        if not (cfg.checkpoint.auto_resume and (root / LATEST).exists()):
            return None, None  # checkpoint.init_from, if any, is checked by tpframe/checkpoint/init_from.py
        path = resolve(root)
    meta = verify(path, cfg.checkpoint.verify)
    check_compatible(cfg, meta)
    return path, meta


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def file_record(path: Path) -> dict[str, int]:
    return {"size": path.stat().st_size, "crc32": _crc32(path)}


def is_checkpoint(step_dir: Path) -> bool:
    """A published checkpoint: a step_* folder holding a meta.json (written before the folder gets its name)."""
    return step_dir.is_dir() and not step_dir.name.endswith(".partial") and (step_dir / META).is_file()


def published_steps(root: Path) -> list[Path]:
    """The checkpoints in `root`, oldest first; a step_* folder without meta.json is not one (and never pruned)."""
    return sorted(p for p in root.glob("step_*") if is_checkpoint(p))


def foreign_steps(root: Path) -> list[Path]:
    """What holds a name a save uses (step_<digits>) in `root` and is not a checkpoint: a save of that step would
    replace it."""
    return sorted(p for p in root.glob("step_*") if _STEP_NAME.fullmatch(p.name) and not is_checkpoint(p))


def is_healthy(step_dir: Path) -> bool:
    """What meta.json says (`healthy`: no skipped step or loss spike since the previous save); older
    checkpoints, written before health was recorded, count as healthy."""
    try:
        return bool(json.loads((step_dir / META).read_text()).get("healthy", True))
    except (OSError, ValueError, AttributeError):
        return False


def last_healthy(root: Path) -> Path | None:
    healthy = [p for p in published_steps(root) if is_healthy(p)]
    return healthy[-1] if healthy else None


def prune(root: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` checkpoints, and the newest healthy one even when it is older."""
    steps = published_steps(root)
    keep = set(steps[-keep_last:]) | {last_healthy(root)}
    for old in steps:
        if old not in keep:
            shutil.rmtree(old, ignore_errors=True)


def remove_stale_partials(root: Path) -> None:
    for stale in root.glob("step_*.partial"):
        shutil.rmtree(stale, ignore_errors=True)
