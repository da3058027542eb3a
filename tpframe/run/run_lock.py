"""One training per run directory: global rank 0 holds an exclusive lock on `RUN_DIR/.lock` while it trains
(and on `checkpoint.dir/.lock` when the checkpoints live elsewhere: `locks_of`).

Two launches on one `train.run_dir` (a job submitted twice, a scheduler's retry while the first still runs)
would both append metrics, save checkpoints into one folder and prune each other's. The second is refused
instead: one line naming the holder (pid, host, start time), exit 2, before it writes anything.

    lock = RunDirLock(cfg.train.run_dir)
    lock.acquire()        # ConfigError when another process holds it
    ...train...
    lock.release()        # or the process ends: the kernel drops a flock with its last descriptor

`check_free` is the pre-flight's probe (`tpframe.launch`'s parent, and rank 0): it takes and drops the lock on
an existing lock file and creates nothing. The file itself stays after a run: removing a lock file races with
a process that has just opened it, and its stale text is read only while someone holds it.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

from tpframe.errors import ConfigError

LOCK_NAME = ".lock"


def _refusal(key: str, run_dir: Path, holder: str) -> ConfigError:
    return ConfigError(
        f"{key}={str(run_dir)!r} is in use by another training ({holder or 'holder unknown'}); "
        f"wait for it to end, stop it, or pick another {key}"
    )


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _holder(fd: int) -> str:
    try:
        return os.pread(fd, 512, 0).decode("utf-8", "replace").strip()
    except OSError:
        return ""


def check_free(run_dir: str | Path, key: str = "train.run_dir") -> None:
    """Raise the refusal when another process holds `run_dir`'s lock (`key` names it); write nothing."""
    path = Path(run_dir) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # no lock file (a new run dir), or one we cannot open: acquire() decides
        return
    try:
        if not _try_lock(fd):
            raise _refusal(key, Path(run_dir), _holder(fd))
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


class RunDirLock:
    def __init__(self, run_dir: str | Path, key: str = "train.run_dir"):
        self.run_dir, self.key = Path(run_dir), key
        self.fd: int | None = None

    def acquire(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        if not _try_lock(fd):
            holder = _holder(fd)
            os.close(fd)
            raise _refusal(self.key, self.run_dir, holder)
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {since}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def run_folders(cfg) -> list[tuple[str, str]]:
    """(key, path) of the folders a run writes into: its run dir, and its checkpoint dir when that is set elsewhere."""
    folders = [("train.run_dir", cfg.train.run_dir)]
    if cfg.checkpoint.dir and Path(cfg.checkpoint.dir).resolve() != Path(cfg.train.run_dir).resolve():
        folders.append(("checkpoint.dir", cfg.checkpoint.dir))
    return folders


def locks_of(cfg) -> list[RunDirLock]:
    """The locks of a run's folders (`run_folders`), which it must not share with a running one."""
    return [RunDirLock(path, key) for key, path in run_folders(cfg)]
