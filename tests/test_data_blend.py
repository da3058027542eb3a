"""Blends of several token files (data.path as a list): shares, per-file orders, DP slicing and exact resume."""

import json
import math

import numpy as np
import pytest
import torch

from tests.dist_utils import run_distributed
from tests.training_utils import train_in_process
from tpframe.data.corpus import TokenStream
from tpframe.data.loader import BatchIterator, build_data
from tpframe.data.tokenizer import write_token_file
from tpframe.errors import ConfigError
from tpframe.training.config import DataConfig

SEQ = 16
# Two streams told apart by their token values (A below 128, B from 128), each window by its first token.
A = TokenStream(np.arange(7 * SEQ + 1, dtype=np.int64), 256, "A")  # 7 windows
B = TokenStream(128 + np.arange(5 * SEQ + 1, dtype=np.int64), 256, "B")  # 5 windows


def _blend(mb=2, rank=0, dp=1, weights=(3.0, 1.0), streams=(A, B), **kw):
    return BatchIterator(list(streams), SEQ, mb, rank, dp, seed=5, weights=list(weights), **kw)


def _first_tokens(it, steps):
    return [int(t) for _ in range(steps) for t in it.next()[0][:, 0]]


def test_every_prefix_keeps_the_weights_and_each_file_keeps_its_own_order():
    firsts = _first_tokens(_blend(), 30)  # 60 samples: 45 of A (6+ epochs), 15 of B (3 epochs)
    from_a = [t < 128 for t in firsts]
    for n in range(1, len(firsts) + 1):  # Megatron's rule: within one sample of the shares at every prefix
        assert abs(sum(from_a[:n]) - 0.75 * n) < 1 and abs(n - sum(from_a[:n]) - 0.25 * n) < 1, n
    # a file's samples are its own seeded order, epoch by epoch, whatever the blend does around them
    for stream, index, mine in ((A, 0, [t for t in firsts if t < 128]), (B, 1, [t for t in firsts if t >= 128])):
        alone = _blend().sources[index]  # the file's windows in its own order, read alone
        assert mine == [int(t) for t in alone.chunk(np.arange(len(mine)))[:, 0]]
        windows = (len(stream.tokens) - 1) // SEQ
        assert (
            sorted(mine[:windows]) == sorted(mine[windows : 2 * windows])
            and mine[:windows] != mine[windows : 2 * windows]
        )
    # the files are shuffled independently of each other and of an unblended run's order
    blended_a = [int(t) for t in _blend().sources[0].chunk(np.arange(7))[:, 0]]
    assert blended_a != _first_tokens(BatchIterator(A, SEQ, 1, seed=5), 7)


@pytest.mark.parametrize("dp_new, mb_new", [(1, 4), (4, 1)])
def test_dp_ranks_split_the_blend_and_a_state_resumes_at_other_dp_sizes(dp_new, mb_new):
    ranks = [_blend(2, r, 2) for r in range(2)]
    whole = _blend(4)
    for _ in range(5):
        assert torch.equal(torch.cat([it.next()[0] for it in ranks]), whole.next()[0])
    state = json.loads(json.dumps(ranks[1].state_dict()))  # JSON-able, the same on every rank
    assert state == ranks[0].state_dict() and state["samples_consumed"] == 20 and sum(state["taken"]) == 20
    expected = [torch.cat([it.next()[0] for it in ranks]) for _ in range(4)]
    resumed = [_blend(mb_new, r, dp_new) for r in range(dp_new)]
    for it in resumed:
        it.load_state_dict(state)
    for want in expected:
        assert torch.equal(torch.cat([it.next()[0] for it in resumed]), want)
    resumed[0].reset()
    assert torch.equal(resumed[0].next()[0], _blend(mb_new, 0, dp_new).next()[0])


def test_a_blend_state_loads_only_into_the_same_blend():
    it = _blend()
    it.next()
    state = it.state_dict()
    for other, words in (
        (_blend(weights=(1.0, 1.0)), "data.weights"),
        (_blend(streams=(B, A)), "same data.path files"),
        (BatchIterator(A, SEQ, 2, seed=5), "is for a blend of token files .* this run reads one token"),
        (_blend(split="valid"), "split"),
    ):
        with pytest.raises(ValueError, match=words):
            other.load_state_dict(state)
    with pytest.raises(ValueError, match="is for one token stream but this run reads a blend"):
        it.load_state_dict(BatchIterator(A, SEQ, 2, seed=5).state_dict())
    with pytest.raises(ValueError, match="sum to samples_consumed"):
        it.load_state_dict({**state, "taken": [state["samples_consumed"], 1]})
    with pytest.raises(ValueError, match="one positive weight per stream"):
        _blend(weights=(1.0, 0.0))


