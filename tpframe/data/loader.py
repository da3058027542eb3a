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
tokens of them, [b, s/cp] (tpframe/layers/context.py: shard_sequence).

Several token files (data.path as a list) are blended by the same `BatchIterator`: global sample i comes from
one file, chosen by a fixed rule from i and the weights, and is that file's next sample in its own
seeded order; the position is still global, so blends resume exactly on any DP layout too.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from tpframe.data.config import SOURCES, DataConfig
from tpframe.data.corpus import TokenStream, stdlib_corpus, synthetic_corpus
from tpframe.data.tokenizer import open_token_file
from tpframe.errors import ConfigError

IGNORE_INDEX = -100  # a label the cross entropy skips (tpframe/training/loss_mask.py)
STATE_FORMAT = "tpframe.data/1"
BLEND_FORMAT = "tpframe.data.blend/1"
_SPLIT_IDS = {"train": 0, "valid": 1}  # separate shuffles for the two splits
# (field, name, fix) that a data state must share with the run loading it, for one stream and for a blend alike
_RUN_FIELDS = (
    ("split", "split", "a {0} iterator's state cannot be loaded into the {1} iterator"),
    ("seed", "data.seed", "set data.seed={0} to resume this run"),
    ("seq_len", "train.seq_len", "set train.seq_len={0} to resume this run"),
)
_STREAM_FIELDS = (  # and those of one stream
    (
        "corpus",
        "data stream",
        "resume with the same data.source/data.path/data.synthetic_tokens/data.valid_fraction, or start a fresh run",
    ),
    ("num_windows", "number of windows", "resume with the same data and train.seq_len"),
)
_BLEND_FIELDS = (  # and those of a blend
    ("corpus", "the blend's files", "resume with the same data.path files, in the same order"),
    ("weights", "data.weights (normalized)", "resume with the same data.weights"),  # JSON keeps floats exact
    ("num_windows", "number of windows", "resume with the same data"),
)


