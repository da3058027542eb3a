"""Batches for the trainer: windows of a 1-D token stream in a seeded order, sliced by DP rank.

    train, valid, vocab_size = build_data(cfg.data, seq_len, micro_batch_size, dp_rank, dp_size, cp_rank=0, cp_size=1)
    input_ids, labels = train.next()        # CPU int64 [b, s] each; labels = input_ids shifted by one

The stream is cut into W windows of seq_len+1 tokens (stride seq_len: neighbours share one token, so
every token is a label once per epoch). Global sample i is window perm_e[i % W] of epoch e = i // W,
where perm_e is a fresh seeded shuffle per epoch. Micro-step t covers global samples [t*G, (t+1)*G)
with G = micro_batch_size * dp_size, and DP rank r takes its slice [t*G + r*b, t*G + (r+1)*b). So
DP=2 at micro-batch b sees the same samples as DP=1 at 2b, and the position in the stream is one
number, the global samples consumed: a checkpoint resumes exactly on any DP layout.
With context parallelism (cp_size > 1) the CP ranks of a DP rank share its samples and each keeps its
tokens of them, [b, s/cp] (tpframe/parallel/context.py: shard_sequence).
"""

from __future__ import annotations

import numpy as np
import torch

from tpframe.data.config import DataConfig
from tpframe.errors import ConfigError
from tpframe.data.corpus import TokenStream, stdlib_corpus, synthetic_corpus
from tpframe.data.tokenizer import open_token_file

STATE_FORMAT = "tpframe.data/1"
_SPLIT_IDS = {"train": 0, "valid": 1}  # separate shuffles for the two splits


