"""How a tpframe process ends when something goes wrong: one line on stderr, and an exit code a
scheduler can act on.

    0  trained to the end, or stopped by SIGTERM/SIGUSR1 or train.time_limit_minutes after saving a checkpoint
    2  a mistake in the config, the data, the run directory (or one another training uses now) or a checkpoint
       (nothing was written), or a model whose TP replicas get different gradients (found in step 1, before
       any update: training/replicas.py)
    3  training stopped on non-finite steps (train.on_nonfinite, train.max_skipped_steps), or on copies of a
       weight that are no longer identical across ranks (train.compare_replicas_every)
    4  a rank stopped responding or a collective failed (comm.timeout_s)
    5  a checkpoint (or another file the run must write, its config) could not be written: a full disk, a
       read-only folder; the previous checkpoint stays `latest`
    6  a rank ran out of device memory mid-run (the layout passed the pre-flight's estimate but does not fit)

Under torchrun (or tpframe.launch) every rank finds the same config mistake on its own, before any
process group exists. Rank 0 prints it; the other ranks wait until the launcher stops them (it does
as soon as rank 0 exits), so the line is printed before anyone's exit tears the job down. A rank that
is not stopped within RANK_ERROR_GRACE_S found a mistake rank 0 did not, and prints its own line.
Each failing rank also writes the line to torchelastic's error file, so torchrun's failure summary
shows it instead of a link.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import time

EXIT_CONFIG, EXIT_DIVERGED, EXIT_COMM, EXIT_SAVE, EXIT_OOM, EXIT_INTERRUPTED = 2, 3, 4, 5, 6, 130
# OSErrors that end a run with EXIT_SAVE (a tool with EXIT_CONFIG): full, over quota or a file-size limit, read-only
DISK_FULL_OR_READ_ONLY = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}
RANK_ERROR_GRACE_S = 20.0


def _write_error_file(line: str) -> None:
    """torchelastic's per-worker error file (set by torchrun and tpframe.launch), in its JSON format."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump(
                {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}},
                f,
            )
    except OSError:
        pass


def report(line: str, *, show: bool) -> None:
    """Print `line` (when `show`) as tpframe's one line, and leave it for the launcher."""
    line = f"tpframe: {line}"
    if show:
        sys.stdout.flush()
        print(line, file=sys.stderr, flush=True)
    _write_error_file(line)


def _stopped_by_launcher(timeout: float) -> bool:
    """Wait up to `timeout` s for the SIGTERM a launcher sends the other workers when one fails."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not hasattr(signal, "sigtimedwait"):
        return False
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    return signal.sigtimedwait({signal.SIGTERM}, timeout) is not None


def config_error(message: str, rank: int) -> int:
    """Rank 0 prints the mistake; every rank exits 2 (see the module docstring)."""
    if rank == 0:
        report(f"config error: {message}", show=True)
        return EXIT_CONFIG
    if _stopped_by_launcher(RANK_ERROR_GRACE_S):
        report(f"config error: {message}", show=False)
    else:  # rank 0 did not fail: this mistake is this rank's own
        report(f"config error (rank {rank}): {message}", show=True)
    return EXIT_CONFIG
