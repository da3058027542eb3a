"""Faults: non-finite steps (re-run, skip, abort), healthy checkpoints, the memory estimate, a stopped rank,
and preemption through the launcher."""

import contextlib
import io
import json
import math
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.dist_utils import each, run_distributed
from tests.training_utils import REPO, TINY, merge_overrides, train_in_process

STEPS = 8
# 2 ranks at DP=2, 2 micro-batches of 2 per rank and step
COMMON = ["parallel.tp=1", "train.micro_batch_size=2", f"train.steps={STEPS}"]
ARGS = merge_overrides(["--config", os.path.join(REPO, "configs/tiny_cpu.yaml")], TINY, COMMON)


def _losses(overrides):
    return [r["loss"] for r in train_in_process([*COMMON, *overrides])]


def _main(args):
    """train.main in this (already distributed) process: (exit code, stderr, stdout)."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import train

    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = train.main(merge_overrides(args))  # a test's own settings replace ARGS's
    return code, err.getvalue(), out.getvalue()


def _poison_after_step_4(args):
    """rank 1 turns its weights into NaN right after step 4's update (before step 4's checkpoint)."""
    from tpframe.training.trainer import Trainer

    original = Trainer.train_step

    def train_step(self):
        out = original(self)
        if self.step == 4 and self.parallel.rank == 1:
            with torch.no_grad():
                for p in self.model.parameters():
                    p.fill_(float("nan"))
        return out

    Trainer.train_step = train_step
    return _main(args)


def _train_losses(run_dir: Path) -> list[float]:
    from tpframe.observe.logger import read_metrics

    return [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The losses of the fault-free run every test below is compared with."""
    return run_distributed(_losses, 2, [f"train.run_dir={tmp_path_factory.mktemp('clean')}"])[0]


# -- non-finite steps -------------------------------------------------------------------------------------


def test_a_transient_nan_is_rerun_and_training_continues_bit_for_bit(tmp_path, clean):
    env = {"TPFRAME_FAULT_NAN": "3:once:1", "TPFRAME_FAULT_RANK": "1"}
    (code, err, out), _ = run_distributed(_main, 2, [*ARGS, f"train.run_dir={tmp_path}"], env=env)
    assert code == 0 and err == "", err
    assert "step 3: non-finite loss nan and gradient norm nan; first in micro-batch 1 of DP rank 1; re-running" in out
    assert "step 3: the re-run is finite" in out and "a transient fault" in out
    assert _train_losses(tmp_path) == clean, "the re-run's update is the one a fault-free step makes"


def test_divergence_skips_then_stops_and_the_healthy_checkpoint_survives_and_loads(tmp_path, clean):
    env = {"TPFRAME_FAULT_NAN": "5:always"}
    args = [
        *ARGS,
        f"train.run_dir={tmp_path}",
        "train.max_skipped_steps=2",
        "checkpoint.interval=2",
        "checkpoint.keep_last=1",
    ]
    (code, err, out), (code1, err1, _) = run_distributed(_main, 2, args, env=env)
    root = tmp_path / "checkpoints"
    assert code == code1 == 3 and err1 == "", (err, err1)
    assert "step 5: the re-run is non-finite too" in out and "update skipped (2 in a row" in out
    line = err.strip()
    assert len(err.strip().splitlines()) == 1 and line.startswith("tpframe: training stopped: step 7:"), err
    assert "3 non-finite steps in a row exceed train.max_skipped_steps=2" in line and f"{root}/step_00000004" in line
    # nothing is saved inside the streak (step 6): keep_last=1 keeps step 4, the last healthy one, as `latest`
    assert "step 6: inside a streak of 2 skipped non-finite steps: no checkpoint is written" in out
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000004"]
    assert json.loads((root / "step_00000004/meta.json").read_text())["healthy"] is True
    resumed = run_distributed(
        _losses, 2, [f"checkpoint.load={root}/step_00000004", f"train.run_dir={tmp_path}/resumed"]
    )[0]
    assert resumed == clean[4:], "the healthy checkpoint resumes the fault-free run"


def test_a_non_finite_state_is_never_published(tmp_path):
    args = [*ARGS, f"train.run_dir={tmp_path}", "train.max_skipped_steps=0", "checkpoint.interval=2"]
    (code, err, out), _ = run_distributed(_poison_after_step_4, 2, args)
    root = tmp_path / "checkpoints"
    assert code == 3, err
    assert (
        "step 4: the model or optimizer state holds non-finite values: no checkpoint is written; "
        f"the last one is {root}/step_00000002"
    ) in out
    assert "train.max_skipped_steps=0: training stopped" in err and f"{root}/step_00000002" in err
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002"]


def test_weights_blown_up_then_skipped_to_the_last_step_exit_3_and_latest_stays_healthy(tmp_path, monkeypatch):
    """The learning rate blows the weights up in step 5 (finite, ~1e30), steps 6-10 are skipped as non-finite and
    train.steps=10 is reached (checkpoints every 2 steps, keep_last=2): no checkpoint is written inside the streak, so
    `latest` stays step 4 with its sane weights, and the run exits 3 naming it (it used to exit 0, `latest` the 1e30
    weights of step 10)."""
    from tpframe.checkpoint.export import read_model_tensors
    from tpframe.training import trainer

    lr_at = trainer.lr_at
    monkeypatch.setattr(trainer, "lr_at", lambda step, *a: 1e30 if step == 4 else lr_at(step, *a))  # step 5's update
    _one_process_world(monkeypatch)
    args = ["train.steps=10", "checkpoint.interval=2", "checkpoint.keep_last=2", "checkpoint.save_at_end=true"]
    code, err, out = _main(merge_overrides(ARGS, [f"train.run_dir={tmp_path}", *args]))
    root, lines = tmp_path / "checkpoints", [line for line in err.splitlines() if line.strip()]
    assert code == 3 and len(lines) == 1, err
    assert "update skipped (5 in a row" in out and "step 8: inside a streak of 3 skipped non-finite steps" in out
    assert lines[0] == (
        "tpframe: training stopped: training ended at step 10 inside a streak of 5 skipped non-finite steps (steps "
        "6-10): its weights are not trusted and no checkpoint was written during the streak; the last healthy "
        f"checkpoint is {root}/step_00000004 (checkpoint.load={root}/step_00000004)"
    ), lines[0]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002", "step_00000004"]
    assert (root / "latest").read_text() == "step_00000004"
    assert max(float(t.abs().max()) for t in read_model_tensors(root / "step_00000004").values()) < 100


