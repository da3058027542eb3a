"""A run's set-up: pre-flight checks before any process group, the memory estimate, --help, run locks."""

LAUNCHER_PID_ENV = "TPFRAME_LAUNCHER_PID"  # set for the workers: they stop when that process dies (train.py)
