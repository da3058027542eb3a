"""The generic config parser (ground floor): a strict YAML file, `section.key=value` overrides, nested dicts coerced
into dataclasses with one clear ConfigError per mistake, and the checks every section shares.

    data = read_yaml_file("configs/x.yaml")               # duplicate keys, not UTF-8, empty, not YAML: ConfigError
    data = apply_overrides(data, ["parallel.tp=2"])        # each key once; values as YAML reads them
    cfg = read_sections(Config, data)                      # unknown keys with a did-you-mean, wrong types named
    cfg = load(Config, "configs/x.yaml", ["train.steps=5"])  # the three above
    m = read_section(ModelConfig, {"hidden": 64}, "model")  # one section (a checkpoint's recorded model)
    check_ranges("optim", cfg.optim, OPTIM_RANGES)         # declared ranges: "optim.eps=0 must be > 0 and < 1"

The sections themselves (their keys, types and checks) live with the packages they configure.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from tpframe.errors import ConfigError, shown

# -- YAML ---------------------------------------------------------------------------------------------


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


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `section.key=value` strings (values parsed as YAML) to nested dicts. A key given twice is refused, as
    in the YAML file: which one was meant cannot be known."""
    given: dict[tuple[str, str], str] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value (e.g. train.steps=100)")
        dotted, raw = item.split("=", 1)
        parts = dotted.strip().split(".")
        if len(parts) != 2 or not all(parts):
            raise ConfigError(f"override key {dotted!r} must be section.key (e.g. parallel.tp=2)")
        section, key = parts
        if (section, key) in given:
            raise ConfigError(
                f"override {section}.{key} is given twice ({given[section, key]!r} and {item!r}); give it once"
            )
        given[section, key] = item
        value = parse_override_value(item, raw)
        if section not in data or data[section] is None:
            data[section] = {}
        if not isinstance(data[section], dict):
            raise ConfigError(f"config section '{section}' must be a mapping of keys, got {shown(data[section])}")
        data[section][key] = value
    return data


# -- dataclasses ------------------------------------------------------------------------------------


def did_you_mean(word: str, options, prefix: str = "") -> str:
    """ " (did you mean 'prefix.close'?)", or the known options when none is close."""
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    if close:
        return f" (did you mean '{prefix}{close[0]}'?)"
    return f" (known: {', '.join(prefix + o for o in sorted(options))})"