def _fail_one_save(root, phase):
    """train.main on 2 ranks where one rank's part of step 4's checkpoint fails as a full disk would: DCP's shard
    write on rank 1 (blocking or in the background), the RNG file's torch.save on rank 0, or rank 0's publishing
    (meta.json). Returns (exit code, stderr, stdout)."""
    import errno

    import torch.distributed as dist
    from torch.distributed.checkpoint import filesystem

    from tpframe.checkpoint import checkpointer as ckpt

    full = OSError(errno.ENOSPC, "No space left on device")
    rank, original = dist.get_rank(), {}

    def failing(name, owner, when):
        original[name] = getattr(owner, name)

        def call(*args, **kwargs):
            if when(*args):
                raise full
            return original[name](*args, **kwargs)

        setattr(owner, name, call)

    in_step_4 = lambda *a: any("step_00000004" in str(x) for x in a)  # noqa: E731
    if phase in ("dcp", "dcp-async"):
        failing("write_data", filesystem.FileSystemWriter, lambda self, *a: rank == 1 and in_step_4(self.path))
    elif phase == "rng":
        failing("save", ckpt.torch, lambda obj, path, *a: rank == 0 and in_step_4(path))
    else:
        failing("write_atomic", ckpt, lambda path, text: rank == 0 and in_step_4(path) and path.name == "meta.json")
    args = merge_overrides(
        ARGS,
        [
            f"train.run_dir={root}/{phase}",
            "checkpoint.interval=2",
            f"checkpoint.async_save={str(phase == 'dcp-async').lower()}",
        ],
    )
    try:
        return _main(args)
    finally:
        for name, fn in original.items():
            setattr(
                filesystem.FileSystemWriter if name == "write_data" else ckpt.torch if name == "save" else ckpt,
                name,
                fn,
            )


@pytest.mark.parametrize(
    "phase, where",
    [
        ("dcp", "rank 1: OSError"),
        ("dcp-async", "rank 1: OSError"),
        ("rng", "rank 0: OSError"),
        ("publish", "rank 0: OSError"),
    ],
)
def test_a_checkpoint_that_cannot_be_written_stops_every_rank_with_one_line_and_keeps_the_last(tmp_path, phase, where):
    """A full disk in any phase of a save, on any one rank: no rank waits for another in a collective, the partial
    checkpoint is removed, the previous one stays `latest`, and every rank stops with exit code 5 and one line."""
    results = run_distributed(_fail_one_save, 2, str(tmp_path), phase)
    root = tmp_path / phase / "checkpoints"
    for rank, (code, err, _) in enumerate(results):
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 5 and "Traceback" not in err, (rank, err)
        assert len(lines) == (rank == 0), (rank, err)  # rank 0 prints the one line
    line = results[0][1].strip()
    assert line.startswith(
        f"tpframe: checkpoint not saved: checkpoint step 4 could not be written to {str(root)!r} "
        f"({where}: [Errno 28] No space left on device"
    ), line
    assert line.endswith(
        "the last one, step_00000002, is intact: free space (or set checkpoint.dir) and relaunch to resume from it"
    ) and re.search(r"; [\d.]+ [KMG]?i?B free there\); the last one", line), line
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002"], "the partial step 4 is gone"
    assert (root / "latest").read_text() == "step_00000002"


def _one_process_world(monkeypatch) -> None:
    """train.main in this process as `python train.py` runs: no launcher env. What its single_process_env sets
    (RANK, MASTER_PORT, ...) is undone after the test: setenv records each key, so the later tests' children do
    not inherit this run's rendezvous port (delenv alone records nothing for an absent key)."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)


def test_a_full_disk_at_the_runs_config_is_one_line_and_exit_5(tmp_path, monkeypatch):
    """The run's first write after the pre-flight (config.yaml) on a full disk: one line naming the file, exit 5."""
    import errno
    import pathlib

    real = pathlib.Path.write_text

    def write_text(self, *args, **kwargs):
        if self.name.startswith(".config.yaml."):
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", write_text)
    _one_process_world(monkeypatch)
    code, err, _ = _main(merge_overrides(ARGS, [f"train.run_dir={tmp_path}/run"]))
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 5 and len(lines) == 1, err
    assert (
        lines[0].startswith(f"tpframe: cannot write {tmp_path}/run/.config.yaml.")
        and "(No space left on device): free space or make it writable, then relaunch" in lines[0]
    ), lines[0]


CUDA_OOM = (
    "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.20 GiB is "
    "free. Including non-PyTorch memory, this process has 77.9 GiB memory in use. Of the allocated memory 70 GiB is "
    "allocated by PyTorch\nSee documentation for Memory Management"
)
CPU_OOM = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate "
    "1024000000000 bytes. Error code 12 (Cannot allocate memory)"
)


@pytest.mark.parametrize(
    "error,said",
    [
        (
            lambda: torch.OutOfMemoryError(CUDA_OOM),
            "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.20 "
            "GiB is free",
        ),
        (
            lambda: RuntimeError(CPU_OOM),
            "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1024000000000 bytes. Error code 12 "
            "(Cannot allocate memory)",
        ),
    ],
    ids=["cuda", "cpu-allocator"],
)
def test_out_of_memory_mid_run_is_one_line_with_what_to_change_and_exit_6(tmp_path, monkeypatch, error, said):
    """A layout the estimate let start runs out of memory in step 2 (a GPU's, or the host's: the CPU allocator's
    RuntimeError): one line (where, how much, what to change), exit code 6, not a traceback (the allocator's text
    cut at its first sentences)."""
    from tpframe.models.gpt import GPT

    original, calls = GPT.forward, []

    def forward(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 5:  # step 2's first micro-batch (4 per step here)
            raise error()
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GPT, "forward", forward)
    _one_process_world(monkeypatch)
    code, err, _ = _main(merge_overrides(ARGS, [f"train.run_dir={tmp_path}/run", "checkpoint.interval=1"]))
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 6 and len(lines) == 1, err
    assert lines[0] == (
        f"tpframe: out of memory: rank 0 ran out of cpu memory in step 2 (forward_backward): {said}; to fit, try a "
        "smaller train.micro_batch_size (the global batch stays: more accumulation) or model, a larger parallel.tp "
        "with parallel.sequence_parallel=true, parallel.activation_checkpointing=selective or full"
    ), lines[0]
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "step_00000001"  # step 1's save stays


