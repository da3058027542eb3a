"""data.eod_mask_loss: no loss after an end-of-document token, and the loss a mean over the global batch's tokens
that carry one, the same on every layout (the absolute value against plain PyTorch:
tests/test_reference_training.py)."""

import math

import pytest
import torch

from tests.dist_utils import each, run_distributed
from tests.training_utils import train_in_process
from tpframe.training.loss_mask import IGNORE_INDEX, StepBatches, mask_after_end_of_document


class _Batches:
    def __init__(self, items):
        self.items, self.position = list(items), 0

    def next(self):
        self.position += 1
        return self.items[self.position - 1]


def test_labels_after_an_end_of_document_are_ignored_and_counted_out():
    ids = torch.tensor([[5, 0, 7, 8], [0, 0, 3, 4]])
    labels = torch.tensor([[0, 7, 8, 9], [0, 3, 4, 5]])
    assert mask_after_end_of_document(ids, labels, 0).tolist() == [[0, -100, 8, 9], [-100, -100, 4, 5]]
    source = _Batches([(ids, labels), (ids[:1], labels[:1])])
    step = StepBatches(source, 2, 0)
    assert source.position == 2 and step.valid_tokens == 5 + 3 and step.position == 2  # read up front; attrs pass
    assert torch.equal(step.next()[1], mask_after_end_of_document(ids, labels, 0))
    step.next()
    with pytest.raises(RuntimeError, match="more than the step's 2 micro-batches"):
        step.next()
    assert IGNORE_INDEX == -100


def _losses(overrides):
    # optim.eps=1e-5: early q/k gradients are tiny, and AdamW's default 1e-8 turns their last-bit differences
    # between layouts into 1e-4 weight differences by step 10 (4e-5 in the last eval loss on an AMD EPYC): a
    # machine-dependent amplifier that has nothing to do with which tokens carry a loss
    history = train_in_process(
        [
            "parallel.tp=1",
            "data.eod_mask_loss=true",
            "model.eod_id=10",
            "train.eval_interval=5",
            "model.position=rotary",
            "optim.eps=1e-5",
            *overrides,
        ]
    )
    return [r["loss"] for r in history] + [r["eval_loss"] for r in history if "eval_loss" in r]


def _same(a, b, what):
    assert len(a) == len(b) == 12, (what, len(a), len(b))
    for i, (x, y) in enumerate(zip(a, b)):
        assert math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-7), f"{what}: value {i}: {x!r} vs {y!r}"


def test_every_layout_averages_over_the_same_tokens(tmp_path):
    """One micro-batch of 8 per step against: 4 of 2 (accumulation), DP=2 (ddp and zero1), TP=2 + SP, PP=2, CP=2;
    each micro-batch holds a different count of tokens that carry a loss. The runs of one world size share its
    processes."""
    one = ["train.micro_batch_size=8", "train.eval_steps=2"]  # evaluation: 16 held-out samples in every layout
    doc = "model.attention_mask=document"  # CP=2's case: the same mask with packed documents on both sides
    ref, plain, accum, ref_docs = run_distributed(
        each,
        1,
        _losses,
        [
            [*one, f"train.run_dir={tmp_path}/ref"],
            [*one, "data.eod_mask_loss=false", f"train.run_dir={tmp_path}/plain"],
            ["train.micro_batch_size=2", "train.eval_steps=8", f"train.run_dir={tmp_path}/accum"],
            [*one, doc, f"train.run_dir={tmp_path}/refdoc"],
        ],
    )[0]
    assert abs(plain[0] - ref[0]) > 1e-4, "the mask must change the loss"
    _same(accum, ref, "4 micro-batches of 2")
    layouts = (
        ("DP=2, 2 micro-batches of 2 each", ["train.micro_batch_size=2", "train.eval_steps=4"]),
        ("DP=2 zero1", ["train.micro_batch_size=4", "train.eval_steps=2", "parallel.dp_strategy=zero1"]),
        ("TP=2 + SP", [*one, "parallel.tp=2", "parallel.sequence_parallel=true"]),
        ("PP=2, 2 micro-batches", ["train.micro_batch_size=4", "train.eval_steps=4", "parallel.pp=2"]),
        ("CP=2 with document attention", [*one, "parallel.cp=2", doc]),
    )
    runs = [[*extra, f"train.run_dir={tmp_path}/{i}"] for i, (_, extra) in enumerate(layouts)]
    got = run_distributed(each, 2, _losses, runs, timeout=300)[0]
    for (name, extra), losses in zip(layouts, got):
        _same(losses, ref_docs if doc in extra else ref, name)
