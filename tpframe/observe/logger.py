"""Run metrics: a console line with progress and ETA, `<run_dir>/metrics.jsonl`, and TensorBoard and
wandb when asked.

    log = MetricsLogger(cfg.logging, run_dir, is_main=rank == 0, total_steps=1000, config=cfg.to_dict())
    log.log_train(step, {"loss": 2.31, "lr": 3e-4, "grad_norm": 0.8, "tokens_per_s": 5e4, "step_ms": 412.0,
                         "tflops": 120.0, "mfu": 0.12, "mem_gib": 10.5})
    log.log_eval(step, {"loss": 2.40})
    log.close()

Only the main rank writes anything. metrics.jsonl holds one JSON object per line: `step`, `kind`
("train", "eval", or "start": a run (re)starting at that step, which makes earlier records of later
steps stale; `read_metrics` drops them), `time` (unix seconds) and the metrics, flat. TensorBoard
(`<run_dir>/tensorboard`) and wandb get the same scalars as `train/<name>` and `eval/<name>`.

The console prints every number with its unit (`step 412 ms`, `51.2k tok/s`, `mem 10.50 GiB`); the
per-phase times (`data_ms`, `fwd_bwd_ms`, ... see tpframe/observe/timers.py) go to the files only.
"""

from __future__ import annotations

import collections
import contextlib
import json
import netrc
import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TextIO
from urllib.parse import urlparse

import yaml

from tpframe.config import check_at_least, check_ranges
from tpframe.errors import ConfigError
from tpframe.paths import not_a_file

_RESERVED = ("step", "kind", "time")
TIMER_MODES = ("auto", "sync", "none")  # logging.timers: how tpframe/observe/timers.py times the phases
_BAR_WIDTH = 20
_RATE_WINDOW = 10  # ETA: steps/s over the last this-many log calls


@dataclass
class LoggingConfig:
    interval: int = 10  # log every N steps (and always the first step of a launch)
    jsonl: bool = True  # <run_dir>/metrics.jsonl
    progress: bool = True  # progress bar and ETA on the console
    wandb: bool = False  # also log to Weights & Biases (pip install -e ".[wandb]")
    wandb_project: str = "tpframe"  # wandb project
    wandb_name: str | None = None  # wandb run name; None: wandb picks one
    peak_tflops: float | None = None  # per-device peak for MFU; None: a table by device name
    tensorboard: bool = False  # also write every metric to <run_dir>/tensorboard (pip install tensorboard)
    timers: Literal[TIMER_MODES] = "auto"  # phase times per step: CUDA events or CPU clock; sync; none
    # several ranks: at each log step, name a rank whose forward+backward takes more than this many times the median
    # of its pipeline stage's ranks (tpframe/observe/stragglers.py); 0: no line (fwd_bwd_max_ms, slowest_rank logged)
    straggler_ratio: float = 1.1


def check_logging(lg: LoggingConfig) -> None:
    """The `logging:` section: a log interval, a peak for MFU, a straggler ratio that can name a slow rank."""
    check_at_least("logging", lg, ("interval",))
    check_ranges("logging", lg, (("peak_tflops", 0.0, None, False),))
    if lg.straggler_ratio and lg.straggler_ratio < 1:
        raise ConfigError(
            f"logging.straggler_ratio={lg.straggler_ratio} must be 0 (off) or at least 1: a "
            "rank slower than this many times its stage's median is named, e.g. 1.1"
        )


