"""What a run tells its user: phase timers, energy (GPU only), TensorBoard, the console line, `train.py --help`."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import sys
import time
import typing

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.training_utils import REPO, train_in_process
from tpframe.observe.logger import LoggingConfig, MetricsLogger, format_metrics
from tpframe.observe.timers import PHASES, PhaseTimers, TimedBatches
from tpframe.training.config import Config

PHASE_KEYS = [f"{p}_ms" for p in PHASES]
DATA_DELAY_S = 0.02  # added to every train micro-batch read, to see it charged to "data"


def _observed_run(run_dir: str):
    """A TP=2 run of 3 steps with slow data, a checkpoint at step 2 and TensorBoard; then the same command
    again (a finished run relaunched). Returns rank 0's console output of both launches."""
    from tpframe.data import loader

    next_batch = loader.BatchIterator.next

    def slow_next(self):
        if self.split == "train":
            time.sleep(DATA_DELAY_S)
        return next_batch(self)

    loader.BatchIterator.next = slow_next
    overrides = [
        "parallel.tp=2",
        "train.steps=3",
        "logging.interval=2",
        "logging.tensorboard=true",
        "checkpoint.interval=2",
        "checkpoint.save_at_end=true",
        "checkpoint.auto_resume=true",
        f"train.run_dir={run_dir}",
    ]
    outputs = []
    for _ in range(2):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            train_in_process(overrides)
        outputs.append(out.getvalue())
    return outputs


@pytest.mark.slow
def test_jsonl_phase_times_tensorboard_console_and_relaunch_on_cpu(tmp_path):
    first, again = run_distributed(_observed_run, 2, str(tmp_path))[0]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]  # the first step always, then every interval, and the last
    for r in train:
        assert all(r[k] >= 0 for k in PHASE_KEYS), r
        assert "energy_j" not in r and "energy_j_per_token" not in r  # absent on CPU, not zero
        assert "tflops" not in r and "mfu" not in r  # meaningless on CPU
        phases = sum(r[k] for k in PHASE_KEYS)
        assert 0.5 * r["step_ms"] <= phases <= r["step_ms"] + 1.0, r  # the phases are the step, minus logging
        assert r["data_ms"] >= 2 * DATA_DELAY_S * 1e3 * 0.95, r  # 2 micro-batches, each read delayed
    assert train[1]["ckpt_ms"] > max(1.0, 5 * train[0]["ckpt_ms"]), train  # step 2 saved a checkpoint

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = [f for f in sorted((tmp_path / "tensorboard").iterdir())]
    acc = EventAccumulator(str(events[0]))
    acc.Reload()
    logged = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert logged == [(r["step"], pytest.approx(r["loss"])) for r in train]
    assert "train/fwd_bwd_ms" in acc.Tags()["scalars"]

    lines = [line for line in first.splitlines() if line.startswith("step ")]
    assert len(lines) == 3 and "TFLOP/s" not in first and "MFU" not in first and "nan" not in first
    assert all(" tok/s | step " in line and " ms | mem " in line and line.endswith(" GiB") for line in lines), lines
    assert "nan" not in again and "done at step" not in again
    assert "this run is already at its last step (step 3, train.steps=3): nothing to train" in again


def test_console_puts_a_unit_on_every_number():
    line = format_metrics(
        {
            "loss": 2.5,
            "tokens_per_s": 51234.0,
            "step_ms": 412.3,
            "tflops": 120.0,
            "mfu": 0.121,
            "energy_j": 412.0,
            "energy_j_per_token": 0.00812,
            "mem_gib": 10.5,
            "data_ms": 3.0,
            "eval_s": 1.5,
            "aux_loss": 0.01,
        }
    )
    assert line == (
        "loss 2.5000 | 51.23k tok/s | step 412 ms | 120.0 TFLOP/s | MFU 12.1% | 412 J/step | 8.12 mJ/tok | "
        "mem 10.50 GiB | eval 1.5 s | aux_loss 0.01"
    )  # phase times go to the files only


def test_phase_timers_charge_each_phase_on_cpu():
    class Batches:
        def next(self):
            time.sleep(0.02)
            return "batch"

        position = 7

    timers = PhaseTimers(torch.device("cpu"))
    batches = TimedBatches(Batches(), timers)
    start = time.perf_counter()
    for _ in range(2):
        timers.begin()
        assert batches.next() == "batch" and batches.position == 7  # the wrapped iterator shows through
        time.sleep(0.01)
        timers.mark("fwd_bwd")
        timers.mark("grad_sync")
        time.sleep(0.03)
        timers.mark("optim")
        timers.mark("ckpt")
        time.sleep(0.05)  # between steps (logging): charged to no phase
    wall_ms = (time.perf_counter() - start) * 1e3
    ms = timers.window()
    assert ms["data_ms"] >= 20 and ms["fwd_bwd_ms"] >= 10 and ms["optim_ms"] >= 30, ms
    assert 2 * sum(ms.values()) <= wall_ms - 2 * 50 + 1, (ms, wall_ms)  # the sleeps between steps are in no phase
    assert timers.window() == {}  # a new window
    off = PhaseTimers(torch.device("cpu"), "none")
    off.begin()
    off.mark("optim")
    assert off.window() == {}


