"""The config's `profile` section (tpframe/observe/profiler.py): torch.profiler over chosen steps on chosen
ranks, without changing what trains. The bad values are in tests/test_ops_inputs.py; the CUDA parts (device
times, idle time, the memory snapshot) in tests/test_gpu_training.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.dist_utils import run_distributed
from tests.training_utils import train_in_process

LAYOUT = ["parallel.tp=2", "parallel.sequence_parallel=true", "train.steps=6"]


def _profiled_and_plain(run_dir: str) -> tuple[list[float], list[float]]:
    profiled = train_in_process(
        [
            *LAYOUT,
            f"train.run_dir={run_dir}/p",
            "profile.start_step=3",
            "profile.steps=2",
            "profile.ranks=[0, 1]",
            "profile.record_shapes=true",
        ]
    )
    plain = train_in_process([*LAYOUT, f"train.run_dir={run_dir}/q"])
    return [r["loss"] for r in profiled], [r["loss"] for r in plain]


def test_profile_writes_each_ranks_trace_and_table_and_trains_the_same(tmp_path):
    for profiled, plain in run_distributed(_profiled_and_plain, 2, str(tmp_path)):
        assert profiled == plain, "profiling must not change what trains"
    out = tmp_path / "p" / "profile"
    assert sorted(p.name for p in out.iterdir()) == [
        "steps3-4-rank0.json",
        "steps3-4-rank0.txt",
        "steps3-4-rank1.json",
        "steps3-4-rank1.txt",
    ]
    names = {e.get("name") for e in json.loads((out / "steps3-4-rank1.json").read_text())["traceEvents"]}
    assert {"tpframe step 3", "tpframe step 4"} <= names and "tpframe step 5" not in names
    assert "aten::mm" in names and "tpframe step 2" not in names  # the warm-up step is not recorded
    table = (out / "steps3-4-rank0.txt").read_text()
    assert "Input Shapes" in table and "tpframe step" not in table  # a row per op and shape; no step ranges
    assert not (tmp_path / "q" / "profile").exists()


def _two_launches(run_dir: str) -> list[str]:
    """A 4-step run profiling from step 4 (3 steps asked, 1 left), then its resume to step 6 asking for step 2."""
    import contextlib
    import io

    outputs = []
    for overrides in (
        ["train.steps=4", "profile.start_step=4", "profile.steps=3", "checkpoint.save_at_end=true"],
        ["train.steps=6", "profile.start_step=2", "checkpoint.auto_resume=true"],
    ):
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            train_in_process([f"train.run_dir={run_dir}", "parallel.tp=1", *overrides])
        outputs.append(text.getvalue())
    return outputs


def test_a_window_cut_short_by_the_last_step_or_missed_by_a_resume(tmp_path):
    first, resumed = run_distributed(_two_launches, 1, str(tmp_path))[0]
    assert "profile of step 4 on rank 0 written" in first
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["steps4-rank0.json", "steps4-rank0.txt"]
    assert "resumed at step 4" in resumed
    assert "profile.start_step=2 is before this launch's first step (5): nothing profiled" in resumed


def test_profile_is_off_by_default_and_only_on_its_ranks(tmp_path):
    import torch

    from tpframe.observe.profiler import ProfileConfig, StepProfiler

    kw = dict(device=torch.device("cpu"), run_dir=tmp_path, log=print)
    assert StepProfiler.open(ProfileConfig(), rank=0, **kw) is None
    assert StepProfiler.open(ProfileConfig(start_step=1, ranks=[1]), rank=0, **kw) is None
    assert StepProfiler.open(ProfileConfig(start_step=1, ranks=[1]), rank=1, **kw) is not None


@pytest.mark.parametrize("steps", [1, 3])
def test_the_window_records_exactly_its_steps(tmp_path, steps):
    import torch

    from tpframe.observe.profiler import ProfileConfig, StepProfiler

    lines = []
    prof = StepProfiler.open(
        ProfileConfig(start_step=2, steps=steps), rank=0, device=torch.device("cpu"), run_dir=tmp_path, log=lines.append
    )
    for step in range(1, 7):
        prof.before_step(step)
        torch.ones(4, 4) @ torch.ones(4, 4)
        prof.after_step(step)
    prof.close()
    names = {
        e.get("name") for e in json.loads(next(Path(tmp_path, "profile").glob("*.json")).read_text())["traceEvents"]
    }
    assert {n for n in names if n and n.startswith("tpframe step")} == {
        f"tpframe step {s}" for s in range(2, 2 + steps)
    }
    assert len(lines) == 1 and "written to" in lines[0]


def _profile_on_cuda(run_dir: str) -> None:
    train_in_process(
        [
            f"train.run_dir={run_dir}",
            "parallel.tp=1",
            "train.dtype=bfloat16",
            "train.steps=4",
            "profile.start_step=2",
            "profile.steps=2",
            "profile.memory=true",
        ]
    )


@pytest.mark.gpu(count=1)
def test_profile_on_cuda_has_kernel_times_the_idle_time_and_a_memory_snapshot(tmp_path):
    import pickle

    run_distributed(_profile_on_cuda, 1, str(tmp_path), backend="nccl")
    out = tmp_path / "profile"
    table = (out / "steps2-3-rank0.txt").read_text()
    assert "Self CUDA" in table and "GPU timeline of the steps" in table and "idle" in table
    kernels = [
        e for e in json.loads((out / "steps2-3-rank0.json").read_text())["traceEvents"] if e.get("cat") == "kernel"
    ]
    assert len(kernels) > 50, "the CUDA kernels of two steps are in the trace"
    snapshot = pickle.loads((out / "steps2-3-rank0-memory.pickle").read_bytes())
    assert snapshot["segments"] and any(t for t in snapshot.get("device_traces", [])), "allocations were recorded"