class MetricsLogger:
    """Console, JSONL and wandb logging for one run; a no-op on every rank but the main one."""

    def __init__(
        self,
        cfg: LoggingConfig,
        run_dir: str | Path,
        is_main: bool,
        total_steps: int,
        config: dict,
        start_step: int = 0,
        stream: TextIO | None = None,
        open_files: bool = True,
    ):
        """`open_files=False`: write nothing (config.yaml, metrics.jsonl, wandb, TensorBoard) until `open()`; the
        console works at once (train.py opens them once a resumed checkpoint has loaded)."""
        self.cfg, self.run_dir, self.is_main = cfg, Path(run_dir), is_main
        self._config, self._opened = config, False
        self.total_steps, self.start_step = total_steps, start_step
        self._out = stream or sys.stdout
        self._tty = bool(getattr(self._out, "isatty", lambda: False)())
        self._bar_shown = False
        self._jsonl: int | None = None  # an O_APPEND descriptor: each record one os.write, undone if it fails
        self._lost = 0  # records metrics.jsonl could not take (a full disk); the console still shows them
        self._wandb = None
        self._tensorboard = None
        self._rate = collections.deque([(start_step, time.monotonic())], maxlen=_RATE_WINDOW)
        if open_files:
            self.open()

    def open(self) -> None:
        """Write config.yaml and start metrics.jsonl, wandb and TensorBoard (main rank; once)."""
        if not self.is_main or self._opened:
            return
        self._opened = True
        cfg, config, start_step = self.cfg, self._config, self.start_step
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # whole or not at all: another rank's pre-flight (train.py prepare) may be reading it right now
        partial = self.run_dir / f".config.yaml.{os.getpid()}"
        partial.write_text(yaml.safe_dump(config, sort_keys=False))
        os.replace(partial, self.run_dir / "config.yaml")
        if cfg.jsonl:
            self._jsonl = os.open(self.run_dir / "metrics.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._write_record(start_step, "start", {})  # records after this step from earlier runs are stale
        if cfg.wandb:
            self._wandb = _init_wandb(cfg, self.run_dir, config, self._warn)
        if getattr(cfg, "tensorboard", False):
            self._tensorboard = _init_tensorboard(self.run_dir, start_step, self._warn)

    # -- public API -------------------------------------------------------------------------------

    def log_train(self, step: int, metrics: dict[str, float]) -> None:
        """One console line (+ progress and ETA), one JSONL record, one wandb point. `mfu` is a fraction."""
        if not self.is_main:
            return
        metrics = _as_floats(metrics)
        self._rate.append((step, time.monotonic()))
        line = f"step {step:>{len(str(self.total_steps))}}/{self.total_steps} | " + format_metrics(metrics)
        if self.cfg.progress and not self._tty:
            line += " | " + self._progress(step)
        self._print(line)
        if self.cfg.progress and self._tty:
            self._draw_bar(step)
        self._write_record(step, "train", metrics)
        self._write_scalars(step, "train", metrics)

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        if not self.is_main:
            return
        metrics = _as_floats(metrics)
        self._print(f"eval step {step} | " + format_metrics(metrics))
        self._write_record(step, "eval", metrics)
        self._write_scalars(step, "eval", metrics)

    def info(self, message: str) -> None:
        """A plain console line (main rank only)."""
        if self.is_main:
            self._print(message)

    def close(self) -> None:
        if self._bar_shown:
            self._out.write("\n")
            self._out.flush()
            self._bar_shown = False
        if self._jsonl is not None:
            os.close(self._jsonl)
            self._jsonl = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------------

    def _write_record(self, step: int, kind: str, metrics: dict[str, float | None]) -> None:
        if self._jsonl is None:
            return
        data = (json.dumps({"step": step, "kind": kind, "time": round(time.time(), 3), **metrics}) + "\n").encode()
        end = os.fstat(self._jsonl).st_size
        try:  # unbuffered: a crash loses nothing
            if os.write(self._jsonl, data) != len(data):
                raise OSError(f"only part of a {len(data)}-byte record was written")
        except OSError as e:  # a full disk must not end the run here: the checkpoint save decides (exit code 5)
            with contextlib.suppress(OSError):
                os.ftruncate(self._jsonl, end)  # no torn line for read_metrics to trip on
            if not self._lost:
                self._warn(
                    f"{self.run_dir / 'metrics.jsonl'} cannot be written ({e}); its records go to the "
                    "console only until it can"
                )
            self._lost += 1
            return
        if self._lost:
            self._warn(
                f"{self.run_dir / 'metrics.jsonl'} is written again; {self._lost} records before step {step} "
                "are only on the console"
            )
            self._lost = 0

    def _write_scalars(self, step: int, kind: str, metrics: dict[str, float | None]) -> None:
        scalars = {f"{kind}/{k}": v for k, v in metrics.items() if v is not None}
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
        if self._tensorboard is not None:
            for tag, value in scalars.items():
                self._tensorboard.add_scalar(tag, value, step)

    def _print(self, line: str) -> None:
        if self._bar_shown:  # keep the progress bar below the scrolling lines
            self._out.write("\r\x1b[K")
        self._out.write(line + "\n")
        if self._bar_shown:
            self._draw_bar(self._rate[-1][0])
        self._out.flush()

    def _warn(self, message: str) -> None:
        print(f"warning: {message}", file=sys.stderr, flush=True)

    def steps_per_s(self) -> float | None:
        """Steps/s over the recent log calls; None before two points exist."""
        (s0, t0), (s1, t1) = self._rate[0], self._rate[-1]
        return (s1 - s0) / (t1 - t0) if s1 > s0 and t1 > t0 else None

    def _progress(self, step: int) -> str:
        total = max(self.total_steps, 1)
        done = min(max(step / total, 0.0), 1.0)
        filled = int(done * _BAR_WIDTH)
        rate = self.steps_per_s()
        eta = format_duration((self.total_steps - step) / rate) if rate else "?"
        speed = "- steps/s" if not rate else f"{rate:.2f} steps/s" if rate >= 1 else f"{1 / rate:.2f} s/step"
        return f"[{'#' * filled}{'.' * (_BAR_WIDTH - filled)}] {done:4.0%} {speed} ETA {eta}"

    def _draw_bar(self, step: int) -> None:
        self._out.write("\r\x1b[K" + self._progress(step))
        self._out.flush()
        self._bar_shown = True


# -- formatting -----------------------------------------------------------------------------------


def _si(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{unit}"
    return f"{value:.1f}"


def _ms(value: float) -> str:
    return f"{value:.0f} ms" if value >= 100 else f"{value:.1f} ms" if value >= 1 else f"{value:.2f} ms"


def _joules(value: float) -> str:
    for unit, scale in (("kJ", 1e3), ("J", 1.0), ("mJ", 1e-3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value * 1e6:.3g} uJ"


_FORMATS = {  # known keys, in console order
    "loss": lambda v: f"loss {v:.4f}",
    "ppl": lambda v: f"ppl {v:.2f}",
    "lr": lambda v: f"lr {v:.2e}",
    "grad_norm": lambda v: f"grad {v:.3f}",
    "moe_aux_loss": lambda v: f"aux {v:.4f}",
    "moe_z_loss": lambda v: f"z {v:.3g}",
    "moe_load_max": lambda v: f"load {v:.2f}x",
    "tokens_per_s": lambda v: f"{_si(v)} tok/s",
    "step_ms": lambda v: f"step {_ms(v)}",
    "tflops": lambda v: f"{v:.1f} TFLOP/s",
    "mfu": lambda v: f"MFU {v:.1%}",
    "energy_j": lambda v: f"{_joules(v)}/step",
    "energy_j_per_token": lambda v: f"{_joules(v)}/tok",
    "mem_gib": lambda v: f"mem {v:.2f} GiB",
}
# tpframe/observe/timers.py and stragglers.py (a slow rank gets a console line of its own)
FILES_ONLY = ("data_ms", "fwd_bwd_ms", "grad_sync_ms", "optim_ms", "ckpt_ms", "fwd_bwd_max_ms", "slowest_rank")
_UNITS = (
    ("_ms", _ms),
    ("_s", lambda v: f"{v:.3g} s"),
    ("_j", _joules),
    ("_gib", lambda v: f"{v:.2f} GiB"),
    ("_w", lambda v: f"{v:.0f} W"),
)


def _other(key: str, value: float) -> str:
    for suffix, fmt in _UNITS:
        if key.endswith(suffix):
            return f"{key[: -len(suffix)]} {fmt(value)}"
    return f"{key} {value:.4g}"


def format_metrics(metrics: dict[str, float | None]) -> str:
    """`loss 2.3100 | lr 3.00e-04 | ...`: known keys first in a fixed order, then the rest (a unit taken
    from a `_ms`/`_s`/`_j`/`_gib`/`_w` suffix); None values and the per-phase times skipped."""
    known = [_FORMATS[k](metrics[k]) for k in _FORMATS if metrics.get(k) is not None]
    rest = [_other(k, v) for k, v in metrics.items() if k not in _FORMATS and k not in FILES_ONLY and v is not None]
    return " | ".join(known + rest)


def format_duration(seconds: float) -> str:
    seconds = max(int(seconds), 0)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def _as_floats(metrics: dict[str, Any]) -> dict[str, float | int | None]:
    out = {}
    for key, value in metrics.items():
        if key in _RESERVED:
            raise ValueError(f"metric name {key!r} is reserved in metrics.jsonl ({', '.join(_RESERVED)}); rename it")
        if value is not None and hasattr(value, "item"):  # a 0-d tensor or numpy scalar
            value = value.item()
        if value is not None and not isinstance(value, (int, float)):
            raise ValueError(f"metric {key!r}={value!r} must be a number")
        # a count stays an int in metrics.jsonl (slowest_rank: 1, not 1.0)
        out[key] = value if value is None or type(value) is int else float(value)
    return out


_KINDS = ("start", "train", "eval")


def foreign_metrics(path: str | Path) -> str | None:
    """Why the file `path` is not a metrics.jsonl a MetricsLogger wrote, whose records a run may append to: its first
    line is not one of its records (MetricsLogger's first write is a "start" record). None for an empty file (a
    run stopped before its first write) or one of ours."""
    try:
        with open(path, "rb") as f:
            first = f.readline(1 << 16)
    except OSError as e:
        return f"it cannot be read ({e.strerror or type(e).__name__})"
    if not first:
        return None
    try:
        rec = json.loads(first)
    except ValueError:  # not JSON, or not UTF-8
        rec = None
    step = rec.get("step") if isinstance(rec, dict) else None
    if isinstance(step, int) and not isinstance(step, bool) and rec.get("kind") in _KINDS:
        return None
    text = first.decode("utf-8", "replace").rstrip("\r\n")
    return f"its first line is not a tpframe metrics record: {text[:60]!r}{'...' if len(text) > 60 else ''}"


def read_metrics(path: str | Path) -> list[dict]:
    """The train/eval records of a metrics.jsonl; a "start" record at step S drops the earlier records
    of steps after S (the restarted run replaced them). ValueError if missing, empty or corrupt."""
    path = Path(path)
    if why := not_a_file(path):
        raise ValueError(f"{str(path)!r} {why}; a run writes it when logging.jsonl=true")
    records: list[dict] = []
    with open(path, encoding="utf-8", errors="replace") as f:  # a bad byte: that line is not valid JSON
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                if not line.endswith("\n"):  # a crash mid-write: ignore the torn last line
                    break
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                raise ValueError(
                    f"{path}:{lineno}: not a metrics record (a JSON object with an integer 'step'); "
                    "is this a tpframe metrics.jsonl?"
                )
            if rec.get("kind") == "start":
                records = [r for r in records if r["step"] <= rec["step"]]
            else:
                records.append(rec)
    if not records:
        raise ValueError(f"{str(path)!r} holds no metrics yet")
    return records


# -- wandb ----------------------------------------------------------------------------------------


def wandb_key_configured() -> bool:
    """WANDB_API_KEY is set, or `wandb login` stored a key in ~/.netrc for the wandb host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _init_wandb(cfg: LoggingConfig, run_dir: Path, config: dict, warn):
    """A wandb run (offline unless a key is configured or WANDB_MODE says otherwise), resumed
    across restarts of the same run_dir; None, with one warning, when wandb is not installed."""
    try:
        import wandb
    except ImportError:
        warn(
            'logging.wandb=true but the wandb package is not installed (pip install -e ".[wandb]"); '
            "continuing without wandb"
        )
        return None
    mode = os.environ.get("WANDB_MODE") or ("online" if wandb_key_configured() else "offline")
    id_file = run_dir / "wandb_run_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
    id_file.write_text(run_id + "\n")
    return wandb.init(
        project=cfg.wandb_project,
        name=cfg.wandb_name,
        config=config,
        dir=str(run_dir),
        mode=mode,
        id=run_id,
        resume="allow",
    )


# -- TensorBoard ----------------------------------------------------------------------------------


def _init_tensorboard(run_dir: Path, start_step: int, warn):
    """A SummaryWriter on <run_dir>/tensorboard; a resumed run purges the events after its step.
    None, with one warning, when the tensorboard package is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        warn(
            "logging.tensorboard=true but the tensorboard package is not installed (pip install tensorboard); "
            "continuing without TensorBoard"
        )
        return None
    return SummaryWriter(
        log_dir=str(run_dir / "tensorboard"), purge_step=start_step + 1 if start_step else None, flush_secs=10
    )