def test_energy_is_absent_on_cpu_and_per_step_and_token_from_the_counter():
    from types import SimpleNamespace

    from tpframe.observe.energy import EnergyMeter, sum_over_ranks
    from tpframe.training.trainer import Trainer

    assert EnergyMeter.open(torch.device("cpu")) is None
    assert sum_over_ranks(None, torch.device("cpu")) is None
    readings = iter([1_000, 41_000, 50_000, 52_000, 52_000, 60_000])  # NVML's counter, mJ
    meter = EnergyMeter(lambda: next(readings))  # opened: 1,000
    trainer = SimpleNamespace(energy=meter, parallel=SimpleNamespace(device=torch.device("cpu")), tokens_per_step=4096)
    # 41,000: 40 J over 10 steps in 2 s
    assert Trainer._energy(trainer, 10, 2.0) == {"energy_j": 4.0, "energy_j_per_token": 4.0 / 4096}
    meter.reset()  # 50,000: evaluation's energy is not a step's
    assert Trainer._energy(trainer, 2, 0.5) == {}  # 52,000: 2 J in 0.5 s, shorter than MIN_WINDOW_S: held back
    assert Trainer._energy(trainer, 1, 0.1) == {}  # 52,000: the counter did not move in 0.1 s (it would read 0 J)
    # 60,000: 8 J more; the three windows (1.1 s, 10 J, 4 steps) are reported together
    assert Trainer._energy(trainer, 1, 0.5) == {"energy_j": 2.5, "energy_j_per_token": 2.5 / 4096}
    assert Trainer._energy(SimpleNamespace(energy=None, parallel=trainer.parallel), 2, 5.0) == {}


def test_tensorboard_missing_warns_once_and_logging_goes_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    log = MetricsLogger(LoggingConfig(tensorboard=True), tmp_path, True, total_steps=10, config={})
    log.log_train(1, {"loss": 1.0})
    log.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tensorboard package is not installed" in err[0]


def test_help_lists_every_config_key_with_its_default_and_comment(capsys):
    sys.path.insert(0, REPO)
    import train

    with pytest.raises(SystemExit) as e:
        train.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    sections = typing.get_type_hints(Config)
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(sections[section.name]):
            key = f"{section.name}.{f.name}"
            line = next((line for line in text.splitlines() if line.split()[:1] == [key]), None)
            assert line is not None, f"{key} is missing from train.py --help"
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            yaml = "null" if default is None else str(default).lower() if isinstance(default, bool) else str(default)
            yaml = "[" + ",".join(map(str, default)) + "]" if isinstance(default, list) else yaml
            assert line.split()[1] == yaml, (key, line)
            assert ": " in line, f"{key} has no comment in its dataclass: add `# what it does` to its line"
    assert "parallel.tp                        1" in text and "train.run_dir" in text


# -- GPU: run by the lead on the device -------------------------------------------------------------


def _gpu_run(run_dir: str, timers: str):
    # ~0.1-0.2 s per step in fp32: every 10-step window spans many updates of NVML's energy counter
    return train_in_process(
        [
            "parallel.tp=2",
            "train.steps=30",
            "logging.interval=10",
            f"logging.timers={timers}",
            "model.hidden=1024",
            "model.layers=8",
            "model.heads=16",
            "model.max_seq_len=512",
            "train.seq_len=512",
            "train.micro_batch_size=16",
            "train.global_batch_size=32",
            "data.synthetic_tokens=200000",
            "checkpoint.interval=20",
            f"train.run_dir={run_dir}/{timers}",
        ]
    )


@pytest.mark.gpu(count=2)
def test_energy_per_step_and_token_and_event_timers_on_gpu(tmp_path):
    """NVML energy summed over both ranks' GPUs and CUDA-event (and synced) phase times in the JSONL, TP=2."""
    pytest.importorskip("pynvml", reason="energy needs NVML's Python bindings: pip install nvidia-ml-py")
    for timers in ("auto", "sync"):
        run_distributed(_gpu_run, 2, str(tmp_path), timers, backend="nccl", timeout=300)
        records = [json.loads(x) for x in (tmp_path / timers / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in records if r["kind"] == "train"]
        assert [r["step"] for r in train] == [1, 10, 20, 30]
        tokens_per_step = 32 * 512
        for r in train[1:]:  # the first step's window is one warm-up step
            assert r["energy_j"] > 0 and r["energy_j_per_token"] == pytest.approx(r["energy_j"] / tokens_per_step)
            watts = r["energy_j"] / (r["step_ms"] / 1e3) / 2
            assert 10 < watts < 2000, r  # per GPU: a board's power
            assert "tflops" in r
            phases = sum(r[k] for k in PHASE_KEYS)
            assert 0.7 * r["step_ms"] <= phases <= 1.05 * r["step_ms"] + 0.5, (timers, r)
        assert train[2]["ckpt_ms"] > train[1]["ckpt_ms"], train  # step 20 saved a checkpoint
