"""Long runs on a scheduler: train.time_limit_minutes (the first step past the limit is saved and training stops,
exit 0, and the same command resumes it with the uninterrupted run's losses) and train.gc_interval (Python's
collector on a schedule shared by every rank)."""

import json
import os

import pytest

from tests.dist_utils import run_distributed
from tests.test_ops_faults import _main
from tests.training_utils import REPO, TINY, merge_overrides

ARGS = merge_overrides(
    ["--config", os.path.join(REPO, "configs/tiny_cpu.yaml")],
    TINY,
    ["train.steps=5", "train.micro_batch_size=2", "parallel.tp=1", "checkpoint.auto_resume=true"],
)


def _losses(run_dir):
    """step -> loss of the run's final metrics.jsonl (a resumed run continues the file)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("kind") == "train":
            out[r["step"]] = r["loss"]
    return out


def test_a_run_past_its_time_limit_saves_stops_and_resumes_where_it_stopped(tmp_path):
    straight = run_distributed(_main, 2, [*ARGS, f"train.run_dir={tmp_path}/a"])[0]
    assert straight[0] == 0, straight[1][-2000:]
    # a limit every step exceeds: step 1 is saved, the run stops
    (code, err, out), _ = run_distributed(
        _main, 2, [*ARGS, "train.time_limit_minutes=1e-6", f"train.run_dir={tmp_path}/b"]
    )
    assert code == 0, err[-2000:]
    assert "time limit: after 1e-06 minutes the step is saved" in out + err  # said at start-up
    assert "train.time_limit_minutes=1e-06 reached" in out + err and "saving step 1 and stopping" in out + err
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").glob("step_*")) == ["step_00000001"]
    (code, err, out), _ = run_distributed(
        _main, 2, [*ARGS, f"train.run_dir={tmp_path}/b"]
    )  # the same command, no limit
    assert code == 0 and "resumed at step 1" in out + err, err[-2000:]
    assert "learning-rate schedule changed" not in out + err  # the same schedule
    a, b = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert sorted(b) == sorted(a) == [1, 2, 3, 4, 5]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-6), (step, a, b)
    # relaunched for 7 steps (from its step-1 checkpoint): the resume says how the schedule moved
    (code, err, out), _ = run_distributed(_main, 2, [*ARGS, "train.steps=7", f"train.run_dir={tmp_path}/b"])
    assert code == 0 and "resumed at step 1" in out + err, err[-2000:]
    assert "the learning-rate schedule changed since the checkpoint (train.steps 5 -> 7): step 2 runs at lr " in out


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.time_limit_minutes=0", "must be a positive number of minutes"),
        ("train.time_limit_minutes=-5", "must be a positive number of minutes"),
        ("train.gc_interval=-1", "train.gc_interval=-1 must be a number of steps >= 0"),
    ],
)
def test_bad_limits_are_refused(tmp_path, override, message):
    (code, err, _), _ = run_distributed(_main, 2, [*ARGS, override, f"train.run_dir={tmp_path}"])
    assert code == 2 and message in err, err[-2000:]


def _gc_calls(root: str):
    """In a rank: (gc.collect's generations, gc.isenabled() at each step, gc.isenabled() after) for gc_interval=2
    over 5 steps, then the same for gc_interval=0 over 2 steps."""
    import gc

    from tests.training_utils import train_in_process
    from tpframe.training import trainer as trainer_module

    out = []
    for interval, steps in ((2, 5), (0, 2)):
        calls, seen = [], []
        real_collect, original = gc.collect, trainer_module.Trainer.train_step
        trainer_module.gc.collect = lambda generation=2: calls.append(generation) or real_collect(generation)

        def train_step(self):
            seen.append(gc.isenabled())
            return original(self)

        trainer_module.Trainer.train_step = train_step
        try:
            train_in_process(
                [
                    "parallel.tp=1",
                    f"train.steps={steps}",
                    f"train.gc_interval={interval}",
                    f"train.run_dir={root}/{interval}",
                ]
            )
        finally:
            trainer_module.gc.collect, trainer_module.Trainer.train_step = real_collect, original
        out.append((calls, seen, gc.isenabled()))
    return out


def test_the_garbage_collector_runs_on_schedule_during_training_and_is_restored(tmp_path):
    """train.gc_interval=2 over 5 steps: automatic collection off inside the loop, a full collection at the start and
    the young generations after steps 2 and 4 (every rank at the same step); the collector as it was afterwards.
    gc_interval=0 leaves Python's collector alone."""
    ((on, off),) = run_distributed(_gc_calls, 1, str(tmp_path))
    assert on == ([2, 1, 1], [False] * 5, True), on
    assert off == ([], [True, True], True), off
