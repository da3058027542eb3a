"""train.compare_replicas_every: the copies of each weight are compared over the ranks that hold them, and a copy
that drifted stops training (exit 3) naming the weight and the ranks, before that step's checkpoint."""

import os

import pytest
import torch

from tests.dist_utils import each, run_distributed
from tests.test_ops_faults import _main
from tests.training_utils import REPO, TINY, merge_overrides
from tpframe.training.replica_weights import FAULT_FLIP_ENV, weight_hash

ARGS = merge_overrides(
    ["--config", os.path.join(REPO, "configs/tiny_cpu.yaml")], TINY, ["train.steps=6", "train.micro_batch_size=2"]
)


# -- the hash ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_hash_sees_every_flipped_bit_and_every_swap_and_nothing_else(dtype):
    g = torch.Generator().manual_seed(0)
    t = torch.randn(5_000_000, generator=g).to(dtype)  # more bytes than one hashing pass (two passes for fp32)
    h = weight_hash(t)
    assert torch.equal(h, weight_hash(t.clone()))
    assert torch.equal(h, weight_hash(t.view(1000, 5000).t().contiguous().t()))  # layout: the values' order counts
    ints = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for index in (0, 1234, t.numel() - 1):  # first pass, middle, last pass
        for bit in (0, 7, 14):
            flipped = t.clone()
            flipped.view(ints)[index] ^= 1 << bit
            assert not torch.equal(weight_hash(flipped), h), (index, bit)
    swapped = t.clone()
    swapped[[10, 11]] = swapped[[11, 10]]
    assert swapped[10] != t[10] and not torch.equal(weight_hash(swapped), h)


# -- in training ------------------------------------------------------------------------------------
def test_equal_copies_pass_and_change_nothing_at_tp2_x_dp2_zero1(tmp_path):
    """TP=2 x DP=2, zero1: compared every 2 steps, the same losses as without."""
    args = [
        *ARGS,
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "parallel.dp_strategy=zero1",
        "train.global_batch_size=8",
    ]
    with_check, without = run_distributed(
        each,
        4,
        _main,
        [
            [*args, "train.compare_replicas_every=2", f"train.run_dir={tmp_path}/on"],
            [*args, f"train.run_dir={tmp_path}/off"],
        ],
    )[0]
    assert without[0] == 0, without[1][-2000:]
    code, err, out = with_check
    assert code == 0, err[-2000:]
    assert "every 2 steps the copies of each weight are compared" in out + err
    assert "over data-parallel (2 copies)" in out + err and "over tensor-parallel (2 copies)" in out + err

    def losses(folder):
        import json

        return [
            json.loads(line)["loss"]
            for line in (folder / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line and '"eval' not in line
        ]

    assert losses(tmp_path / "on") == losses(tmp_path / "off") and len(losses(tmp_path / "on")) == 6


def test_a_flipped_bit_on_one_dp_rank_stops_training_before_that_steps_checkpoint(tmp_path):
    args = [
        *ARGS,
        "parallel.tp=1",
        "train.compare_replicas_every=2",
        "checkpoint.interval=2",
        f"train.run_dir={tmp_path}",
    ]
    results = run_distributed(_main, 2, args, env={FAULT_FLIP_ENV: "4:1"})
    for code, err, _ in results:
        assert code == 3, err[-2000:]
    err = results[0][1]
    assert "step 4: copies of the weights are no longer identical: data-parallel rank 1's copy of" in err
    assert "differs from rank 0's" in err and "step_00000002" in err  # the last healthy checkpoint, named
    saved = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert saved == ["step_00000002"], saved  # step 4's state (with the drifted copy) was never written


def test_a_tp_replicated_weight_that_drifted_is_found_over_tp(tmp_path):
    """TP=2 alone: the norms' and row-parallel biases' copies on the two TP ranks."""
    args = [
        *ARGS,
        "parallel.tp=2",
        "train.global_batch_size=2",
        "train.compare_replicas_every=1",
        f"train.run_dir={tmp_path}",
    ]
    results = run_distributed(_main, 2, args, env={FAULT_FLIP_ENV: "3:1"})
    assert [r[0] for r in results] == [3, 3], results[0][1][-2000:]
    assert "step 3: copies of the weights are no longer identical: tensor-parallel rank 1's copy of" in results[0][1]


@pytest.mark.parametrize(
    "override, env, needle",
    [
        (["parallel.dp_strategy=fsdp", "train.compare_replicas_every=5"], {}, "fsdp keeps one shard per rank"),
        (["train.compare_replicas_every=-1"], {}, "train.compare_replicas_every=-1 must be a number of steps >= 0"),
        (["train.compare_replicas_every=2"], {FAULT_FLIP_ENV: "x"}, f"{FAULT_FLIP_ENV}='x': expected <step>:<rank>"),
    ],
)
def test_refused_in_one_line(tmp_path, override, env, needle):
    (code, err, _), _ = run_distributed(
        _main, 2, [*ARGS, "parallel.tp=1", *override, f"train.run_dir={tmp_path}"], env=env
    )
    assert code == 2 and needle in err, err[-2000:]
    assert len([line for line in err.splitlines() if line.startswith("tpframe:")]) == 1


def test_the_tied_embedding_of_the_first_and_last_pipeline_stage_is_compared(tmp_path):
    """PP=2: the input embedding (first stage) and the output head (last stage) are one weight held twice."""
    args = [
        *ARGS,
        "parallel.tp=1",
        "parallel.pp=2",
        "train.global_batch_size=4",
        "train.compare_replicas_every=2",
        f"train.run_dir={tmp_path}",
    ]
    results = run_distributed(_main, 2, args, env={FAULT_FLIP_ENV: "2:1"})
    assert [r[0] for r in results] == [3, 3], results[0][1][-2000:]
    assert "first/last pipeline stage rank 1's copy of" in results[0][1]


# -- on GPUs -------------------------------------------------------------------------------------------
@pytest.mark.gpu(count=1)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_hash_is_the_same_on_the_gpu_as_on_the_cpu(dtype):
    t = torch.randn(9_000_000, generator=torch.Generator().manual_seed(1)).to(dtype)  # several passes
    assert torch.equal(weight_hash(t.cuda()).cpu(), weight_hash(t))


@pytest.mark.gpu(count=2)
def test_nccl_dp2_bf16_compares_and_stops_on_a_flipped_bit(tmp_path):
    """DP=2 over NCCL in bf16: equal copies pass at steps 2 and 4, a bit flipped on rank 1 stops both at step 6."""
    args = [
        *ARGS,
        "parallel.tp=1",
        "train.dtype=bfloat16",
        "train.steps=8",
        "train.compare_replicas_every=2",
        f"train.run_dir={tmp_path}",
    ]
    results = run_distributed(_main, 2, args, env={FAULT_FLIP_ENV: "6:1"}, backend="nccl")
    assert [r[0] for r in results] == [3, 3], results[0][1][-2000:]
    assert "step 6: copies of the weights are no longer identical: data-parallel rank 1's copy of" in results[0][1]
