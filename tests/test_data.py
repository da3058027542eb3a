"""The data contract the trainer relies on: deterministic order, DP slicing, exact layout-free resume."""

import json
import math
import time

import numpy as np
import pytest
import torch

from tpframe.data import corpus
from tpframe.data.corpus import TokenStream, stdlib_corpus, synthetic_corpus, synthetic_entropy_floor
from tpframe.data.loader import BatchIterator, build_data, split_stream
from tpframe.training.config import ConfigError, DataConfig

SEQ = 16
SMALL = DataConfig(synthetic_tokens=40_000, seed=7)


def _batches(it, n):
    return [it.next() for _ in range(n)]


def _windows_of(it, n_steps):
    """The global-window ids an iterator hands out, read back through its tokens."""
    tokens = np.asarray(it.streams[0].tokens, dtype=np.int64)
    table = {
        tuple(tokens[w * it.seq_len : w * it.seq_len + it.seq_len + 1]): w for w in range(it.sources[0].num_windows)
    }
    out = []
    for _ in range(n_steps):
        x, y = it.next()
        out += [table[tuple(torch.cat([x[i, :1], y[i]]).tolist())] for i in range(x.shape[0])]
    return out


def test_batches_are_deterministic_and_labels_are_inputs_shifted_by_one():
    a, _, vocab = build_data(SMALL, SEQ, 4, 0, 1)
    b, _, _ = build_data(SMALL, SEQ, 4, 0, 1)
    assert vocab == 256
    for (xa, ya), (xb, yb) in zip(_batches(a, 5), _batches(b, 5)):
        assert xa.dtype == torch.int64 and xa.shape == ya.shape == (4, SEQ) and xa.device.type == "cpu"
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert torch.equal(xa[:, 1:], ya[:, :-1])
        assert int(ya.max()) < vocab
    # every row is a real window of the stream: input + last label == tokens[w*s : w*s+s+1]
    it, _, _ = build_data(SMALL, SEQ, 4, 0, 1)
    assert len(_windows_of(it, 3)) == 12


def test_another_seed_gives_another_order():
    a, _, _ = build_data(SMALL, SEQ, 4, 0, 1)
    b, _, _ = build_data(DataConfig(synthetic_tokens=40_000, seed=8), SEQ, 4, 0, 1)
    assert not torch.equal(a.next()[0], b.next()[0])


def test_dp2_ranks_split_the_dp1_global_batch_disjointly():
    dp1, _, _ = build_data(SMALL, SEQ, 6, 0, 1)
    r0, _, _ = build_data(SMALL, SEQ, 3, 0, 2)
    r1, _, _ = build_data(SMALL, SEQ, 3, 1, 2)
    for _ in range(4):
        x, y = dp1.next()
        (x0, y0), (x1, y1) = r0.next(), r1.next()
        assert torch.equal(torch.cat([x0, x1]), x) and torch.equal(torch.cat([y0, y1]), y)
        assert not {tuple(r) for r in x0.tolist()} & {tuple(r) for r in x1.tolist()}


def test_state_dict_round_trip_resumes_exactly():
    it, _, _ = build_data(SMALL, SEQ, 4, 0, 1)
    _batches(it, 7)
    state = json.loads(json.dumps(it.state_dict()))  # JSON-able, and small
    assert len(json.dumps(state)) < 500 and state["samples_consumed"] == 28
    expected = _batches(it, 5)
    fresh, _, _ = build_data(SMALL, SEQ, 4, 0, 1)
    fresh.load_state_dict(state)
    for (x, y), (xe, ye) in zip(_batches(fresh, 5), expected):
        assert torch.equal(x, xe) and torch.equal(y, ye)


@pytest.mark.parametrize("dp_new, mb_new", [(1, 4), (4, 1)])
def test_state_saved_at_dp2_resumes_at_other_dp_sizes(dp_new, mb_new):
    ranks = [build_data(SMALL, SEQ, 2, r, 2)[0] for r in range(2)]
    for _ in range(5):
        for it in ranks:
            it.next()
    state = ranks[1].state_dict()  # any rank's state is the same global position
    assert state == ranks[0].state_dict()
    expected = [torch.cat([it.next()[0] for it in ranks]) for _ in range(3)]
    resumed = [build_data(SMALL, SEQ, mb_new, r, dp_new)[0] for r in range(dp_new)]
    for it in resumed:
        it.load_state_dict(state)
    for want in expected:
        assert torch.equal(torch.cat([it.next()[0] for it in resumed]), want)


def test_epochs_cover_every_window_once_then_reshuffle():
    stream = TokenStream(np.arange(7 * SEQ + 1, dtype=np.int64) % 256, 256, "arange")
    it = BatchIterator(stream, SEQ, 1, seed=3)
    first, second = _windows_of(it, 7), _windows_of(it, 7)
    assert sorted(first) == sorted(second) == list(range(7))
    assert first != second and it.epoch == 2
    # a micro-batch of 3 straddles epoch boundaries: the same global sequence of samples
    it3 = BatchIterator(stream, SEQ, 3, seed=3)
    assert _windows_of(it3, 5)[:14] == first + second


def test_held_out_split_is_the_disjoint_tail():
    full = synthetic_corpus(SMALL.synthetic_tokens, SMALL.seed).tokens
    train, valid, _ = build_data(SMALL, SEQ, 4, 0, 1)
    n_valid = round(len(full) * SMALL.valid_fraction)
    assert len(valid.streams[0].tokens) == n_valid and len(train.streams[0].tokens) == len(full) - n_valid
    assert np.array_equal(np.concatenate([train.streams[0].tokens, valid.streams[0].tokens]), full)
    # windows never reach past their split: the largest training window ends inside the head
    assert (train.sources[0].num_windows * SEQ + 1) <= len(train.streams[0].tokens)
    x, y = valid.next()
    assert x.shape == (4, SEQ)
    valid.next()
    valid.reset()
    assert torch.equal(valid.next()[0], x)