class _Data:
    def __init__(self):
        self.position = 0

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


class _Comm:
    size, rank, device = 1, 0, torch.device("cpu")


def _guard(**train):
    from tpframe.training.config import TrainConfig
    from tpframe.training.health import StepGuard

    data, log = _Data(), []
    rng = type("RNG", (), {"state_dict": lambda self: {}, "load_state_dict": lambda self, s: None})()
    guard = StepGuard(TrainConfig(**train), nn.Linear(1, 1), data=data, rng=rng, dp_comm=_Comm(), log=log.append)
    return guard, data, log


def _attempts(data, results):
    """An attempt function consuming a batch (data.position += 1) and returning the next (loss, norm)."""
    results, seen = list(results), []

    def attempt():
        seen.append(data.position)
        data.position += 1
        return results.pop(0)

    return attempt, seen


def test_step_guard_decides_transient_skip_and_abort():
    from tpframe.training.health import TrainingAborted

    guard, data, log = _guard(max_skipped_steps=1)
    attempt, seen = _attempts(data, [(math.nan, 1.0), (2.0, 1.0)])
    assert guard.run_step(1, attempt) == (2.0, 1.0, True) and seen == [0, 0], "the re-run reads the same batch"
    assert guard.transient_faults == 1 and guard.healthy_since(0)
    attempt, _ = _attempts(data, [(1.0, math.inf), (1.0, math.inf)] * 2)
    assert guard.run_step(2, attempt)[2] is False and guard.consecutive_skips == 1 and not guard.healthy_since(1)
    with pytest.raises(TrainingAborted, match="2 non-finite steps in a row exceed train.max_skipped_steps=1"):
        guard.run_step(3, attempt)
    guard, data, _ = _guard(on_nonfinite="abort")
    attempt, _ = _attempts(data, [(math.nan, math.nan)] * 2)
    with pytest.raises(TrainingAborted, match="train.on_nonfinite=abort"):
        guard.run_step(1, attempt)


def test_loss_spikes_are_flagged_by_robust_z_score():
    from tpframe.training.health import SpikeDetector, robust_z

    assert robust_z(5.0, [1.0, 2.0, 3.0])[0] == pytest.approx((5.0 - 2.0) / (1.4826 * 1.0))
    detector = SpikeDetector(z=6.0, window=50, min_points=20)
    losses = [2.0 + 0.01 * math.sin(i) for i in range(30)]
    assert [detector.observe(x) for x in losses] == [None] * 30
    z, median = detector.observe(2.5)
    assert z > 6 and median == pytest.approx(2.0, abs=0.01)
    assert detector.observe(1.9) is None, "a drop is not a spike"