def _number(value: Any) -> Any:
    """YAML reads 1e10 and 1e-3 (no dot) as strings: those as floats, anything else unchanged."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value


def coerce(value: Any, annotation: Any, key: str) -> Any:
    """`value` as the field's type, or a ConfigError naming the key and the expected type."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(value, typing.get_args(annotation), key)
    if origin is Literal:
        choices = typing.get_args(annotation)
        if value not in choices:
            raise ConfigError(f"{key}={shown(value)} is not allowed; choose one of {', '.join(map(repr, choices))}")
        return value
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={shown(value)} must be true or false")
    if annotation in (int, float):
        number = _number(value)
        if isinstance(number, (int, float)) and not isinstance(number, bool):
            if annotation is float:
                return float(number)
            if isinstance(number, int) or number.is_integer():
                return int(number)
        shown_as = number if annotation is int else value  # an integer's error shows YAML's "1e-9" as 1e-09
        raise ConfigError(f"{key}={shown(shown_as)} must be {'an integer' if annotation is int else 'a number'}")
    if annotation is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}={shown(value)} must be a string")
    if origin is list:
        (item,) = typing.get_args(annotation)
        if isinstance(value, (list, tuple)):
            return [coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        raise ConfigError(f"{key}={shown(value)} must be a list, e.g. [4, 4]")
    raise TypeError(f"unsupported config annotation {annotation!r} for {key}")


def _coerce_union(value: Any, options: tuple, key: str) -> Any:
    if value is None and type(None) in options:
        return None
    errors = []
    for option in options:
        if option is type(None):
            continue
        try:
            return coerce(value, option, key)
        except ConfigError as e:
            errors.append(str(e))
    if bool in options and len(errors) == 2 and typing.get_origin(options[1]) is Literal:  # bool | Literal[...]
        choices = ", ".join(map(repr, typing.get_args(options[1])))
        raise ConfigError(f"{key}={shown(value)} is not allowed; choose true, false or one of {choices}")
    raise ConfigError(errors[0] if errors else f"{key}: invalid value {shown(value)}")


def read_section(cls, values: dict[str, Any], section: str):
    """Dataclass `cls` (the `section:` of a config) from a mapping of keys, each key known and each value coerced
    to its field's type."""
    types_ = typing.get_type_hints(cls)
    fields = {}
    for key, value in values.items():
        if not isinstance(key, str):
            raise ConfigError(f"keys of config section '{section}' are words, got {shown(key)}")
        if key not in types_:
            raise ConfigError(f"unknown config key '{section}.{key}'{did_you_mean(key, types_, section + '.')}")
        fields[key] = coerce(value, types_[key], f"{section}.{key}")
    return cls(**fields)


def load(cls, path: str | Path | None, overrides: list[str]):
    """Dataclass `cls` (a mapping of sections) from a YAML file (None: the defaults) and `section.key=value`
    overrides."""
    data: dict[str, Any] = read_yaml_file(path) if path is not None else {}
    return read_sections(cls, apply_overrides(data, overrides))


def read_sections(cls, data: Any):
    """Dataclass `cls`, whose fields are the sections (dataclasses themselves), from nested dicts; a section left
    out keeps its defaults."""
    if not isinstance(data, dict):
        raise ConfigError(f"the config must be a mapping of sections, got {type(data).__name__}")
    sections = typing.get_type_hints(cls)
    kwargs = {}
    for section, values in data.items():
        if not isinstance(section, str):
            raise ConfigError(f"config section names are words (model, train, ...), got {shown(section)}")
        if section not in sections:
            raise ConfigError(f"unknown config section '{section}'{did_you_mean(section, sections)}")
        if values is None:
            values = {}
        if not isinstance(values, dict):
            raise ConfigError(f"config section '{section}' must be a mapping of keys, got {shown(values)}")
        kwargs[section] = read_section(sections[section], values, section)
    return cls(**kwargs)


# -- checks every section uses ------------------------------------------------------------------------

FLOAT32_MAX = 3.4028234663852886e38  # a float beyond it becomes inf in a float32 tensor (optim.lr: AdamW fails)


def check_finite(cfg) -> None:
    """Every float of every section (fields of the dataclass `cfg` that are dataclasses) finite and within
    float32's range."""
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        for f in dataclasses.fields(values):
            value, key = getattr(values, f.name), f"{section.name}.{f.name}"
            if not isinstance(value, float):
                continue
            if not math.isfinite(value):
                raise ConfigError(f"{key}={value} must be a finite number")
            if abs(value) > FLOAT32_MAX:
                raise ConfigError(f"{key}={value:g} is beyond float32's range (3.4e+38), where it would become inf")


def check_ranges(section: str, values, ranges) -> None:
    """Declared ranges: `ranges` holds (key, lowest, highest or None, lowest included); a value outside is
    "section.key=V must be > LOW [and < HIGH]" (>= where the lowest is included). None (unset) passes."""
    for name, low, high, closed in ranges:
        value = getattr(values, name)
        if value is None:
            continue
        if (value < low if closed else value <= low) or (high is not None and value >= high):
            bound = f"{'>=' if closed else '>'} {low:g}" + (f" and < {high:g}" if high is not None else "")
            raise ConfigError(f"{section}.{name}={value:g} must be {bound}")


def check_at_least(section: str, values, names, low: int = 1, *, note: str = "") -> None:
    """Each of `names` at least `low`, None (unset) passing: "section.key=V must be at least 1" + `note` ("must not be
    negative" for 0)."""
    for name in names:
        value = getattr(values, name)
        if value is not None and value < low:
            bound = "not be negative" if low == 0 else f"be at least {low}"
            raise ConfigError(f"{section}.{name}={value} must {bound}{note}")


def check_paths_given(section: str, values, hints: dict[str, str]) -> None:
    """An empty string for a path key (or an entry of a list of paths) is refused with what to give instead: ""
    would be skipped as if unset, or read as the current directory; null (or leaving the key out) says "none"."""
    for name, hint in hints.items():
        value, key = getattr(values, name), f"{section}.{name}"
        entries = (
            [(f"{key}[{i}]", v) for i, v in enumerate(value)] if isinstance(value, (list, tuple)) else [(key, value)]
        )
        for where, v in entries:
            if isinstance(v, str) and not v.strip():
                raise ConfigError(f"{where} is empty; give {hint}")
