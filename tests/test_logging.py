"""MetricsLogger: console line and progress, metrics.jsonl (append on resume), wandb via a fake module."""

import importlib.util
import io
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import yaml

from tpframe.observe import flops
from tpframe.observe import logger as tlog
from tpframe.observe.flops import peak_tflops
from tpframe.observe.logger import LoggingConfig, MetricsLogger, read_metrics

ROOT = Path(__file__).resolve().parents[1]
METRICS = {
    "loss": 2.31,
    "lr": 3e-4,
    "grad_norm": 0.8,
    "tokens_per_s": 51234.0,
    "tflops": 120.0,
    "mfu": 0.121,
    "mem_gib": 10.5,
}


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(tlog.time, "monotonic", fake)
    return fake


def test_console_line_has_every_metric_and_a_plain_progress_bar(tmp_path, capsys, clock):
    log = MetricsLogger(LoggingConfig(), tmp_path, True, total_steps=100, config={"train": {"steps": 100}})
    clock.now += 20.0
    log.log_train(10, {**METRICS, "aux_loss": 0.0123})
    log.log_eval(10, {"loss": 2.5})
    log.info("saved checkpoint")
    log.close()
    out = capsys.readouterr().out
    assert "\r" not in out and "\x1b" not in out  # not a TTY: plain lines only
    train, evl, info = out.splitlines()
    assert train == (
        "step  10/100 | loss 2.3100 | lr 3.00e-04 | grad 0.800 | 51.23k tok/s | 120.0 TFLOP/s | "
        "MFU 12.1% | mem 10.50 GiB | aux_loss 0.0123 | [##..................]  10% 2.00 s/step ETA 3m00s"
    )
    assert evl == "eval step 10 | loss 2.5000" and info == "saved checkpoint"


def test_eta_counts_from_the_resumed_step(tmp_path, capsys, clock):
    log = MetricsLogger(LoggingConfig(jsonl=False), tmp_path, True, total_steps=1000, config={}, start_step=900)
    clock.now += 10.0
    log.log_train(920, {"loss": 1.0})  # 20 steps in 10 s since the resume: 80 left at 2 steps/s
    assert log.steps_per_s() == pytest.approx(2.0)
    assert capsys.readouterr().out.rstrip().endswith("92% 2.00 steps/s ETA 40s")
    for i in range(1, 20):  # the rate follows the recent steps: now 10 steps per second
        clock.now += 1.0
        log.log_train(920 + 10 * i, {"loss": 1.0})
    assert log.steps_per_s() == pytest.approx(10.0)
    log.close()


def test_tty_gets_a_sticky_bar_redrawn_in_place(tmp_path, clock):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    log = MetricsLogger(LoggingConfig(jsonl=False), tmp_path, True, total_steps=10, config={}, stream=out)
    clock.now += 1.0
    log.log_train(1, {"loss": 3.0})
    log.info("hello")
    log.close()
    text = out.getvalue()
    assert text.startswith("step  1/10 | loss 3.0000\n\r\x1b[K[##")
    assert "\r\x1b[Khello\n\r\x1b[K[##" in text and text.endswith("\n")


def test_jsonl_records_and_append_on_resume(tmp_path, clock):
    log = MetricsLogger(LoggingConfig(), tmp_path, True, total_steps=10, config={"model": {"hidden": 8}})
    for step in (1, 2, 3):
        log.log_train(step, {"loss": 4.0 - step, "lr": torch.tensor(1e-3)})
    log.log_eval(3, {"loss": 1.5})
    # a crash before close: every record is already on disk
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 5 and json.loads(lines[0])["kind"] == "start"
    first = json.loads(lines[1])
    assert first["step"] == 1 and first["kind"] == "train" and first["loss"] == 3.0
    assert first["lr"] == pytest.approx(1e-3)  # a float32 tensor, stored as a float
    assert isinstance(first["time"], float) and json.loads(lines[4])["kind"] == "eval"
    log.close()
    assert yaml.safe_load((tmp_path / "config.yaml").read_text()) == {"model": {"hidden": 8}}

    resumed = MetricsLogger(LoggingConfig(), tmp_path, True, total_steps=10, config={}, start_step=2)
    resumed.log_train(3, {"loss": 0.5})
    resumed.log_train(4, {"loss": 0.25})
    resumed.close()
    raw = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(raw) == 8 and raw[5] == {**raw[5], "kind": "start", "step": 2}
    kept = [(r["kind"], r["step"], r["loss"]) for r in read_metrics(tmp_path / "metrics.jsonl")]
    assert kept == [("train", 1, 3.0), ("train", 2, 2.0), ("train", 3, 0.5), ("train", 4, 0.25)]
    # a fresh run in the same directory starts the curve over
    with MetricsLogger(LoggingConfig(), tmp_path, True, total_steps=10, config={}) as fresh:
        fresh.log_train(1, {"loss": 9.0})
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [(1, 9.0)]