def _token_files(tmp_path, texts):
    paths = []
    for i, text in enumerate(texts):
        (tmp_path / f"{i}.txt").write_text(text)
        write_token_file([tmp_path / f"{i}.txt"], tmp_path / f"{i}.bin")
        paths.append(str(tmp_path / f"{i}.bin"))
    return paths


def test_token_files_blend_by_size_with_blended_held_out_tails(tmp_path):
    a, b = _token_files(tmp_path, ["a" * 3000, "b" * 1000])
    train, valid, vocab = build_data(DataConfig(source="tokens", path=[a, b], valid_fraction=0.1), SEQ, 4, 0, 1)
    assert vocab == 256 and len(train.streams) == len(valid.streams) == 2
    assert [round(w, 3) for w in train.weights] == [0.75, 0.25]  # no data.weights: in proportion to the tokens
    assert [len(s.tokens) for s in valid.streams] == [300, 100]  # each file's tail is held out
    letters = [chr(int(x[0, 0])) for x in (train.next()[0] for _ in range(4))]
    assert letters.count("a") + letters.count("b") == 4 and "blend of 75.0% of" in train.describe()
    weighted = build_data(DataConfig(source="tokens", path=[a, b], weights=[1, 3]), SEQ, 4, 0, 1)[0]
    assert weighted.weights == [0.25, 0.75]
    short = _token_files(tmp_path / "..", ["c" * 10])[0]
    with pytest.raises(ConfigError, match=r"prepare more text for .*0.bin"):
        build_data(DataConfig(source="tokens", path=[a, short]), SEQ, 4, 0, 1)
    pytest.importorskip("tokenizers")
    from tests.test_token_files import _tiny_hf_tokenizer

    _tiny_hf_tokenizer(tmp_path / "tok.json")
    (tmp_path / "w.txt").write_text("the quick brown fox " * 50)
    write_token_file([tmp_path / "w.txt"], tmp_path / "w.bin", tokenizer=str(tmp_path / "tok.json"))
    with pytest.raises(ConfigError, match=r"data.path\[1\]=.*w.bin.* was made with tokenizer .* same --tokenizer"):
        build_data(DataConfig(source="tokens", path=[a, str(tmp_path / "w.bin")]), SEQ, 4, 0, 1)


def _losses(overrides):
    return [(r["step"], r["loss"]) for r in train_in_process(overrides)]


def test_a_blended_run_resumes_at_another_dp_size_and_continues_the_same_losses(tmp_path):
    """DP=2 over a blend of two token files, checkpointed at step 3; resumed at DP=1 with micro-batch 8."""
    files = _token_files(tmp_path, ["the cat sat on the mat. " * 300, "def f(x):\n    return x + 1\n" * 200])
    common = [
        "parallel.tp=1",
        "train.steps=6",
        "data.source=tokens",
        f"data.path=[{files[0]},{files[1]}]",
        "data.weights=[0.6,0.4]",
        "train.eval_interval=3",
        "train.eval_steps=2",
    ]
    straight = run_distributed(_losses, 2, [*common, "checkpoint.interval=3", f"train.run_dir={tmp_path}/a"])[0]
    step3 = tmp_path / "a" / "checkpoints" / "step_00000003"
    resumed = run_distributed(
        _losses, 1, [*common, "train.micro_batch_size=8", f"checkpoint.load={step3}", f"train.run_dir={tmp_path}/b"]
    )[0]
    assert [s for s, _ in resumed] == [4, 5, 6]
    for (step, loss), (_, want) in zip(resumed, straight[3:]):
        assert math.isclose(loss, want, rel_tol=1e-5), (step, loss, want)


def test_a_run_directory_of_a_blend_admits_the_same_blend_and_names_another(tmp_path):
    """The run-directory check compares a blend's list of paths (the later rank of a DP run sees rank 0's
    config.yaml already written), and names a different blend in one line."""
    import yaml

    from tpframe.run.preflight import check_run_dir
    from tpframe.training.config import load_config

    files = _token_files(tmp_path, ["abc " * 200, "xyz " * 200])
    cfg = load_config(None, ["data.source=tokens", f"data.path=[{files[0]},{files[1]}]", f"train.run_dir={tmp_path}/r"])
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    check_run_dir(cfg)  # the same blend: admitted
    other = load_config(
        None, ["data.source=tokens", f"data.path=[{files[1]},{files[0]}]", f"train.run_dir={tmp_path}/r"]
    )
    with pytest.raises(ConfigError, match=r"holds another run \(data.path is \[.*\] there but \[.*\] now\)"):
        check_run_dir(other)
