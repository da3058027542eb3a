"""logging.straggler_ratio: each rank's forward+backward time is compared over the ranks doing the same work, and a
slow one is named."""

import json
import os

import pytest

from tests.dist_utils import run_distributed
from tests.test_ops_faults import _main
from tests.training_utils import REPO, TINY, merge_overrides

ARGS = merge_overrides(
    ["--config", os.path.join(REPO, "configs/tiny_cpu.yaml")],
    TINY,
    ["train.steps=4", "train.micro_batch_size=2", "parallel.tp=1", "logging.interval=2"],
)


def _slow_rank(args, slow: int):
    """rank `slow`'s model takes 0.1 s longer per micro-batch (its GPU, say, is slower)."""
    import time

    import torch.distributed as dist

    from tpframe.models.gpt import GPT

    if dist.get_rank() == slow:
        forward = GPT.forward

        def slowed(self, *a, **k):
            time.sleep(0.1)
            return forward(self, *a, **k)

        GPT.forward = slowed
    return _main(args)


def _records(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]


def test_a_slow_data_parallel_rank_is_named(tmp_path):
    (code, err, out), _ = run_distributed(_slow_rank, 2, [*ARGS, f"train.run_dir={tmp_path}"], 1)
    assert code == 0, err[-2000:]
    lines = [x for x in (out + err).splitlines() if x.startswith("straggler:")]
    # logged at steps 1, 2 and 4; the first logged step of a launch is warm-up and names no one
    assert len(lines) == 2 and all(x.startswith("straggler: rank 1 spent") for x in lines), out[-2000:]
    assert "the median" in lines[0] and "of the 2 ranks" in lines[0]
    records = _records(tmp_path)
    assert records and all(
        r["slowest_rank"] == 1 and type(r["slowest_rank"]) is int and r["fwd_bwd_max_ms"] > 200 for r in records
    ), records


def test_under_pipeline_parallelism_each_stage_is_compared_with_its_own_replicas(tmp_path):
    """PP=2 x DP=2 (stage 0: ranks 0, 1; stage 1: ranks 2, 3), rank 3 slow: its pipeline (ranks 1 and 3) waits for
    it in every micro-batch, so the line names one of the two, against its own stage's median."""
    (code, err, out), *_ = run_distributed(_slow_rank, 4, [*ARGS, "parallel.pp=2", f"train.run_dir={tmp_path}"], 3)
    assert code == 0, err[-2000:]
    lines = [x for x in (out + err).splitlines() if x.startswith("straggler:")]
    assert lines and all(x.split()[2] in ("1", "3") and "of its pipeline stage's 2 ranks" in x for x in lines), lines
    assert _records(tmp_path)[-1]["slowest_rank"] in (1, 3)


@pytest.mark.parametrize("value", ["0.5", "-1"])
def test_a_ratio_below_one_is_refused(tmp_path, value):
    (code, err, _), _ = run_distributed(
        _main, 2, [*ARGS, f"logging.straggler_ratio={value}", f"train.run_dir={tmp_path}"]
    )
    assert code == 2 and "must be 0 (off) or at least 1" in err, err[-2000:]