def test_read_metrics_skips_a_torn_last_line_and_rejects_missing_or_empty(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with pytest.raises(ValueError, match="does not exist"):
        read_metrics(path)
    path.write_text("")
    with pytest.raises(ValueError, match="no metrics"):
        read_metrics(path)
    path.write_text('{"step": 1, "kind": "train", "loss": 2.0}\n{"step": 2, "ki')
    assert [r["step"] for r in read_metrics(path)] == [1]
    path.write_text('{"step": 1, "kind": "train", "loss": 2.0}\n{oops\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not valid JSON"):
        read_metrics(path)


def test_a_full_disk_costs_metrics_records_not_the_run_and_leaves_no_torn_line(tmp_path, monkeypatch, capsys, clock):
    """metrics.jsonl on a full disk: the record is undone (a partial write truncated away), one warning, the run goes
    on; when the disk has room again the next records land and a second warning counts what only the console has."""
    import errno
    import os

    log = MetricsLogger(LoggingConfig(progress=False), tmp_path, True, total_steps=9, config={})
    real, full = os.write, {"on": False}

    def write(fd, data):
        if full["on"]:
            real(fd, data[:7])  # the disk takes a few bytes, then it is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(tlog.os, "write", write)
    log.log_train(1, {"loss": 3.0})
    full["on"] = True
    for step in (2, 3, 4):
        log.log_train(step, {"loss": 3.0 - step / 10})
    full["on"] = False
    log.log_train(5, {"loss": 2.0})
    log.close()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2, err
    assert "metrics.jsonl cannot be written ([Errno 28] No space left on device)" in err[0], err
    assert "metrics.jsonl is written again; 3 records before step 5 are only on the console" in err[1], err
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [(1, 3.0), (5, 2.0)]


def test_non_main_rank_writes_and_prints_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    log = MetricsLogger(LoggingConfig(wandb=True), run_dir, False, total_steps=10, config={"a": 1})
    log.log_train(1, METRICS)
    log.log_eval(1, {"loss": 1.0})
    log.info("hi")
    log.close()
    assert not run_dir.exists()
    assert capsys.readouterr() == ("", "")


def test_bad_metric_values_fail_clearly(tmp_path):
    log = MetricsLogger(LoggingConfig(), tmp_path, True, total_steps=10, config={})
    with pytest.raises(ValueError, match="'step' is reserved"):
        log.log_train(1, {"step": 3})
    with pytest.raises(ValueError, match="'loss'='high' must be a number"):
        log.log_train(1, {"loss": "high"})
    log.close()


class FakeWandb(types.ModuleType):
    """Records what the logger asks of wandb."""

    def __init__(self):
        super().__init__("wandb")
        self.calls = []

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        fake = self

        class Run:
            def log(self, data, step):
                fake.calls.append(("log", data, step))

            def finish(self):
                fake.calls.append(("finish",))

        return Run()


@pytest.fixture
def fake_wandb(monkeypatch, tmp_path):
    module = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", module)
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc from `wandb login`
    return module


def test_wandb_runs_offline_without_a_key_and_gets_every_record(tmp_path, fake_wandb):
    cfg = LoggingConfig(wandb=True, wandb_project="proj", wandb_name="tiny")
    log = MetricsLogger(cfg, tmp_path, True, total_steps=10, config={"train": {"steps": 10}})
    log.log_train(1, {"loss": 2.0, "mfu": None})
    log.log_eval(1, {"loss": 2.5})
    log.close()
    (kind, kwargs), *rest = fake_wandb.calls
    assert kind == "init" and kwargs["mode"] == "offline" and kwargs["project"] == "proj"
    assert kwargs["name"] == "tiny" and kwargs["config"] == {"train": {"steps": 10}} and kwargs["dir"] == str(tmp_path)
    assert rest == [("log", {"train/loss": 2.0}, 1), ("log", {"eval/loss": 2.5}, 1), ("finish",)]
    # a restart of the same run directory continues the same wandb run
    MetricsLogger(cfg, tmp_path, True, total_steps=10, config={}, start_step=1).close()
    assert fake_wandb.calls[-2][1]["id"] == kwargs["id"] and fake_wandb.calls[-2][1]["resume"] == "allow"


def test_wandb_goes_online_with_a_key_from_env_or_netrc(tmp_path, fake_wandb, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    MetricsLogger(LoggingConfig(wandb=True), tmp_path / "a", True, 10, {}).close()
    monkeypatch.delenv("WANDB_API_KEY")
    home = tmp_path / "home"
    home.mkdir()
    (home / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "y" * 40 + "\n")
    (home / ".netrc").chmod(0o600)
    MetricsLogger(LoggingConfig(wandb=True), tmp_path / "b", True, 10, {}).close()
    modes = [call[1]["mode"] for call in fake_wandb.calls if call[0] == "init"]
    assert modes == ["online", "online"]


def test_missing_wandb_warns_once_and_logging_goes_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    log = MetricsLogger(LoggingConfig(wandb=True), tmp_path, True, total_steps=10, config={})
    log.log_train(1, {"loss": 1.0})
    log.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "wandb package is not installed" in err[0] and "logging.wandb" in err[0]
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 1


def test_peak_tflops_table(monkeypatch):
    assert peak_tflops(torch.device("cpu"), torch.bfloat16, None) is None
    assert peak_tflops("cpu", torch.float32, 42.0) == 42.0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, dtype, want in (
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.0),
        ("NVIDIA H200", "bfloat16", 989.0),
        ("NVIDIA H100 PCIe", torch.float16, 756.0),
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312.0),
        ("NVIDIA H100 80GB HBM3", torch.float32, 67.0),
        ("NVIDIA A10G", torch.bfloat16, None),
        ("NVIDIA L40", torch.bfloat16, None),
    ):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        assert peak_tflops(torch.device("cuda", 0), dtype, None) == want, name
    monkeypatch.setattr(flops, "_tf32_matmuls", lambda torch_module: True)
    assert peak_tflops(torch.device("cuda", 0), torch.float32, None) is None  # still the L40 name
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert peak_tflops(torch.device("cuda", 0), torch.float32, None) == 494.0


def _load_tool(name):
    spec = importlib.util.spec_from_file_location(f"tools_{name}", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plot_loss_writes_a_png(tmp_path, capsys):
    log = MetricsLogger(LoggingConfig(progress=False), tmp_path, True, total_steps=20, config={})
    for step in range(1, 21):
        log.log_train(step, {"loss": 5.0 / step})
    log.log_eval(10, {"loss": 0.7})
    log.log_eval(20, {"loss": 0.4})
    log.close()
    plot = _load_tool("plot_loss")
    assert plot.main([str(tmp_path), "--out", str(tmp_path / "curve.png")]) == 0
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot.main([str(tmp_path / "nowhere")]) == 2
    assert "plot_loss.py: error:" in capsys.readouterr().err
    # two runs on one plot (each needs its losses; the plot needs a name)
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text(
        '{"step": 1, "kind": "train", "loss": 3.0}\n{"step": 2, "kind": "train", "loss": 2.0}\n'
    )
    assert plot.main([str(tmp_path), str(other), "--out", str(tmp_path / "both.png")]) == 0
    assert (tmp_path / "both.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot.main([str(tmp_path), str(other)]) == 2
    assert capsys.readouterr().err.strip().endswith("2 runs go on one plot: name it with --out, e.g. --out loss.png")
    assert plot.main([str(tmp_path), str(tmp_path / "nowhere"), "--out", str(tmp_path / "x.png")]) == 2
    assert not (tmp_path / "x.png").exists()


def test_plot_loss_names_the_file_it_wrote_when_out_has_no_suffix(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "kind": "train", "loss": 2.0}\n')
    assert _load_tool("plot_loss").main([str(tmp_path), "--out", str(tmp_path / "curve")]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'curve.png'}"  # matplotlib adds .png itself
    assert (tmp_path / "curve.png").is_file() and not (tmp_path / "curve").exists()


def test_plot_loss_cli_exits_2_on_a_missing_file(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "plot_loss.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    missing = str(tmp_path / "metrics.jsonl")
    assert result.stderr.strip().splitlines() == [
        f"plot_loss.py: error: {missing!r} does not exist; a run writes it when logging.jsonl=true"
    ]