def test_load_state_dict_rejects_another_seed_corpus_or_split():
    it, valid, _ = build_data(SMALL, SEQ, 4, 0, 1)
    cases = [
        (build_data(DataConfig(synthetic_tokens=40_000, seed=9), SEQ, 4, 0, 1)[0], "data.seed"),
        (build_data(DataConfig(synthetic_tokens=50_000, seed=7), SEQ, 4, 0, 1)[0], "data stream"),
        (build_data(SMALL, SEQ * 2, 4, 0, 1)[0], "train.seq_len"),
        (valid, "split"),
    ]
    for other, word in cases:
        with pytest.raises(ValueError, match=word):
            other.load_state_dict(it.state_dict())
    with pytest.raises(ValueError, match="format"):
        it.load_state_dict({"samples_consumed": 3})


def test_bad_iterator_arguments_and_tiny_corpora_fail_clearly():
    with pytest.raises(ValueError, match="dp_rank"):
        build_data(SMALL, SEQ, 4, 2, 2)
    with pytest.raises(ValueError, match="data.seed=-1 must be a non-negative"):
        build_data(DataConfig(synthetic_tokens=1000, seed=-1), SEQ, 4, 0, 1)
    with pytest.raises(ValueError, match="data.seed=-1 must be a non-negative"):
        BatchIterator(TokenStream(np.zeros(40, np.int64), 256, "z"), SEQ, 1, seed=-1)
    with pytest.raises(ConfigError, match="data.synthetic_tokens"):
        build_data(DataConfig(synthetic_tokens=200), 64, 1, 0, 1)
    with pytest.raises(ConfigError, match="data.path"):
        build_data(DataConfig(source="tokens"), SEQ, 1, 0, 1)
    with pytest.raises(ConfigError, match="valid_fraction"):
        split_stream(TokenStream(np.zeros(40, np.int64), 256, "z"), 0.01, SEQ, "fix")


def test_synthetic_corpus_is_deterministic_fast_and_structured():
    start = time.perf_counter()
    tokens, floor = corpus._generate.__wrapped__(2_000_000, 11)  # uncached
    assert time.perf_counter() - start < 4.0  # ~0.5 s here; the contract is < 2 s
    assert len(tokens) == 2_000_000 and int(tokens.max()) < 128
    again = synthetic_corpus(2_000_000, 11)
    assert np.array_equal(again.tokens, tokens) and again.vocab_size == 256
    assert not np.array_equal(synthetic_corpus(100_000, 12).tokens, tokens[:100_000])
    # structure: next-byte entropy given the previous byte is far below 8 bits
    t = tokens.astype(np.int64)
    pairs = np.bincount(t[:-1] * 256 + t[1:], minlength=256 * 256).reshape(256, 256).astype(float)
    p_joint = pairs / pairs.sum()
    p_prev = p_joint.sum(1, keepdims=True)
    nz = p_joint > 0
    bigram_bits = -(p_joint[nz] * np.log2((p_joint / np.where(p_prev > 0, p_prev, 1))[nz])).sum()
    assert bigram_bits < 3.5
    assert 0.3 < floor < 1.0 and math.isclose(floor, synthetic_entropy_floor(2_000_000, 11))
    _check_synthetic_lines(bytes(tokens[:200_000]).decode("ascii").split("\n")[:-1])


def _check_synthetic_lines(lines):
    """Every line kind obeys its rule: the structure a model can learn."""
    seen = set()
    for line in lines:
        kind, _, rest = line.partition(" ")
        if kind == "sum":
            for fact in rest.split():
                a, b, c = map(int, fact.replace("+", " ").replace("=", " ").split())
                assert a + b == c, line
        elif kind == "count":
            nums = list(map(int, rest.split()))
            assert nums == list(range(nums[0], nums[0] + len(nums))) and 4 <= len(nums) <= 8, line
        elif kind == "copy":
            left, right = rest.split("|")
            assert left == right and 3 <= len(left) <= 6, line
        elif kind == "recall":
            pairs, query = rest.split(" ")
            table = dict(p.split("=") for p in pairs.split(","))
            key, value = query.split("?")
            assert len(table) == 3 and table[key] == value, line
        else:  # a sentence: the verb (and the pronoun) agree with the subject's number
            kind = "sentence"
            words = line.rstrip(".").split()
            noun = words[2] if words[1] in corpus._ADJECTIVES else words[1]
            verb = words[words.index(noun) + 1]
            plural = noun.endswith("s")
            assert verb.endswith("s") != plural, line
            if " and " in line:
                assert words[words.index("and") + 1] == ("they" if plural else "it"), line
        seen.add(kind)
    assert seen == {"sum", "count", "copy", "recall", "sentence"}


def test_stdlib_corpus_is_real_python_source():
    stream = stdlib_corpus()
    assert stream.vocab_size == 256 and 1_000_000 < len(stream.tokens) <= corpus.STDLIB_MAX_BYTES
    head = bytes(stream.tokens[:200_000])
    assert b"def " in head and b"import " in head and head.count(b"\0") > 5  # files end with NUL
    files = corpus.stdlib_files()
    assert not any("site-packages" in p.parts for p in files)
    train, valid, vocab = build_data(DataConfig(source="stdlib"), 64, 2, 0, 1)
    assert vocab == 256 and train.next()[0].shape == (2, 64)