class BatchIterator:
    """This DP rank's micro-batches from `stream`, forever (wrapping into re-shuffled epochs)."""

    def __init__(self, stream: TokenStream, seq_len: int, micro_batch_size: int, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0, split: str = "train", *, cp_rank: int = 0, cp_size: int = 1):
        if seq_len < 1 or micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(
                f"BatchIterator needs seq_len >= 1, micro_batch_size >= 1 and 0 <= dp_rank < dp_size; got "
                f"seq_len={seq_len}, micro_batch_size={micro_batch_size}, dp_rank={dp_rank}, dp_size={dp_size}"
            )
        if seed < 0:
            raise ValueError(f"data.seed={seed} must be a non-negative integer")
        if not 0 <= cp_rank < cp_size or (cp_size > 1 and seq_len % (2 * cp_size)):
            raise ValueError(f"BatchIterator needs 0 <= cp_rank < cp_size and seq_len divisible by 2*cp_size; got "
                             f"cp_rank={cp_rank}, cp_size={cp_size}, seq_len={seq_len}")
        self.cp_rank, self.cp_size = cp_rank, cp_size
        if split not in _SPLIT_IDS:
            raise ValueError(f"split={split!r} must be one of {', '.join(_SPLIT_IDS)}")
        self.stream, self.seq_len, self.split, self.seed = stream, seq_len, split, seed
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.num_windows = (len(stream.tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise ValueError(
                f"the {split} stream has {len(stream.tokens)} tokens, fewer than one window of "
                f"seq_len+1={seq_len + 1}; use more data or a shorter train.seq_len"
            )
        self.samples_consumed = 0  # global samples (all DP ranks) handed out so far
        self._orders: dict[int, np.ndarray] = {}

    @property
    def epoch(self) -> int:
        return self.samples_consumed // self.num_windows

    @property
    def global_batch(self) -> int:
        """G: samples per micro-step over all DP ranks."""
        return self.micro_batch_size * self.dp_size

    def _order(self, epoch: int) -> np.ndarray:
        """perm_e: argsort of seeded raw 64-bit draws (our own reduction, so the order does not depend
        on numpy's sampling algorithms, which may change between versions)."""
        if epoch not in self._orders:
            gen = np.random.PCG64(np.random.SeedSequence([self.seed, _SPLIT_IDS[self.split], epoch]))
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1}  # keep the previous
            self._orders[epoch] = np.argsort(gen.random_raw(self.num_windows), kind="stable")
        return self._orders[epoch]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [b, s], labels [b, s]) (this CP rank's [b, s/cp]), CPU int64; advances the global position by G."""
        b, s = self.micro_batch_size, self.seq_len
        sample = self.samples_consumed + self.dp_rank * b + np.arange(b, dtype=np.int64)
        epochs, pos = np.divmod(sample, self.num_windows)
        windows = np.empty(b, dtype=np.int64)
        for e in np.unique(epochs):  # a micro-batch may straddle an epoch boundary
            windows[epochs == e] = self._order(int(e))[pos[epochs == e]]
        chunk = np.asarray(self.stream.tokens[windows[:, None] * s + np.arange(s + 1)], dtype=np.int64)
        if chunk.max() >= self.stream.vocab_size:
            raise ValueError(
                f"the {self.split} data holds token id {int(chunk.max())} >= vocab_size {self.stream.vocab_size}: "
                "the token file and its sidecar disagree; re-run tools/prepare_data.py"
            )
        self.samples_consumed += self.global_batch
        chunk = torch.from_numpy(chunk)
        if self.cp_size > 1:
            from tpframe.parallel.context import shard_sequence  # here: tools/prepare_data.py needs no torch.distributed

            return tuple(shard_sequence(t, dim=1, rank=self.cp_rank, size=self.cp_size) for t in (chunk[:, :-1], chunk[:, 1:]))
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    __next__ = next

    def __iter__(self) -> BatchIterator:
        return self

    def reset(self) -> None:
        """Back to the first sample: evaluate on the same held-out samples every time."""
        self.samples_consumed = 0

    def state_dict(self) -> dict:
        """The position in the stream, independent of the DP layout (JSON-able)."""
        return {
            "format": STATE_FORMAT, "split": self.split, "seed": self.seed, "corpus": self.stream.fingerprint,
            "seq_len": self.seq_len, "num_windows": self.num_windows,
            "samples_consumed": self.samples_consumed, "epoch": self.epoch,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where `state` was taken, at any DP layout; ValueError if it is for other data."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"not a data iterator state (expected format {STATE_FORMAT!r}): {str(state)[:200]}")
        checks = (
            ("split", "split", "a {0} iterator's state cannot be loaded into the {1} iterator"),
            ("seed", "data.seed", "set data.seed={0} to resume this run"),
            ("seq_len", "train.seq_len", "set train.seq_len={0} to resume this run"),
            ("corpus", "data stream", "resume with the same data.source/data.path/data.synthetic_tokens/"
                                      "data.valid_fraction, or start a fresh run"),
            ("num_windows", "number of windows", "resume with the same data and train.seq_len"),
        )
        mine = self.state_dict()
        for field, name, fix in checks:
            if state.get(field) != mine[field]:
                raise ValueError(
                    f"the checkpoint's data position does not fit this run: {name} is {state.get(field)!r} in the "
                    f"checkpoint but {mine[field]!r} now; " + fix.format(state.get(field), mine[field])
                )
        consumed = state.get("samples_consumed")
        if not isinstance(consumed, int) or consumed < 0:
            raise ValueError(f"data state has samples_consumed={consumed!r}; expected an integer >= 0")
        self.samples_consumed = consumed

    def describe(self) -> str:
        return (f"{self.split}: {len(self.stream.tokens):,} tokens, {self.num_windows:,} windows of "
                f"{self.seq_len}+1, epoch {self.epoch}, {self.samples_consumed:,} samples consumed")


def split_stream(stream: TokenStream, valid_fraction: float, seq_len: int, fix: str) -> tuple[TokenStream, TokenStream]:
    """(head, tail): the last `valid_fraction` of the tokens is held out; the two share no token."""
    n = len(stream.tokens)
    cut = n - int(round(n * valid_fraction))
    if min(cut, n - cut) < seq_len + 1:
        raise ConfigError(
            f"the corpus has {n:,} tokens: too few for a training and a held-out part of at least "
            f"train.seq_len+1={seq_len + 1} tokens each at data.valid_fraction={valid_fraction}; {fix}"
        )
    head = TokenStream(stream.tokens[:cut], stream.vocab_size, f"{stream.fingerprint}[:{cut}]")
    tail = TokenStream(stream.tokens[cut:], stream.vocab_size, f"{stream.fingerprint}[{cut}:]")
    return head, tail


def load_streams(cfg: DataConfig, seq_len: int) -> tuple[TokenStream, TokenStream]:
    """(train stream, held-out stream) for `cfg.source`."""
    if cfg.source == "synthetic":
        fix = "raise data.synthetic_tokens or lower train.seq_len"
        return split_stream(synthetic_corpus(cfg.synthetic_tokens, cfg.seed), cfg.valid_fraction, seq_len, fix)
    if cfg.source == "stdlib":
        return split_stream(stdlib_corpus(), cfg.valid_fraction, seq_len, "lower train.seq_len")
    if cfg.source != "tokens":
        raise ConfigError(f"data.source={cfg.source!r} is not allowed; choose 'synthetic', 'stdlib' or 'tokens'")
    if not cfg.path:
        raise ConfigError("data.source=tokens needs data.path (a token file made by tools/prepare_data.py)")
    train, meta = open_token_file(cfg.path, "data.path")
    if cfg.valid_path is None:
        fix = f"prepare more text for {cfg.path} or lower train.seq_len"
        return split_stream(train, cfg.valid_fraction, seq_len, fix)
    valid, valid_meta = open_token_file(cfg.valid_path, "data.valid_path")
    mine, theirs = _tokenizer_id(meta), _tokenizer_id(valid_meta)
    if (mine, meta["vocab_size"]) != (theirs, valid_meta["vocab_size"]):
        raise ConfigError(
            f"data.valid_path={cfg.valid_path!r} was made with tokenizer {theirs} (vocab {valid_meta['vocab_size']}) "
            f"but data.path={cfg.path!r} with {mine} (vocab {meta['vocab_size']}); "
            "prepare both with the same --tokenizer"
        )
    for stream, key, path in ((train, "data.path", cfg.path), (valid, "data.valid_path", cfg.valid_path)):
        if len(stream.tokens) < seq_len + 1:
            raise ConfigError(
                f"{key}={path!r} holds {len(stream.tokens)} tokens, fewer than one window of "
                f"train.seq_len+1={seq_len + 1}; prepare more text or lower train.seq_len"
            )
    return train, valid


def _tokenizer_id(meta: dict) -> str:
    tok = meta["tokenizer"]
    return f"{tok.get('kind')}" + (f":{str(tok['sha256'])[:12]}" if "sha256" in tok else "")


def build_data(cfg: DataConfig, seq_len: int, micro_batch_size: int, dp_rank: int,
               dp_size: int, *, cp_rank: int = 0, cp_size: int = 1) -> tuple[BatchIterator, BatchIterator, int]:
    """(train iterator, validation iterator, vocab_size of the token stream) for this DP (and CP) rank.

    TP ranks with the same dp_rank and cp_rank get identical batches (everything here is deterministic).
    """
    train, valid = load_streams(cfg, seq_len)
    iterators = [BatchIterator(stream, seq_len, micro_batch_size, dp_rank, dp_size, cfg.seed, split,
                               cp_rank=cp_rank, cp_size=cp_size)
                 for stream, split in ((train, "train"), (valid, "valid"))]
    return iterators[0], iterators[1], train.vocab_size
