"""The `comm:` section of a run config and its checks, with the env vars that override it."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal

from tpframe.comm.communicator import BACKENDS, resolve_backend_name
from tpframe.config import check_ranges
from tpframe.errors import ConfigError

# The timeouts' ceiling: torch's stores and process groups count milliseconds in C integers (1e10 s overflows).
TIMEOUT_MAX_S = 1e6


@dataclass
class CommConfig:
    backend: Literal[BACKENDS] = "auto"  # TP collectives; env TPFRAME_COMM_BACKEND overrides
    timeout_s: float = 300.0  # every process group: a collective waiting longer ends the run (exit code 4)


def check_comm(c: CommConfig) -> None:
    """The `comm:` section and the env vars that override it (TPFRAME_COMM_BACKEND, TPFRAME_SYMM_BUFFER_MB)."""
    check_ranges("comm", c, (("timeout_s", 0.0, TIMEOUT_MAX_S, False),))
    try:
        resolve_backend_name(c.backend)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    raw = os.environ.get("TPFRAME_SYMM_BUFFER_MB")
    if raw is not None:
        try:
            ok = float(raw) > 0 and math.isfinite(float(raw))
        except ValueError:
            ok = False
        if not ok:
            raise ConfigError(f"env var TPFRAME_SYMM_BUFFER_MB={raw!r} must be a positive number of MiB")
