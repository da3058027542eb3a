"""The `data:` section of a run config (it lives with the data package, which reads it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class DataConfig:
    source: Literal["synthetic", "stdlib", "tokens"] = "synthetic"  # the token stream (README: Data)
    path: str | list[str] | None = None  # source=tokens: a token file made by tools/prepare_data.py, or a list to blend
    weights: list[float] | None = None  # a blend's share of samples per path; None: in proportion to their tokens
    valid_path: str | None = None  # source=tokens: held-out token file (default: the tail of each `path`)
    valid_fraction: float = 0.05  # held-out share when no separate validation file is given
    synthetic_tokens: int = 2_000_000  # size of the generated corpus (source=synthetic)
    seed: int = 1234  # data order; independent of the model seed
    # no loss on the token after each end-of-document (model.eod_id), the loss averaged over the tokens that carry
    # one in the global batch (Megatron's --eod-mask-loss)
    eod_mask_loss: bool = False

    @property
    def paths(self) -> list[str]:
        """The token files, one or several (source=tokens)."""
        return [] if not self.path else [self.path] if isinstance(self.path, str) else list(self.path)

    def path_key(self, i: int) -> str:
        """How errors name the i-th token file: data.path, or data.path[i] in a blend."""
        return "data.path" if isinstance(self.path, str) else f"data.path[{i}]"