def test_prune_never_deletes_the_last_healthy_checkpoint(tmp_path):
    from tpframe.checkpoint.files import last_healthy, prune

    for step, healthy in ((2, True), (4, True), (6, False), (8, False)):
        (tmp_path / f"step_{step:08d}").mkdir()
        (tmp_path / f"step_{step:08d}/meta.json").write_text(json.dumps({"healthy": healthy}))
    assert last_healthy(tmp_path).name == "step_00000004"
    prune(tmp_path, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004", "step_00000008"]


def test_prune_deletes_only_checkpoints(tmp_path):
    """checkpoint.keep_last deletes folders with a meta.json only: a user's step_* folder is not a checkpoint."""
    from tpframe.checkpoint.files import prune

    (tmp_path / "step_00000001").mkdir()
    (tmp_path / "step_00000001/data.txt").write_text("my data")
    for step in (2, 3):
        (tmp_path / f"step_{step:08d}").mkdir()
        (tmp_path / f"step_{step:08d}/meta.json").write_text(json.dumps({"healthy": True}))
    prune(tmp_path, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001", "step_00000003"]
    assert (tmp_path / "step_00000001/data.txt").read_text() == "my data"


def test_all_finite_sees_nan_and_inf_in_any_piece():
    from tpframe.checkpoint.finite import all_finite
    from tpframe.parallel.sharding import LogicalChunks

    big = torch.full((4, 4), 1e30)  # huge but finite: a max-abs reduction does not overflow
    state = {"model/w": LogicalChunks((8, 4), [((0, 0), big)]), "optim/step": torch.tensor([3.0])}
    assert all_finite(state)
    for bad in (float("nan"), float("inf")):
        poisoned = big.clone()
        poisoned[2, 1] = bad
        assert not all_finite({**state, "model/v": LogicalChunks((4, 4), [((0, 0), poisoned)])})


# -- the memory estimate ------------------------------------------------------------------------------------


def _cfg(*overrides):
    from tpframe.training.config import load_config

    return load_config(os.path.join(REPO, "configs/tiny_cpu.yaml"), list(overrides))


def test_memory_estimate_bytes_per_parameter_by_strategy():
    from tpframe.run.memory import estimate

    def static(world, *o):
        e = estimate(_cfg(*o), world, params=10**6, device_type="cuda")
        return (e.params + e.grads + e.optimizer) / 1e6

    assert static(2, "parallel.tp=2") == 16.0  # fp32: weights 4 + grads 4 + moments 8
    assert static(2, "parallel.tp=2", "train.dtype=bfloat16") == 18.0  # + fp32 masters, bf16 weights
    assert static(8, "parallel.tp=2", "train.dtype=bfloat16", "parallel.dp_strategy=zero1") == 9.0  # 2 + 4 + 12/4
    moe = (
        "parallel.tp=1",
        "train.dtype=bfloat16",
        "parallel.dp_strategy=zero1",
        "parallel.ep=2",
        "model.moe_experts=4",
    )
    e = estimate(_cfg(*moe), 4, params=10**6, expert_params=6 * 10**5, device_type="cuda")
    assert e.optimizer == 12 * (4e5 / 4 + 6e5 / 2)  # the dense state over dp=4, the experts' over their 2 replicas
    e = estimate(_cfg(*moe[:2], "parallel.dp_strategy=fsdp", *moe[3:]), 4, params=10**6, expert_params=6 * 10**5)
    assert e.optimizer == 8 * (4e5 / 4 + 6e5 / 2)  # fsdp: the moments of the shards, sharded the same way
    deep = ("parallel.tp=2", "model.layers=24")  # fsdp also holds a gathered layer or two, in full
    assert static(8, *deep, "parallel.dp_strategy=fsdp") < 0.5 * static(8, *deep, "parallel.dp_strategy=zero1")


def test_memory_estimate_of_a_lora_run_gives_the_frozen_base_no_gradients_or_optimizer_state(tmp_path):
    """The pre-flight's meta build of a LoRA model (it once failed on the adapters' draw, so the memory check and
    the target check were silently skipped) and its estimate: grads and AdamW state for the adapters alone."""
    from tpframe.run.memory import estimate
    from tpframe.run.preflight import _sizes, dry_build, estimate_for

    lora = ["optim.lora_rank=4", f"checkpoint.init_from={tmp_path}/base.safetensors", "train.dtype=bfloat16"]
    for strategy in ("ddp", "zero1", "fsdp"):
        cfg = _cfg("parallel.tp=1", f"parallel.dp_strategy={strategy}", *lora)
        model = dry_build(cfg)
        params, _, _, trained = _sizes(model)
        adapters = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
        assert 0 < trained == adapters < params / 10
        e = estimate_for(cfg, 2, model, device_type="cuda")
        full = estimate(cfg, 2, params=params, device_type="cuda")  # every parameter trained
        if strategy != "fsdp":
            assert e.grads == 4 * trained and e.optimizer == 12 * trained / (2 if strategy == "zero1" else 1)
        assert e.params == full.params and e.grads < full.grads / 10 and e.optimizer < full.optimizer / 10


def test_a_pipeline_rank_is_sized_by_the_stages_it_holds_not_the_whole_model(monkeypatch):
    """parallel.pp > 1: the pre-flight once charged every pipeline rank the whole model, so a model that fits only
    when split (a 70B shape on 32 GPUs of 80 GiB at tp 8 x pp 4) was refused. The fullest rank's stages are built
    instead, and the estimate before the build (a deep model, from 1 and 2 layers) counts the rank's layers."""
    from tpframe.run import preflight

    deep = ("parallel.tp=1", "model.layers=24", "model.tie_embeddings=false", "train.dtype=bfloat16")
    whole = preflight._sizes(preflight.dry_build(_cfg(*deep)))
    layer = whole[0] - preflight._sizes(preflight.dry_build(_cfg(*deep[:1], "model.layers=23", *deep[2:])))[0]
    for pp, v, rank_layers in ((2, 1, 12), (4, 1, 6), (4, 2, 6), (8, 1, 3)):
        cfg = _cfg(*deep, f"parallel.pp={pp}", f"parallel.virtual_stages={v}", "train.global_batch_size=16")
        assert preflight._rank_layers(cfg) == rank_layers
        params = preflight.rank_sizes(cfg, preflight.dry_build(cfg))[0]
        assert rank_layers * layer < params < rank_layers * layer + (whole[0] - 24 * layer)  # its blocks + emb or head
        seen = []
        monkeypatch.setattr(preflight, "_check_sizes", lambda cfg, world, sizes, **_: seen.append(sizes))
        preflight.check_memory_before_build(cfg, pp, device_type="cpu", local_rank=0, local_world=pp)
        assert rank_layers * layer < seen[0][0] <= rank_layers * layer + (whole[0] - 24 * layer)
    layouts = _cfg(*deep, "parallel.pp=4", "parallel.layers_per_stage=[3,7,7,7]", "train.global_batch_size=16")
    assert preflight._rank_layers(layouts) == 7


def test_a_pipeline_schedule_s_forwards_in_flight_scale_the_activations():
    """One micro-batch's activations of the whole model is what a 1F1B rank holds (pp micro-batches of L/pp layers);
    AFAB holds every micro-batch, interleaving Megatron's 1 + (pp-1)/(pp*v): counted from the schedules' orders."""
    from tpframe.run.memory import estimate, pipeline_factor

    def cfg(schedule, v=1):
        pipe = [f"parallel.pp_schedule={schedule}", f"parallel.virtual_stages={v}", "model.layers=8"]
        return _cfg("parallel.tp=1", "parallel.pp=2", "train.micro_batch_size=2", "train.global_batch_size=16", *pipe)

    assert pipeline_factor(_cfg("parallel.tp=1"), 4) == 1.0
    assert pipeline_factor(cfg("1f1b"), 2) == pipeline_factor(cfg("zb_h1"), 2) == 1.0  # 8 micro-batches, 2 in flight
    assert pipeline_factor(cfg("afab"), 2) == 8 / 2 and pipeline_factor(cfg("afab"), 4) == 4 / 2  # dp 2: 4 each
    assert pipeline_factor(cfg("interleaved_1f1b", v=2), 2) == 1 + (2 - 1) / (2 * 2)
    afab, one = (estimate(cfg(s), 2, params=10**6).activations for s in ("afab", "1f1b"))
    assert afab == 4 * one


def test_memory_estimate_activations_shrink_with_tp_sp_and_recompute():
    from tpframe.run.memory import activation_bytes

    def act(*o):
        return activation_bytes(_cfg("train.micro_batch_size=8", "model.vocab_size=256", *o), "cuda")

    assert act("parallel.tp=2") < act("parallel.tp=1")
    assert act("parallel.tp=2", "parallel.sequence_parallel=true") < act("parallel.tp=2")
    assert act("parallel.tp=2", "parallel.activation_checkpointing=true") < act("parallel.tp=2")
    assert act("parallel.tp=1", "train.dtype=bfloat16") < act("parallel.tp=1")
    # Korthikanti et al.: s*b*h*(10 + 24/t) per layer at 2 bytes without scores (CUDA), plus embedding and loss
    s, b, h, L, V = 128, 8, 128, 2, 256  # configs/tiny_cpu.yaml
    layers, loss, embedding = s * b * h * (10 + 24 / 2) * L, s * b * V / 2 * 2, s * b * h * 2  # bf16 logits alone
    assert act("parallel.tp=2", "train.dtype=bfloat16") == layers + loss + embedding
    # selective drops the norm outputs (2 x 2 sbh, replicated) and GELU's output (8 sbh, TP-split) of each layer
    selective = s * b * h * (6 + 16 / 2) * L
    assert act("parallel.tp=2", "train.dtype=bfloat16", "parallel.activation_checkpointing=selective") == (
        selective + loss + embedding
    )
    # full recompute of one of the two layers: its input (2 sbh), the other layer, and the larger of one layer being
    # recomputed and the head's logits with their input gradient (backward frees the one before it makes the other)
    full = ("parallel.tp=2", "train.dtype=bfloat16", "parallel.activation_checkpointing=full")
    layer, head = s * b * h * (10 + 24 / 2), loss + s * b * h * 2
    assert head < layer and act(*full, "parallel.recompute_layers=1") == s * b * h * 2 + 2 * layer + embedding
    wide = s * b * 8192 / 2 * 2 + s * b * h * 2  # a vocabulary of 8192: the head is larger than a layer
    cfg = _cfg("train.micro_batch_size=8", "model.vocab_size=8192", *full)
    assert wide > layer and activation_bytes(cfg, "cuda") == 2 * s * b * h * 2 + wide + embedding
    assert (
        act("parallel.tp=2", "parallel.activation_checkpointing=true")
        < act("parallel.tp=2", "parallel.activation_checkpointing=selective")
        < act("parallel.tp=2")
    )
    # attention's part follows its own width: grouped-query keys/values (K = 1 head of 32) and Qwen3's wide heads
    # (A = K = 4 heads of 64 = 2h): 4*(A + K)/h in place of 8; a SwiGLU MLP of ffn keeps 2*(2 ffn + ffn)/h
    llama = (
        "parallel.tp=2",
        "train.dtype=bfloat16",
        "model.norm=rmsnorm",
        "model.position=rotary",
        "model.activation=swiglu",
        "model.ffn_hidden=384",
    )
    swiglu = 2 * (2 * 384 + 384) / h
    for options, attention in (
        ((), 8.0),
        (("model.kv_heads=1",), 4 * (h + 32) / h),
        (("model.head_dim=64",), 4 * (2 * h + 2 * h) / h),
    ):
        want = s * b * h * (10 + (attention + swiglu) / 2) * L + loss + embedding
        assert act(*llama, *options) == want, options


# -- launcher drills: preemption and a stopped rank ---------------------------------------------------------


SCRIPT = merge_overrides(["train.py", "--config", "configs/tiny_cpu.yaml"], TINY, COMMON)


def _launch(args, env=None):
    """The README's launcher, 2 workers; --no-check: the parent's pre-flight is test_ops_inputs.py's business."""
    cmd = [sys.executable, "-m", "tpframe.launch", "--nproc-per-node=2", "--no-check", *merge_overrides(args)]
    full = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TPFRAME_FAULT_NAN")}
    full.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    full["PYTHONPATH"] = os.pathsep.join(filter(None, (str(REPO), full.get("PYTHONPATH"))))  # scripts outside REPO
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full)


def _workers(launcher_pid: int) -> dict[int, int]:
    """local rank -> pid of the launcher's workers."""
    out = {}
    for task in Path(f"/proc/{launcher_pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = next((e.split(b"=", 1)[1] for e in env if e.startswith(b"LOCAL_RANK=")), None)
            if rank is not None:
                out[int(rank)] = int(pid)
    return out


def _read_until(proc, predicate, timeout=180):
    lines, deadline = [], time.monotonic() + timeout
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if predicate(lines[-1]):
            return lines
        assert time.monotonic() < deadline, "\n".join(lines[-30:])
    raise AssertionError("the launch ended early:\n" + "\n".join(lines[-30:]))


def _is_step(n):
    return lambda line: line.replace(" ", "").startswith(f"step{n}/")


def test_memory_estimate_counts_the_attention_copy_where_documents_run_the_varlen_kernel():
    """Where the varlen Flash kernel runs documents' attention (CUDA, bf16, no dropout, CP=1) its output is written
    token-major and the layer keeps the [s, b, h] copy the projection reads as well: 2 sbh/tp a layer. Measured: the
    Llama-3-8B LoRA run's peak on one H200 was 57.0 GiB, the estimate 55.0 before this term and 57.0 with it
    (benchmarks/RESULTS.md, "the document mask's attention copy")."""
    from tpframe.run.memory import activation_bytes

    s, b, h, L = 128, 8, 128, 2  # configs/tiny_cpu.yaml
    base = ["train.micro_batch_size=8", "model.eod_id=10"]

    def extra(*o, device="cuda", dtype="bfloat16"):
        o = (*o, f"train.dtype={dtype}")
        docs = activation_bytes(_cfg(*base, "model.attention_mask=document", *o), device)
        return docs - activation_bytes(_cfg(*base, *o), device)

    assert extra("parallel.tp=1") == L * s * b * h * 2
    assert extra("parallel.tp=2", "parallel.sequence_parallel=true") == L * s * b * h * 2 / 2
    assert extra("parallel.tp=1", device="cpu") == 0  # SDPA with a mask: its output is laid out [s, b, h]
    assert extra("parallel.tp=1", "model.attention_dropout=0.1") == 0  # dropout: SDPA too
    assert extra("parallel.tp=1", dtype="float32") == 0  # the kernel takes bf16 and fp16 only
    assert extra("parallel.tp=1", "parallel.cp=2") == 0  # CP's chunks: the projection reads the output in place


def test_sigterm_to_the_launcher_saves_exits_0_and_resumes_bit_for_bit(tmp_path):
    """The launch trains for 100,000 steps, so it is still running when the signal lands however late this test
    reads its output on a busy machine (an 8-step launch could finish first); after warmup its learning rate is
    constant, so its first steps, and the resumed run's, are those of an uninterrupted 24-step run."""
    steps, constant = 24, "optim.decay=constant"
    proc = _launch([*SCRIPT, constant, "train.steps=100000", f"train.run_dir={tmp_path}"])
    try:
        _read_until(proc, _is_step(2))
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0, rest
    assert rest.count("tpframe.launch: SIGTERM forwarded to the workers") == 1 and "Traceback" not in rest, rest
    saved = (tmp_path / "checkpoints" / "latest").read_text()
    step = int(saved.split("_")[1])
    assert 2 <= step < steps and f"preemption signal received: saving step {step} and stopping" in rest, rest
    common = [constant, f"train.steps={steps}"]
    load = [*common, f"checkpoint.load={tmp_path}/checkpoints", f"train.run_dir={tmp_path}/r"]
    # one world: the resumed run first (a fresh process, as a new job), then the uninterrupted one
    resumed, clean = run_distributed(each, 2, _losses, [load, [*common, f"train.run_dir={tmp_path}/clean"]])[0]
    assert resumed == clean[step:], "the resumed run continues the uninterrupted one to the bit"


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_workers_of_a_killed_launcher_save_stop_and_free_the_run_dir(tmp_path):
    """kill -9 of the launcher: its workers get SIGTERM (Linux's parent-death signal), save and stop, and the run's
    lock is free for the next launch, instead of orphans training on to the end."""
    from tpframe.run.run_lock import check_free

    proc, workers = _launch([*SCRIPT, "train.steps=100000", f"train.run_dir={tmp_path}"]), []
    try:
        _read_until(proc, _is_step(2))
        workers = list(_workers(proc.pid).values())
        proc.kill()
        deadline = time.monotonic() + 60
        while any(map(_alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(map(_alive, workers)), "the orphans stopped"
    finally:
        for pid in filter(_alive, workers):
            os.kill(pid, signal.SIGKILL)
    check_free(tmp_path)
    assert int((tmp_path / "checkpoints" / "latest").read_text().split("_")[1]) >= 2


@pytest.mark.slow
def test_a_second_launch_on_a_running_run_dir_is_refused_and_writes_nothing(tmp_path):
    """One training per run directory: while one trains, a second launch there (a job submitted twice) exits 2
    with the holder's pid, from the launcher's pre-flight, and leaves the first run's files as they were."""
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TPFRAME_FAULT_NAN")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    first = subprocess.Popen(
        [
            sys.executable,
            *merge_overrides(
                ["train.py", "--config", "configs/tiny_cpu.yaml"],
                TINY,
                ["parallel.tp=1", "train.steps=100000", f"train.run_dir={run_dir}"],
            ),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        _read_until(first, _is_step(2))
        before = {p.name: p.stat().st_size for p in run_dir.iterdir() if p.name != "metrics.jsonl"}
        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "tpframe.launch",
                "--nproc-per-node=2",
                *merge_overrides(SCRIPT, [f"train.run_dir={run_dir}"]),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert first.poll() is None, "the first run is still training"
        first.send_signal(signal.SIGTERM)
        rest = first.communicate(timeout=120)[0]
    finally:
        first.kill()
    lines = [line for line in second.stderr.splitlines() if line.strip()]
    assert second.returncode == 2 and len(lines) == 1, second.stderr
    assert (
        f"train.run_dir={str(run_dir)!r} is in use by another training (pid {first.pid} on " in lines[0]
        and "pick another train.run_dir" in lines[0]
    ), lines[0]
    assert first.returncode == 0 and "Traceback" not in rest, rest
    assert {p: s for p, s in before.items() if p != "checkpoints"} == {
        p.name: p.stat().st_size for p in run_dir.iterdir() if p.name in before and p.name != "checkpoints"
    }


def _stop_rank_1(
    proc, *, report_timeout: float, exit_timeout: float, after_step: int = 3
) -> tuple[list[str], float, str]:
    """Freeze rank 1 (SIGSTOP) of a launched run after `after_step`; return the output lines up to rank 0's
    `tpframe:` report, how long that took, and the rest of the output. The launcher kills the frozen rank itself once
    rank 0 has ended (no collective of its can complete)."""
    stopped = None
    try:
        _read_until(proc, _is_step(after_step))
        stopped = _workers(proc.pid)[1]
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.monotonic()
        lines = _read_until(proc, lambda line: line.startswith("tpframe:"), timeout=report_timeout)
        waited = time.monotonic() - t0
        rest = proc.communicate(timeout=exit_timeout)[0]
    finally:
        if stopped is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGKILL)
        proc.kill()
    return lines, waited, rest


# op, seq, group, sizes: a training step's (dp, world), or the checkpointer's signal check after every step
COLLECTIVE = r"in [a-z_]+ #\d+ on the (dp|world|checkpoint) group \[0, 1\] \((\w+\[[\d, ]*\](, )?)+\)"
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
LONG = os.environ.get("TPFRAME_LONG_DRILLS") == "1"  # the drills at production-like timeouts (30 s and more)


@pytest.mark.parametrize(
    "timeout_s, within",
    [(3, 7), pytest.param(30, 45, marks=pytest.mark.skipif(not LONG, reason="a 45 s drill: TPFRAME_LONG_DRILLS=1"))],
)
def test_a_stopped_rank_is_named_with_the_collective_it_never_completed_and_exit_4(tmp_path, timeout_s, within):
    """SIGSTOP rank 1: within `within` s rank 0 prints one line naming the collective it waits in (op, group,
    sequence number, sizes, from the flight recorder) and rank 1 (from the heartbeats), dumps its flight record in
    the run directory, exit 4; the last checkpoint stays complete and loadable."""
    from tpframe.checkpoint import resolve, verify

    # stopped after step 5, two steps from any checkpoint save (steps 4 and 8): the stop lands in a training step's
    # collective or the tiny signal check that ends each step, not in a save (test_a_rank_stopped_inside_a_checkpoint_
    # save_... covers that)
    args = [*SCRIPT, "train.steps=100000", "checkpoint.interval=4", f"comm.timeout_s={timeout_s}"]
    proc = _launch([*args, f"train.run_dir={tmp_path}"])
    lines, waited, rest = _stop_rank_1(proc, report_timeout=within + 30, exit_timeout=60, after_step=5)
    line = lines[-1]
    assert line.startswith("tpframe: a rank stopped responding: "), line  # frozen, not a mismatch of live ranks
    assert waited < within, f"rank 0 gave up after {waited:.1f} s"
    assert re.search(rf"rank 0 waited \d+ s at step \d+ {COLLECTIVE}", line), line
    assert re.search(r"(never entered it|stopped before completing it): rank 1 \(no heartbeat for \d+ s", line), line
    assert f"comm.timeout_s={timeout_s}" in line and proc.returncode == 4, (line, rest)
    assert "Traceback" not in rest and not any(x.startswith("tpframe:") for x in rest.splitlines()), rest
    assert f"; flight records in {tmp_path / 'comm_trace'};" in line, line
    record = pickle.loads((tmp_path / "comm_trace" / "rank_0").read_bytes())  # torch's analyser reads it
    seq = int(re.search(r" #(\d+) on", line).group(1))
    assert any(e["collective_seq_id"] == seq for e in record["entries"]), record["entries"][-3:]
    assert "[0, 1]" in {c["ranks"] for c in record["pg_config"].values()}, record["pg_config"]
    assert verify(resolve(tmp_path / "checkpoints"), "crc")["step"] >= 4  # nothing lost


STOP_IN_SAVE = """
import os, runpy, signal, sys
from tpframe.checkpoint import dcp_io
write = dcp_io.save
def save(state, path, group):  # rank 1 freezes as it reaches step 4's shard write; rank 0 goes into DCP's collectives
    if os.environ["RANK"] == "1" and path.name.startswith("step_00000004"):
        os.kill(os.getpid(), signal.SIGSTOP)
    return write(state, path, group)
dcp_io.save = save
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


@pytest.mark.slow
def test_a_rank_stopped_inside_a_checkpoint_save_is_named_with_the_save_s_collective(tmp_path):
    """The checkpointer's collectives run on gloo groups of its own (made after the heartbeat): a rank stopped in a
    save is named with the collective of the checkpoint group it never entered, not only with the phase; exit 4, and
    the previous checkpoint stays the latest, complete."""
    from tpframe.checkpoint import resolve, verify

    script = tmp_path / "stop_in_save.py"
    script.write_text(STOP_IN_SAVE)
    args = [str(script), *SCRIPT[1:], "train.steps=8", "checkpoint.interval=2", "comm.timeout_s=3"]
    proc = _launch([*args, f"train.run_dir={tmp_path}/run"])
    try:
        out = proc.communicate(timeout=120)[0]
    finally:
        for pid in _workers(proc.pid).values() if proc.poll() is None else ():
            os.kill(pid, signal.SIGKILL)
        proc.kill()
    lines = [x for x in out.splitlines() if x.startswith("tpframe: a ")]
    assert proc.returncode == 4 and len(lines) == 1, out
    group = r"in [a-z_]+ #\d+ on the checkpoint group \[0, 1\] \((\w+\[[\d, ]*\](, )?)+\)"
    assert re.search(rf"rank 0 waited \d+ s at step 4 {group}, during the checkpoint step", lines[0]), lines[0]
    assert lines[0].startswith("tpframe: a rank stopped responding: "), lines[0]
    assert re.search(r"(never entered it|stopped before completing it): rank 1 \(no heartbeat", lines[0]), lines[0]
    # the collective named is the one rank 0 is blocked in: its newest on that group, not an older completed one
    record = pickle.loads((tmp_path / "run" / "comm_trace" / "rank_0").read_bytes())
    name = next(k for k, c in record["pg_config"].items() if c["desc"] == "checkpoint")
    newest = max(e["collective_seq_id"] for e in record["entries"] if e["process_group"][0] == name)
    assert f" #{newest} on the checkpoint group" in lines[0], (newest, lines[0])
    assert verify(resolve(tmp_path / "run" / "checkpoints"), "crc")["step"] == 2  # step 4 never published


def _counters_by_group_name():
    import torch.distributed as dist

    from tpframe.parallel import flight

    for r in range(2):  # every rank names both groups, but makes a backend only for its own: ids and names part
        dist.new_group([r], backend="gloo")
    pair = dist.new_group([0, 1], backend="gloo")
    for _ in range(2):
        dist.all_reduce(torch.ones(2), group=pair)
    ids, deadline = {}, time.monotonic() + 5
    while (counts := flight.status(ids)).get(dist.distributed_c10d._get_process_group_name(pair), (0, 0))[1] < 2:
        assert time.monotonic() < deadline, counts  # the recorder marks completion a moment after the call returns
        time.sleep(0.05)
    return dist.distributed_c10d._get_process_group_name(pair), counts, ids


def test_the_recorder_s_counters_are_keyed_by_group_name_though_it_counts_by_backend_id():
    """The flight recorder keys its counters by a per-process backend id; a rank that is not in every group makes
    fewer backends than groups, so the id is not the group's name. The heartbeat publishes by name (the same on every
    rank): the counters of the pair group are found under its name, on both ranks."""
    for name, counts, ids in run_distributed(_counters_by_group_name, 2, env={"TORCH_FR_BUFFER_SIZE": "100"}):
        assert counts[name] == (2, 2), (name, counts, ids)
        assert name in ids.values() and ids.get(name) != name, ids  # the id differs from the name here


def test_the_stuck_collective_names_who_never_entered_who_did_not_complete_and_who_stopped():
    """find_stuck against counters as the heartbeats publish them: a live rank behind never entered it; a rank
    that entered and did not complete is named so; a rank silent since before this one entered is only stopped."""
    from tpframe.parallel.flight import find_stuck

    now = time.time_ns()
    entry = {
        "process_group": ("3", "mesh_dp"),
        "collective_seq_id": 12,
        "profiling_name": "gloo:all_reduce",
        "input_sizes": [[4, 8]],
        "input_dtypes": ["Float"],
        "time_created_ns": now - 10 * 10**9,  # waiting for 10 s
    }
    table = {"3": ("dp", [0, 1, 2, 3]), "0": ("world", [0, 1, 2, 3])}
    peers = {1: ({"3": (11, 11)}, 0.5), 2: ({"3": (12, 11)}, 0.5), 3: ({"3": (11, 11)}, 25.0)}
    stuck = find_stuck([entry], table, peers, rank=0)
    assert stuck.describe() == "all_reduce #12 on the dp group [0, 1, 2, 3] (Float[4, 8])"
    assert (stuck.never_entered, stuck.not_completed, stuck.stopped) == ([1], [2], [3])
    assert 9 < stuck.waited_s < 11
    other = {**entry, "process_group": ("9", "a group of no run's"), "time_created_ns": now - 20 * 10**9}
    everyone = {r: ({"3": (12, 11)}, 0.5) for r in (1, 2, 3)}
    assert find_stuck([other, entry], table, everyone, rank=0).not_completed == [1, 2, 3]
    assert find_stuck([other], table, peers, rank=0) is None


# -- GPU: the device's memory, and the NCCL flight recorder --------------------------------------------------


@pytest.mark.gpu
def test_memory_check_compares_with_the_cuda_device(monkeypatch):
    import train
    from tpframe.training.config import ConfigError

    monkeypatch.chdir(REPO)
    base = ["--config", "configs/gpt_125m.yaml", "train.steps=1", "parallel.tp=1"]
    with pytest.raises(ConfigError, match=r"this run needs about .* but cuda:0 \(.*\) has .* GiB"):
        train.prepare([*base, "model.hidden=16384", "model.heads=128"], world_size=1, rank=0)
    train.prepare([*base, "train.run_dir=/tmp/tpframe_gpu_memory_ok"], world_size=1, rank=0)  # 125M fits
    cfg = train.prepare(
        [
            *base,
            "model.hidden=16384",
            "model.heads=128",
            "train.check_memory=false",
            "train.run_dir=/tmp/tpframe_gpu_memory_skip",
        ],
        world_size=1,
        rank=0,
    )[0]
    assert cfg.train.check_memory is False


@pytest.mark.gpu
def test_a_real_cuda_out_of_memory_is_one_line_and_exit_6(tmp_path):
    """GPT-125M at micro-batch 512 (the logits alone 52 GB) with the estimate switched off: the allocator fails in
    step 1's forward; the launcher passes on one line and exit code 6."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TPFRAME_FAULT_NAN")}
    env.update(PYTHONUNBUFFERED="1")
    out = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--config",
            "configs/gpt_125m.yaml",
            "parallel.tp=1",
            "train.micro_batch_size=512",
            "train.global_batch_size=512",
            "train.steps=2",
            "train.check_memory=false",
            "train.compile=false",
            f"train.run_dir={tmp_path}/run",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 6 and len(lines) == 1, out.stderr[-3000:]
    assert (
        lines[0].startswith("tpframe: out of memory: rank 0 ran out of cuda memory in step 1 (")
        and "Tried to allocate" in lines[0]
        and "tpframe's peak so far" in lines[0]
        and "parallel.activation_checkpointing=selective or full" in lines[0]
    ), lines[0]


@pytest.mark.gpu(count=2)
def test_nccl_stopped_rank_is_reported_and_the_flight_recorder_dumped(tmp_path):
    timeout_s = 20
    proc = _launch(
        [*SCRIPT, "train.steps=100000", f"comm.timeout_s={timeout_s}", f"train.run_dir={tmp_path}"],
        env=NCCL_ENV,
    )
    lines, waited, _ = _stop_rank_1(proc, report_timeout=timeout_s + 60, exit_timeout=120)
    assert waited < timeout_s + 10 and "rank 1 (no heartbeat" in lines[-1] and proc.returncode == 4, (waited, lines)
    assert re.search(rf"rank 0 waited \d+ s at step \d+ {COLLECTIVE}", lines[-1]), lines[-1]
    assert (tmp_path / "comm_trace" / "rank_0").is_file(), lines[-1]


HUNG = """
import sys, time, torch
from tpframe.parallel import flight, initialize_parallel
from tpframe.parallel.heartbeat import Heartbeat, Progress
flight.configure(sys.argv[1])
state = initialize_parallel(timeout_s=4)
progress = Progress()
beat = Heartbeat.start(state, timeout_s=4, progress=progress)
torch.distributed.all_reduce(torch.ones(3, device=state.device), group=state.dp_group)  # #1: both enter
progress.mark(1, "loss")
if state.rank == 0:
    torch.distributed.all_reduce(torch.ones(5, 2, device=state.device), group=state.dp_group)  # #2: rank 1 never
time.sleep(7)  # rank 1: alive, beating, elsewhere (until the launcher stops it)
"""


def _never_entered(tmp_path, env=None):
    script = tmp_path / "hung.py"
    script.write_text(HUNG)
    proc = _launch([str(script), str(tmp_path)], env=env)
    out = proc.communicate(timeout=60)[0]
    lines = [x for x in out.splitlines() if x.startswith("tpframe:")]
    assert proc.returncode == 4 and len(lines) == 1, out
    head = "tpframe: a collective did not complete: rank 0 waited [34] s at step 1 in all_reduce #2 on the dp group"
    assert re.match(rf"{head} \[0, 1\] \(Float\[5, 2\]\), during the loss all-reduce; ", lines[0]), lines
    assert "; never entered it: rank 1 (alive, at step 1, loss, last entered #1 there);" in lines[0], lines
    assert (tmp_path / "comm_trace" / "rank_0").is_file()


@pytest.mark.slow
def test_a_collective_one_rank_never_enters_is_named_while_every_rank_is_alive(tmp_path):
    """A collective mismatch, all ranks alive (gloo): rank 0 waits in a collective rank 1 never calls. Before the
    group's own timeout, one line names the collective and rank 1 as alive and never entered; exit 4."""
    _never_entered(tmp_path)


@pytest.mark.gpu(count=2)
def test_nccl_a_collective_one_rank_never_enters_is_named_from_the_flight_recorder(tmp_path):
    """The same on NCCL: the collective is enqueued and never completes; NCCL's flight recorder gives it."""
    _never_entered(tmp_path, env=NCCL_ENV)