class _Windows:
    """One token stream cut into W windows of seq_len+1 tokens, read in a seeded order epoch after epoch: an
    unblended run's stream, or one file of a blend (`source`: its index, mixed into the seed)."""

    def __init__(self, stream: TokenStream, seq_len: int, seed: int, split: str, source: int | None):
        if stream.row is not None and stream.row != seq_len:
            raise ValueError(
                f"the {split} data is packed into rows of {stream.row} tokens (prepare_data.py --seq-len): set "
                f"train.seq_len={stream.row}, or prepare it again with --seq-len {seq_len}"
            )
        self.num_windows = (len(stream.tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise ValueError(
                f"the {split} stream has {len(stream.tokens)} tokens, fewer than one window of "
                f"seq_len+1={seq_len + 1}; use more data or a shorter train.seq_len"
            )
        self.stream, self.seq_len, self.split = stream, seq_len, split
        self._seed, self._source = [seed, _SPLIT_IDS[split]], [] if source is None else [source + 1]
        self._orders: dict[int, np.ndarray] = {}

    def order(self, epoch: int) -> np.ndarray:
        """perm_e: argsort of seeded raw 64-bit draws (our own reduction, so the order does not depend
        on numpy's sampling algorithms, which may change between versions)."""
        if epoch not in self._orders:
            gen = np.random.PCG64(np.random.SeedSequence([*self._seed, epoch, *self._source]))
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1}  # keep the previous
            self._orders[epoch] = np.argsort(gen.random_raw(self.num_windows), kind="stable")
        return self._orders[epoch]

    def chunk(self, sample: np.ndarray) -> np.ndarray:
        """Tokens [n, s+1] (int64) of the samples at positions `sample` of this stream's epoch-by-epoch order."""
        s = self.seq_len
        epochs, pos = np.divmod(sample, self.num_windows)
        windows = np.empty(len(sample), dtype=np.int64)
        for e in np.unique(epochs):  # a micro-batch may straddle an epoch boundary
            windows[epochs == e] = self.order(int(e))[pos[epochs == e]]
        where = windows[:, None] * s + np.arange(s + 1)
        chunk = np.asarray(self.stream.tokens[where], dtype=np.int64)
        if chunk.size and chunk.max() >= self.stream.vocab_size:
            raise ValueError(
                f"the {self.split} data holds token id {int(chunk.max())} >= vocab_size {self.stream.vocab_size}: "
                "the token file and its sidecar disagree; re-run tools/prepare_data.py"
            )
        if self.stream.loss_mask is not None:  # a label without loss travels as ~id (negative) to `_to_batch`
            chunk = np.where(self.stream.loss_mask[where] == 0, ~chunk, chunk)
        return chunk


class BatchIterator:
    """This DP rank's micro-batches from one token stream, or from a blend of several in fixed shares (data.path as
    a list), forever (wrapping into re-shuffled epochs).

    In a blend, global sample i comes from the stream whose count so far falls furthest below its share of i+1
    samples (Megatron-Core's blending rule; ties go to the earlier stream), so every prefix of the global order holds
    each stream within one sample of its weight; within a stream, samples follow its own seeded window order and
    epochs. The position is global, samples consumed and how many each stream has given (`taken`), so a blend
    resumes exactly on any DP layout; each rank runs the rule over the whole micro-step (G samples) and keeps its
    slice. One stream is the blend of one: its sample i is global sample i (its state keeps the one-stream format).
    """

    def __init__(
        self,
        streams: TokenStream | list[TokenStream],
        seq_len: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        split: str = "train",
        *,
        weights: list[float] | None = None,
        cp_rank: int = 0,
        cp_size: int = 1,
    ):
        streams = [streams] if isinstance(streams, TokenStream) else list(streams)
        weights = [1.0] * len(streams) if weights is None else weights
        if len(streams) != len(weights) or not streams or not all(0 < w < float("inf") for w in weights):
            raise ValueError(
                f"BatchIterator needs one positive weight per stream; got {len(streams)} streams and weights {weights}"
            )
        if seq_len < 1 or micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(
                f"BatchIterator needs seq_len >= 1, micro_batch_size >= 1 and 0 <= dp_rank < dp_size; got "
                f"seq_len={seq_len}, micro_batch_size={micro_batch_size}, dp_rank={dp_rank}, dp_size={dp_size}"
            )
        if seed < 0:
            raise ValueError(f"data.seed={seed} must be a non-negative integer")
        if not 0 <= cp_rank < cp_size or (cp_size > 1 and seq_len % (2 * cp_size)):
            raise ValueError(
                f"BatchIterator needs 0 <= cp_rank < cp_size and seq_len divisible by 2*cp_size; got "
                f"cp_rank={cp_rank}, cp_size={cp_size}, seq_len={seq_len}"
            )
        if split not in _SPLIT_IDS:
            raise ValueError(f"split={split!r} must be one of {', '.join(_SPLIT_IDS)}")
        blended = len(streams) > 1  # each file its own order
        self.sources = [_Windows(st, seq_len, seed, split, i if blended else None) for i, st in enumerate(streams)]
        total = float(sum(weights))
        self.weights = [w / total for w in weights]
        self.seq_len, self.split, self.seed = seq_len, split, seed
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.reset()

    @property
    def streams(self) -> list[TokenStream]:
        return [src.stream for src in self.sources]

    @property
    def loss_masked(self) -> bool:
        """Whether some labels carry no loss (instruction data: tpframe/data/instruct.py)."""
        return any(st.loss_mask is not None for st in self.streams)

    @property
    def epoch(self) -> int:
        """The epoch of an unblended stream."""
        return self.samples_consumed // self.sources[0].num_windows

    @property
    def global_batch(self) -> int:
        """G: samples per micro-step over all DP ranks."""
        return self.micro_batch_size * self.dp_size

    def reset(self) -> None:
        """Back to the first sample: evaluate on the same held-out samples every time."""
        self.samples_consumed = 0  # global samples (all DP ranks) handed out so far
        self.taken = [0] * len(self.sources)  # samples each stream has given; sums to samples_consumed

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [b, s], labels [b, s]) (this CP rank's [b, s/cp]), CPU int64; advances the global position
        by G."""
        b = self.micro_batch_size
        which, local, taken = _pick_sources(self.weights, self.taken, self.samples_consumed, self.global_batch)
        mine = slice(self.dp_rank * b, (self.dp_rank + 1) * b)
        which, local = np.array(which[mine]), np.array(local[mine], dtype=np.int64)
        chunk = np.empty((b, self.seq_len + 1), dtype=np.int64)
        for d in np.unique(which):
            chunk[which == d] = self.sources[d].chunk(local[which == d])
        self.samples_consumed += self.global_batch
        self.taken = taken
        return _to_batch(chunk, self.cp_rank, self.cp_size)

    __next__ = next

    def __iter__(self) -> BatchIterator:
        return self

    def state_dict(self) -> dict:
        """The position in the stream or blend, independent of the DP layout (JSON-able)."""
        run = {"split": self.split, "seed": self.seed}
        if len(self.sources) == 1:
            return {
                "format": STATE_FORMAT,
                **run,
                "corpus": self.sources[0].stream.fingerprint,
                "seq_len": self.seq_len,
                "num_windows": self.sources[0].num_windows,
                "samples_consumed": self.samples_consumed,
                "epoch": self.epoch,
            }
        return {
            "format": BLEND_FORMAT,
            **run,
            "seq_len": self.seq_len,
            "corpus": [src.stream.fingerprint for src in self.sources],
            "weights": self.weights,
            "num_windows": [src.num_windows for src in self.sources],
            "samples_consumed": self.samples_consumed,
            "taken": list(self.taken),
            "epochs": [t // src.num_windows for t, src in zip(self.taken, self.sources)],
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where `state` was taken, at any DP layout; ValueError if it is for other data."""
        blended = len(self.sources) > 1
        _check_format(state, BLEND_FORMAT if blended else STATE_FORMAT)
        _check_remade(state.get("corpus"), self.streams)
        _check_fields(state, self.state_dict(), _RUN_FIELDS + (_BLEND_FIELDS if blended else _STREAM_FIELDS))
        consumed = state.get("samples_consumed")
        taken = state.get("taken") if blended else [consumed]
        if (
            not isinstance(consumed, int)
            or consumed < 0
            or not isinstance(taken, list)
            or len(taken) != len(self.sources)
            or not all(isinstance(t, int) and t >= 0 for t in taken)
            or sum(taken) != consumed
        ):
            raise ValueError(
                f"data state has samples_consumed={consumed!r} and taken={taken!r}; expected integers >= 0, one per "
                "file, that sum to samples_consumed"
                if blended
                else f"data state has samples_consumed={consumed!r}; expected an integer >= 0"
            )
        self.samples_consumed, self.taken = consumed, list(taken)

    def describe(self) -> str:
        if len(self.sources) == 1:
            src = self.sources[0]
            return (
                f"{self.split}: {len(src.stream.tokens):,} tokens, {src.num_windows:,} windows of "
                f"{self.seq_len}+1, epoch {self.epoch}, {self.samples_consumed:,} samples consumed"
            )
        parts = [
            f"{w:.1%} of {len(src.stream.tokens):,} tokens ({src.num_windows:,} windows, epoch {t // src.num_windows})"
            for w, t, src in zip(self.weights, self.taken, self.sources)
        ]
        return f"{self.split}: a blend of {'; '.join(parts)}; {self.samples_consumed:,} samples consumed"


def _pick_sources(weights: list[float], taken: list[int], start: int, n: int) -> tuple[list[int], list[int], list[int]]:
    """(stream, index among that stream's samples) of each of the global samples start..start+n-1 by the blending
    rule, and `taken` after them."""
    if len(weights) == 1:  # one stream: global sample i is its sample i
        return [0] * n, list(range(start, start + n)), [start + n]
    which, local, taken = [], [], list(taken)
    for i in range(start, start + n):
        d = max(range(len(weights)), key=lambda j: (weights[j] * (i + 1) - taken[j], -j))
        which.append(d)
        local.append(taken[d])
        taken[d] += 1
    return which, local, taken


def _to_batch(chunk: np.ndarray, cp_rank: int, cp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) from token rows [b, s+1] (~id: a label without loss, IGNORE_INDEX); this CP rank's share of
    each when cp_size > 1."""
    chunk = torch.from_numpy(chunk)
    inputs, labels = torch.where(chunk < 0, ~chunk, chunk)[:, :-1], torch.where(chunk < 0, IGNORE_INDEX, chunk)[:, 1:]
    if cp_size > 1:
        from tpframe.layers.context import shard_sequence  # here: tools/prepare_data.py needs no torch.distributed

        return tuple(shard_sequence(t, dim=1, rank=cp_rank, size=cp_size) for t in (inputs, labels))
    return inputs.contiguous(), labels.contiguous()


def _check_fields(state: dict, mine: dict, checks) -> None:
    """ValueError naming the first (field, name, fix) of `checks` where `state` and this run's state differ."""
    for field, name, fix in checks:
        if state.get(field) != mine[field]:
            raise ValueError(
                f"the checkpoint's data position does not fit this run: {name} is {state.get(field)!r} in the "
                f"checkpoint but {mine[field]!r} now; " + fix.format(state.get(field), mine[field])
            )


def _check_remade(saved, streams) -> None:
    """ValueError naming the token file whose content differs from the one the checkpoint was trained on."""
    saved = saved if isinstance(saved, list) else [saved]
    for old, stream in zip(saved, streams):
        if stream.name and isinstance(old, str) and old.split("[")[0] != stream.fingerprint.split("[")[0]:
            raise ValueError(
                f"the checkpoint's data position does not fit this run: {stream.name} holds other tokens than the "
                "file this checkpoint was trained on (re-made or replaced since); resume with the data it was "
                "trained on, or start a fresh run (checkpoint.init_from for the weights)"
            )


def _check_format(state: dict, expected: str) -> None:
    kinds = {STATE_FORMAT: "one token stream", BLEND_FORMAT: "a blend of token files (data.path as a list)"}
    got = state.get("format") if isinstance(state, dict) else None
    if got in kinds and got != expected:
        raise ValueError(
            f"the checkpoint's data position is for {kinds[got]} but this run reads {kinds[expected]}; "
            "resume with the checkpoint's data.path and data.weights"
        )
    if got != expected:
        raise ValueError(f"not a data iterator state (expected format {expected!r}): {str(state)[:200]}")


def split_stream(stream: TokenStream, valid_fraction: float, seq_len: int, fix: str) -> tuple[TokenStream, TokenStream]:
    """(head, tail): the last `valid_fraction` of the tokens is held out; the two share no token."""
    n = len(stream.tokens)
    cut = n - int(round(n * valid_fraction))
    if stream.row:  # packed rows: whole rows on each side; the head keeps the tail's first token as its last label
        cut = cut // stream.row * stream.row
        return _part(stream, 0, cut + 1, seq_len, fix), _part(stream, cut, n, seq_len, fix)
    if min(cut, n - cut) < seq_len + 1:
        raise ConfigError(
            f"the corpus has {n:,} tokens: too few for a training and a held-out part of at least "
            f"train.seq_len+1={seq_len + 1} tokens each at data.valid_fraction={valid_fraction}; {fix}"
        )
    head = replace(stream, tokens=stream.tokens[:cut], fingerprint=f"{stream.fingerprint}[:{cut}]")
    tail = replace(stream, tokens=stream.tokens[cut:], fingerprint=f"{stream.fingerprint}[{cut}:]")
    return head, tail


def _part(stream: TokenStream, a: int, b: int, seq_len: int, fix: str) -> TokenStream:
    """Tokens [a, b) of packed instruction data, with their loss mask."""
    if b - a < seq_len + 1:
        raise ConfigError(
            f"the instruction data has {len(stream.tokens) // seq_len} rows: too few for a training and a held-out "
            f"part at data.valid_fraction; {fix}"
        )
    name = f"{stream.fingerprint}[{a}:{b}]"
    return TokenStream(stream.tokens[a:b], stream.vocab_size, name, stream.eot_id, stream.loss_mask[a:b], stream.row)


def load_streams(cfg: DataConfig, seq_len: int) -> tuple[list[TokenStream], list[TokenStream]]:
    """(training streams, held-out streams) for `cfg.source`: one each, or one per file of a blend."""
    if cfg.source == "synthetic":
        fix = "raise data.synthetic_tokens or lower train.seq_len"
        train, valid = split_stream(synthetic_corpus(cfg.synthetic_tokens, cfg.seed), cfg.valid_fraction, seq_len, fix)
        return [train], [valid]
    if cfg.source == "stdlib":
        train, valid = split_stream(stdlib_corpus(), cfg.valid_fraction, seq_len, "lower train.seq_len")
        return [train], [valid]
    if cfg.source != "tokens":
        raise ConfigError(f"data.source={cfg.source!r} is not allowed; choose one of {', '.join(map(repr, SOURCES))}")
    if not cfg.paths:
        raise ConfigError("data.source=tokens needs data.path (a token file made by tools/prepare_data.py)")
    files = [(cfg.path_key(i), p) for i, p in enumerate(cfg.paths)]
    files += [("data.valid_path", cfg.valid_path)] if cfg.valid_path is not None else []
    opened = [open_token_file(path, key) for key, path in files]
    (key0, path0), meta0 = files[0], opened[0][1]
    for (key, path), (_, meta) in zip(files[1:], opened[1:]):
        if (_tokenizer_id(meta), meta["vocab_size"]) != (_tokenizer_id(meta0), meta0["vocab_size"]):
            raise ConfigError(
                f"{key}={path!r} was made with tokenizer {_tokenizer_id(meta)} (vocab {meta['vocab_size']}) but "
                f"{key0}={path0!r} with {_tokenizer_id(meta0)} (vocab {meta0['vocab_size']}); prepare all of them "
                "with the same --tokenizer"
            )
    streams = [stream for stream, _ in opened]
    if cfg.valid_path is None:
        parts = [
            split_stream(st, cfg.valid_fraction, seq_len, f"prepare more text for {path} or lower train.seq_len")
            for st, (_, path) in zip(streams, files)
        ]
        return [head for head, _ in parts], [tail for _, tail in parts]
    for stream, (key, path) in zip(streams, files):
        if len(stream.tokens) < seq_len + 1:
            raise ConfigError(
                f"{key}={path!r} holds {len(stream.tokens)} tokens, fewer than one window of "
                f"train.seq_len+1={seq_len + 1}; prepare more text or lower train.seq_len"
            )
    return streams[:-1], streams[-1:]


def _tokenizer_id(meta: dict) -> str:
    tok = meta["tokenizer"]
    return f"{tok.get('kind')}" + (f":{str(tok['sha256'])[:12]}" if "sha256" in tok else "")


def build_data(
    cfg: DataConfig,
    seq_len: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    *,
    cp_rank: int = 0,
    cp_size: int = 1,
) -> tuple[BatchIterator, BatchIterator, int]:
    """(train iterator, validation iterator, vocab_size of the token stream) for this DP (and CP) rank.

    A blend (several files in data.path): data.weights, or the files' token counts, set each file's share of the
    samples; the held-out tails are blended in the same shares. TP ranks with the same dp_rank and cp_rank get
    identical batches (everything here is deterministic).
    """
    train, valid = load_streams(cfg, seq_len)
    weights = cfg.weights or [float(len(st.tokens)) for st in train]
    args = (seq_len, micro_batch_size, dp_rank, dp_size, cfg.seed)

    def iterator(streams: list[TokenStream], split: str) -> BatchIterator:
        blend = weights if len(streams) > 1 else None  # None: one stream (data.valid_path's held-out one too)
        return BatchIterator(streams, *args, split, weights=blend, cp_rank=cp_rank, cp_size=cp_size)

    return iterator(train, "train"), iterator(valid, "valid"), train[0].vocab_size
