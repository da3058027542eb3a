"""The `data:` section of a run config (it lives with the data package, which reads it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class DataConfig:
    source: Literal["synthetic", "stdlib", "tokens"] = "synthetic"  # the token stream (README: Data)
    path: str | None = None  # source=tokens: a token file made by tools/prepare_data.py
    valid_path: str | None = None  # source=tokens: held-out token file (default: the tail of `path`)
    valid_fraction: float = 0.05  # held-out share when no separate validation file is given
    synthetic_tokens: int = 2_000_000  # size of the generated corpus (source=synthetic)
    seed: int = 1234  # data order; independent of the model seed
