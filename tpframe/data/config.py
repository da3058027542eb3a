"""The `data:` section of a run config and its checks (it lives with the data package, which reads it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tpframe.config import check_at_least, check_paths_given
from tpframe.data.corpus import SYNTHETIC_TOKENS_MAX
from tpframe.data.tokenizer import BYTE_SOURCES
from tpframe.errors import ConfigError, shown

SOURCES = (*BYTE_SOURCES, "tokens")  # the embedded byte-level corpora, or token files (tools/prepare_data.py)


@dataclass
class DataConfig:
    source: Literal[SOURCES] = "synthetic"  # the token stream (README: Data)
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


# what to give instead of "" for a path key (checked by tpframe.config.check_paths_given)
PATH_KEYS = {
    "path": "a token file made by tools/prepare_data.py",
    "valid_path": "a held-out token file, or leave it out (null) to hold out the tail of data.path",
}


def check_data(d: DataConfig) -> None:
    """The `data:` section: a seed, a corpus the synthetic generator can make, token files where they are read."""
    if d.seed < 0:
        raise ConfigError(f"data.seed={d.seed} must be a non-negative integer")
    check_at_least("data", d, ("synthetic_tokens",), 2)
    if d.synthetic_tokens > SYNTHETIC_TOKENS_MAX:
        n = d.synthetic_tokens
        raise ConfigError(
            f"data.synthetic_tokens={f'{n:,}' if n < 10**15 else f'{n:.3g}'} is more than the synthetic corpus takes "
            f"({SYNTHETIC_TOKENS_MAX:,} at most: every rank generates it in memory before training, a minute and "
            "gigabytes for that many); for more data use data.source=tokens (tools/prepare_data.py)"
        )
    check_paths_given("data", d, PATH_KEYS)
    if d.source == "tokens" and not d.paths:
        raise ConfigError("data.source=tokens needs data.path (a token file made by tools/prepare_data.py)")
    if d.source != "tokens" and (d.path or d.weights):
        raise ConfigError(
            f"data.path and data.weights are for data.source=tokens (got data.source={d.source}); "
            "set data.source=tokens or drop them"
        )
    if d.source != "tokens" and d.valid_path:  # it would be ignored
        raise ConfigError(
            f"data.valid_path is a held-out token file for data.source=tokens (got "
            f"data.source={d.source}); set data.source=tokens or drop it"
        )
    _check_blend(d)
    if not 0.0 < d.valid_fraction < 1.0:
        raise ConfigError(f"data.valid_fraction={d.valid_fraction} must be in (0, 1)")


def _check_blend(d: DataConfig) -> None:
    """data.weights: one positive share per file of data.path."""
    if d.weights is None:
        return
    if isinstance(d.path, str):
        raise ConfigError(
            "data.weights blends several token files: give data.path as a list of as many files, "
            "e.g. data.path=[a.bin,b.bin] data.weights=[0.7,0.3]"
        )
    if len(d.weights) != len(d.paths):
        raise ConfigError(
            f"data.weights has {len(d.weights)} entries but data.path lists {len(d.paths)} files; "
            "give one weight per file"
        )
    if not all(0.0 < w < float("inf") for w in d.weights):
        raise ConfigError(f"data.weights={shown(d.weights)} must all be positive numbers (a share of samples per file)")
