"""One training per run directory (tpframe/training/run_lock.py): the lock, its probe, and its release."""

import os

import pytest

from tpframe.errors import ConfigError
from tpframe.training.run_lock import LOCK_NAME, RunDirLock, check_free


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
