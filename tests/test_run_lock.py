"""One training per run directory (tpframe/run/run_lock.py): the lock, its probe, and its release."""

import os

import pytest

from tpframe.errors import ConfigError
from tpframe.run.run_lock import LOCK_NAME, RunDirLock, check_free


def test_a_held_run_dir_refuses_a_second_holder_and_the_probe_until_released(tmp_path):
    run_dir = tmp_path / "a" / "run"
    check_free(run_dir)  # a new run dir: nothing held, nothing created
    assert not (tmp_path / "a").exists()
    first = RunDirLock(run_dir)
    first.acquire()
    assert (run_dir / LOCK_NAME).read_text().startswith(f"pid {os.getpid()} on ")
    # flock conflicts between open files, so a second holder in this very process is refused like another process
    with pytest.raises(ConfigError, match=f"is in use by another training \\(pid {os.getpid()} on .*pick another"):
        RunDirLock(run_dir).acquire()
    with pytest.raises(ConfigError, match="is in use by another training"):
        check_free(run_dir)
    first.release()
    first.release()  # idempotent: main() releases whether or not it acquired
    check_free(run_dir)
    second = RunDirLock(run_dir)
    second.acquire()  # the file stays between runs; a free lock is taken again
    second.release()


def test_a_checkpoint_dir_shared_by_two_run_dirs_is_locked_too(tmp_path):
    from types import SimpleNamespace

    from tpframe.run.run_lock import locks_of

    def cfg(run_dir, ckpt=None):
        return SimpleNamespace(train=SimpleNamespace(run_dir=str(run_dir)), checkpoint=SimpleNamespace(dir=ckpt))

    assert [lock.key for lock in locks_of(cfg(tmp_path / "a"))] == ["train.run_dir"]
    assert [lock.key for lock in locks_of(cfg(tmp_path / "a", str(tmp_path / "a")))] == ["train.run_dir"]
    first = locks_of(cfg(tmp_path / "a", str(tmp_path / "ckpt")))
    for lock in first:
        lock.acquire()
    second = locks_of(cfg(tmp_path / "b", str(tmp_path / "ckpt")))
    second[0].acquire()  # its own run dir is free
    with pytest.raises(
        ConfigError,
        match=r"^checkpoint.dir='.*ckpt' is in use by another training .* pick another "
        r"checkpoint.dir$",
    ):
        second[1].acquire()
    for lock in first + second:
        lock.release()
