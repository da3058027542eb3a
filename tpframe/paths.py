"""Where tpframe writes, checked before anything is written; on the ground floor beside errors.py, so the run's
pre-flight, the token-file writer and the tools share it.

    check_creatable("--out 'm.safetensors'", Path("m.safetensors"))   # ConfigError unless a file can be made there
    refuse_existing("--out 'notes.txt'", "is not a token file made by prepare_data.py")   # the --force line
    tmp = temporary_name(Path("m.safetensors"))   # a new name beside it: write there, then os.replace(tmp, path)
    with replacing(Path("m.safetensors")) as tmp:  # the same, renamed over the file (or a link's target) on success
    path = link_target(path)                        # through a symbolic link: the rename replaces what it points to
    recorded_path("data/mine.bin", meta["cwd"])      # a run's relative path, from the folder the run was launched in
    why = not_a_file("data/x.bin")                    # "does not exist", "is a directory, not a file", ... or None
    write_failure("--out 'm.safetensors'", path, e)   # a write's OSError (full disk) as one line, with the free space
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

from tpframe.errors import ConfigError

_PROBE = ".tpframe-probe-"


def recorded_path(path: str, cwd: str | None) -> str:
    """A path a run recorded (its config's data.path, its token file's tokenizer): a relative one names a file in the
    folder the run was launched from, `cwd` (its checkpoints' meta.json has it), when it exists there; otherwise the
    path as given. So a checkpoint can be used from any folder."""
    if cwd and not os.path.isabs(path) and os.path.exists(os.path.join(cwd, path)):
        return os.path.join(cwd, path)
    return path


def not_a_file(path: str | Path) -> str | None:
    """Why `path` cannot be read as a file, in words that follow it ("does not exist", "is a directory, not a
    file", "is not a regular file"); None when it is one."""
    path = Path(path)
    if path.is_file():
        return None
    if path.is_dir():
        return "is a directory, not a file"
    return "is not a regular file" if path.exists() else "does not exist"


def nearest_existing(path: Path) -> Path:
    """`path` itself when it exists, else its nearest ancestor that does."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_space(path: str | Path) -> str:
    """'3.2 MiB free there': the free space of the filesystem that holds `path` (or would)."""
    try:
        free = shutil.disk_usage(nearest_existing(Path(path).absolute())).free
    except OSError:
        return "its free space unknown"
    for unit in ("B", "KiB", "MiB", "GiB"):  # noqa: B007 - the unit it stops at
        if free < 1024:
            break
        free /= 1024
    return f"{free:.1f} {unit} free there"


def write_failure(label: str, path: str | Path, error: OSError) -> str:
    """The one line for a write that failed (a full disk, a file-size limit, a read-only folder)."""
    why = error.strerror or str(error)
    return f"cannot write {label}: {str(path)!r} ({why}; {free_space(path)}); free space or write elsewhere"


def _probe(folder: Path, directory: bool) -> None:
    """Create and remove a file (and, with `directory`, a folder) in `folder`: what the writer will do there. os.access
    says yes where creating fails (root on /proc and /sys, a read-only mount); trying is the only answer."""
    name = folder / f"{_PROBE}{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.close(fd)
    os.unlink(name)
    if directory:
        os.mkdir(name)
        os.rmdir(name)


def check_creatable(label: str, path: Path, *, directory: bool = False) -> None:
    """`path` (a directory that exists, a file to write, or with `directory` a directory to make) can be written:
    a probe file (and folder, where folders must be made) is created and removed in the nearest existing folder, so
    nothing is left behind whether the check passes or fails. `label` names it in the error (`train.run_dir='x'`,
    `--out 'x'`)."""
    path = Path(path)
    target = path if path.is_dir() else path.parent
    folder = nearest_existing(target)
    # a symbolic link to nothing among the folders the writer makes (exists() is False through one): mkdir fails on
    # it with "File exists", and nothing can be made under it
    for part in (path, *path.parents) if directory else (target, *target.parents):
        if part == folder:
            break
        if part.is_symlink():
            where = f"{label} is" if part == path else f"{label} cannot be created: {str(part)!r} is"
            raise ConfigError(
                f"{where} a symbolic link to {os.readlink(part)!r}, which does not exist: create it or remove the link"
            )
    if not folder.is_dir():
        raise ConfigError(f"{label} cannot be created: {str(folder)!r} is a file")
    makes_folders = folder != target or (directory and not path.exists())
    try:
        _probe(folder, makes_folders)
    except OSError as e:
        raise ConfigError(
            f"{label} cannot be created: writing in {str(folder)!r} failed "
            f"({e.strerror or type(e).__name__}); pick a path on a writable file system"
        ) from None


def refuse_existing(label: str, what: str) -> None:
    """The one line for an output path that holds something this tool did not write."""
    raise ConfigError(f"{label} {what}; pass --force to overwrite it, or pick another path")


def temporary_name(path: Path, kind: str = "tmp") -> Path:
    """An unused name in `path`'s folder (so renaming it over `path` is atomic) that no user file has."""
    return path.with_name(f".{path.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}")


def link_target(path: Path) -> Path:
    """Where a symbolic link `path` points (else `path`): a new file renamed over the link itself would replace the
    link and leave the old content where it points, which writing through the link never did."""
    return path.resolve() if path.is_symlink() else path


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary name beside `path` for the block to write; renamed over `path` (over what a symbolic link points
    to) when the block ends without error, removed otherwise: never a half-written file in `path`'s place."""
    target = link_target(path)
    tmp = temporary_name(target)
    try:
        yield tmp
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
