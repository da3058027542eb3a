"""A Hugging Face family as data: config.json <-> model.* values, and a name table (torchtitan's state-dict adapters).

A name table maps each HF module (or full tensor name) to the tpframe logical module(s) it holds, `{}` standing for
each number (layer, expert): "model.layers.{}.self_attn.o_proj": "blocks.{}.attn.proj". A module's leaves (weight,
bias) follow it; an entry naming several logical modules (`Fused`) is their tensors along dim 0: concatenated
(GPT-2's c_attn, Phi-3's qkv_proj), or interleaved per head (`groups`: GPT-NeoX's query_key_value). Logical names
are those of tpframe.parallel.sharding; which ones a model has comes from the model itself (models.logical_shapes).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tpframe.errors import ConfigError
from tpframe.models.config import ModelConfig


class HFMappingError(ConfigError):
    """A model, config.json or weights file with no equivalent on the other side, explained in one line."""


@dataclass(frozen=True)
class Fused:
    parts: tuple[str, ...]  # logical modules, in the HF tensor's order
    groups: int = 1  # each part cut into this many row blocks, interleaved (per attention head); 1: concatenated


@dataclass(frozen=True)
class Family:
    kinds: dict[str, str]  # the config.json model_types it reads -> their names in messages
    architecture: Callable[[ModelConfig], str]  # the model_type `m` is written as; HFMappingError naming why none
    to_config: Callable[[ModelConfig, str], dict[str, Any]]  # config.json of `m` as that model_type (common keys aside)
    from_config: Callable[[Fields], dict[str, Any]]  # the model.* values (name too) of a config.json, each checked
    names: Callable[[ModelConfig, str], dict[str, str | tuple[str, ...] | Fused]]  # the name table, by model_type
    transposed: frozenset[str] = frozenset()  # HF modules whose weight is stored [in, out] (GPT-2's Conv1D)
    bare_prefix: str = ""  # what a base model's checkpoint leaves out of every name (GPT2Model's "transformer.")


@dataclass(frozen=True)
class Rule:
    """One HF tensor: the logical tensors `parts` (their dim-0 sizes `rows`, the other dims `rest`), joined."""

    hf: str
    parts: tuple[str, ...]
    rows: tuple[int, ...]
    rest: tuple[int, ...]
    transpose: bool = False
    groups: int = 1

    @property
    def shape(self) -> tuple[int, ...]:
        shape = (sum(self.rows), *self.rest)
        return tuple(reversed(shape)) if self.transpose else shape

    def join(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The logical parts -> the HF tensor (contiguous)."""
        full = torch.cat([t.unflatten(0, (self.groups, -1)) for t in tensors], dim=1).flatten(0, 1)
        return (full.t() if self.transpose else full).contiguous()

    def part(self, full: torch.Tensor, i: int) -> torch.Tensor:
        """Logical part i of the HF tensor `full` (a view)."""
        full = (full.t() if self.transpose else full).unflatten(0, (self.groups, -1))
        start = sum(self.rows[:i]) // self.groups
        return full.narrow(1, start, self.rows[i] // self.groups).flatten(0, 1)


_NUMBER = re.compile(r"(?<=\.)\d+(?=\.)")


def expand(family: Family, m: ModelConfig, kind: str, shapes: dict[str, tuple[int, ...]]) -> list[Rule]:
    """The rules of every HF tensor of model `m` (its logical tensors `shapes`, in order) as model_type `kind`;
    a logical tensor the table has no place for is in none (to_hf names it)."""
    places = {}
    for hf, entry in family.names(m, kind).items():
        fused = entry if isinstance(entry, Fused) else Fused((entry,) if isinstance(entry, str) else entry)
        places.update({part: (hf, fused) for part in fused.parts})
    out: dict[str, Rule] = {}
    for name, shape in shapes.items():
        template, numbers = _NUMBER.sub("{}", name), _NUMBER.findall(name)
        module, _, leaf = template.rpartition(".")
        key, suffix = (template, "") if template in places else (module, f".{leaf}")
        if key not in places:
            continue
        hf_template, fused = places[key]
        hf = hf_template.format(*numbers) + suffix
        if hf not in out:
            parts = tuple(p.format(*numbers) + suffix for p in fused.parts)
            transpose = suffix == ".weight" and hf_template in family.transposed
            out[hf] = Rule(hf, parts, tuple(shapes[p][0] for p in parts), shape[1:], transpose, fused.groups)
    return list(out.values())


def positive_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value < float("inf")


class Fields:
    """config.json's values as a family reads them: each checked, a malformed one an HFMappingError naming it."""

    def __init__(self, config: dict[str, Any], where: str, name: str):
        self.config, self.where, self.name, self.kind = config, where, name, config.get("model_type")

    def get(self, key: str, default: Any = None) -> Any:
        return self.config.get(key, default)

    def error(self, text: str) -> HFMappingError:
        return HFMappingError(f"{self.where}: {text}")

    def refuse(self, key: str, why: str) -> HFMappingError:
        return self.error(f"{key}={self.config.get(key)!r} {why}")

    def size(self, key: str, default: int) -> int:
        value = self.config.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self.refuse(key, "must be a positive integer; fix it in config.json")
        return value

    def number(self, key: str, default: float) -> float:
        if not positive_number(value := self.config.get(key, default)):
            raise self.refuse(key, "must be a positive number; fix it in config.json")
        return value

    def flag(self, key: str, default: bool) -> bool:
        if not isinstance(value := self.config.get(key, default), bool):
            raise self.refuse(key, "must be true or false; fix it in config.json")
        return value
