"""The checks behind `load_config` and `validate` that are not about one section's shape: strict YAML
(no duplicate keys, UTF-8, one line per mistake), finite numbers in range, and the env vars a run reads.

    data = read_yaml_file("configs/x.yaml")      # ConfigError: duplicate key, not UTF-8, empty, not YAML
    value = parse_override_value("optim.lr=1e-3") # the value as YAML reads it, or a ConfigError
    check_numbers(cfg)                            # every float finite, every number in its range
    check_env()                                   # TPFRAME_COMM_BACKEND, fault hooks ...
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

import yaml

from tpframe.data.corpus import SYNTHETIC_TOKENS_MAX
from tpframe.errors import ConfigError, env_int, shown


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (YAML would keep the last silently)."""


def _strict_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        try:
            first = seen.get(key)
        except TypeError:
            raise ConfigError(f"line {line}: a mapping key must be a name, got {shown(key)}") from None
        if first is not None:
            raise ConfigError(
                f"key {shown(key)} appears twice in one mapping (lines {first} and {line}); "
                "YAML would silently keep only the last: merge them"
            )
        seen[key] = line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _strict_mapping)


def _yaml_problem(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    return f"{problem}{where}"


def read_yaml_file(path: str | Path) -> dict[str, Any]:
    """A config file's top-level mapping; ConfigError (one line) for anything else."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} is not a file")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {str(path)!r} is not UTF-8 text (byte {e.start} is {e.object[e.start]:#04x}); "
            "save it as UTF-8"
        ) from None
    except OSError as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {e.strerror}") from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {_yaml_problem(e)}") from None
    except ConfigError as e:
        raise ConfigError(f"config file {str(path)!r}: {e}") from None
    if data is None:
        raise ConfigError(
            f"config file {str(path)!r} is empty; give it at least one section "
            "(see configs/tiny_cpu.yaml), or leave --config out to run on the defaults"
        )
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {str(path)!r} must hold a mapping of sections (model:, train:, ...), "
            f"not a {type(data).__name__}"
        )
    return data


def parse_override_value(item: str, raw: str) -> Any:
    """The value of override `item` (`section.key=raw`) as YAML reads it; empty means null."""
    if not raw.strip():
        return None
    try:
        return yaml.load(raw, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        raise ConfigError(
            f"override {item!r}: the value {raw!r} is not valid YAML ({_yaml_problem(e)}); quote it if it is a string"
        ) from None


# -- numbers ----------------------------------------------------------------------------------------

# (key, lowest, highest, lowest included): every float here must also be finite.
# The timeouts' ceiling: torch's stores and process groups count milliseconds in C integers (1e10 s overflows).
TIMEOUT_MAX_S = 1e6
FLOAT32_MAX = 3.4028234663852886e38  # a float beyond it becomes inf in a float32 tensor (optim.lr: AdamW fails)
SEED_LIMIT = 2**63  # torch seeds are 64-bit and the model adds per-layer and per-rank offsets to train.seed
_RANGES = (
    ("model.norm_eps", 0.0, 1.0, False),
    ("model.init_std", 0.0, None, False),
    ("model.rope_theta", 0.0, None, False),
    ("model.rope_scaling_factor", 0.0, None, False),
    ("model.rope_low_freq_factor", 0.0, None, False),
    ("model.rope_high_freq_factor", 0.0, None, False),
    ("optim.eps", 0.0, 1.0, False),
    ("optim.weight_decay", 0.0, None, True),
    ("optim.grad_clip", 0.0, None, True),
    ("logging.peak_tflops", 0.0, None, False),
    ("comm.timeout_s", 0.0, TIMEOUT_MAX_S, False),
    ("parallel.pp_timeout_s", 0.0, TIMEOUT_MAX_S, False),
    ("train.loss_spike_z", 0.0, None, True),
)


def _floats(cfg) -> list[tuple[str, float]]:
    out = []
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        for f in dataclasses.fields(values):
            value = getattr(values, f.name)
            if isinstance(value, float):
                out.append((f"{section.name}.{f.name}", value))
    return out


def check_numbers(cfg) -> None:
    """Every float finite, and the ones with a meaningful range inside it."""
    floats = dict(_floats(cfg))
    for key, value in floats.items():
        if not math.isfinite(value):
            raise ConfigError(f"{key}={value} must be a finite number")
        if abs(value) > FLOAT32_MAX:
            raise ConfigError(f"{key}={value:g} is beyond float32's range (3.4e+38), where it would become inf")
    for key, low, high, closed in _RANGES:
        value = floats.get(key)
        if value is None:
            continue
        if (value < low if closed else value <= low) or (high is not None and value >= high):
            bound = f"{'>=' if closed else '>'} {low:g}" + (f" and < {high:g}" if high is not None else "")
            raise ConfigError(f"{key}={value:g} must be {bound}")
    for key in ("train.seed", "data.seed"):
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) < 0:
            raise ConfigError(f"{key}={getattr(getattr(cfg, section), name)} must be a non-negative integer")
    if cfg.train.seed >= SEED_LIMIT:
        raise ConfigError(
            f"train.seed={cfg.train.seed} must be below 2**63 (torch's seeds are 64-bit and each layer "
            "and rank adds an offset)"
        )
    if cfg.data.synthetic_tokens < 2:
        raise ConfigError(f"data.synthetic_tokens={cfg.data.synthetic_tokens} must be at least 2")
    n = cfg.data.synthetic_tokens
    if n > SYNTHETIC_TOKENS_MAX:
        shown = f"{n:,}" if n < 10**15 else f"{n:.3g}"
        raise ConfigError(
            f"data.synthetic_tokens={shown} is more than the synthetic corpus takes ({SYNTHETIC_TOKENS_MAX:,} at most: every rank "
            "generates it before training, about a minute and 2.5 GiB of memory for that many); for "
            "more data use data.source=tokens (tools/prepare_data.py)"
        )
    if cfg.train.max_skipped_steps < 0:
        raise ConfigError(f"train.max_skipped_steps={cfg.train.max_skipped_steps} must not be negative")


# -- environment ------------------------------------------------------------------------------------


def check_env(comm_backend: str) -> None:
    """The env vars tpframe reads, checked with the config (they override it); the launcher's (WORLD_SIZE, RANK,
    ...) are tpframe.launch.launch_env's."""
    from tpframe.comm.communicator import resolve_backend_name
    from tpframe.training.health import parse_fault_spec

    try:
        resolve_backend_name(comm_backend)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    raw = os.environ.get("TPFRAME_SYMM_BUFFER_MB")
    if raw is not None:
        try:
            ok = float(raw) > 0 and math.isfinite(float(raw))
        except ValueError:
            ok = False
        if not ok:
            raise ConfigError(f"env var TPFRAME_SYMM_BUFFER_MB={raw!r} must be a positive number of MiB")
    parse_fault_spec(os.environ.get("TPFRAME_FAULT_NAN"))
    for name in ("TPFRAME_FAULT_KILL_DURING_SAVE", "TPFRAME_FAULT_RANK"):
        env_int(name, None, 0)
