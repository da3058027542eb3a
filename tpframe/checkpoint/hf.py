"""Hugging Face interop, the generic part: a model's family (tpframe/models/hf: GPT-2, Llama, Mistral, Qwen2, Qwen3,
Phi-3 read, Mixtral, Qwen3-MoE; a plug-in model's own) turned into config.json and tensor names, and an HF directory
read (config.json, safetensors files or an index) as the logical tensors of tpframe.parallel.sharding.

    hf_config(m), to_hf(tensors, m)      # what an export writes (tpframe/checkpoint/hf_export.py)
    checkpoint.init_from=<HF dir>        # check_hf_dir in pre-flight, HFWeights at load time

`transformers` is never imported here.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from tpframe.checkpoint.finite import check_finite_weights, safetensors_items
from tpframe.models import BUILTIN, logical_shapes, resolve_builder
from tpframe.models.config import ModelConfig, ffn_hidden_size, head_dim, moe_ffn_hidden_size, qkv_bias
from tpframe.models.hf import FAMILIES
from tpframe.models.hf.family import Family, Fields, HFMappingError, Rule, expand

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
# buffers some HF checkpoints carry that are not weights (GPT-2's causal mask, rotary frequencies)
_BUFFERS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")
_FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")  # safetensors' names of the weight dtypes tpframe converts from
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# -- the family ------------------------------------------------------------------------------------


def family_of(m: ModelConfig) -> Family:
    """The family model `m` is written as (its ModelSpec's hf_family), or HFMappingError naming what has none."""
    choose = getattr(resolve_builder(m.name), "hf_family", None)
    if choose is None:
        raise HFMappingError(
            f"model.name={m.name!r} has no Hugging Face mapping: its ModelSpec names no hf_family "
            "(tpframe/models/protocol.py)"
        )
    return choose(m)


def hf_architecture(m: ModelConfig) -> str:
    """The config.json model_type `m` is written as ('gpt2', 'llama', 'mistral', 'qwen2', 'qwen3', 'mixtral',
    'qwen3_moe' for tpframe's GPT), or HFMappingError naming the option with no equivalent."""
    return family_of(m).architecture(m)


def reading_family(kind: Any, m: ModelConfig | None = None) -> Family | None:
    """The family that reads config.json's model_type `kind`: one of tpframe's GPT, or plug-in model `m`'s own."""
    if not isinstance(kind, str):
        return None
    if kind in FAMILIES:
        return FAMILIES[kind]
    if m is not None and m.name not in BUILTIN and kind in (family := family_of(m)).kinds:
        return family
    return None


def rules(m: ModelConfig, source: str | None = None) -> list[Rule]:
    """Every HF tensor of model `m` and the logical tensors it is made of; `source`: the model_type of the directory
    read, where its names differ from the export's (Phi-3's fused qkv_proj and gate_up_proj)."""
    family = family_of(m)
    kind = family.architecture(m)  # refuses what has no equivalent
    return expand(family, m, source if source in family.kinds else kind, logical_shapes(m))


def hf_config(m: ModelConfig, *, dtype: torch.dtype = torch.float32, eos_token_id: int | None = None) -> dict[str, Any]:
    """config.json for transformers (read by 4.x and 5.x) describing model `m`."""
    family = family_of(m)
    common = {
        "vocab_size": m.vocab_size,
        "tie_word_embeddings": m.tie_embeddings,
        "torch_dtype": DTYPES[dtype],
        "initializer_range": m.init_std,
        "use_cache": True,
        "bos_token_id": eos_token_id,
        "eos_token_id": eos_token_id,
    }
    return {**family.to_config(m, family.architecture(m)), **common}


def model_fields(config: dict[str, Any], where: str, m: ModelConfig | None = None) -> dict[str, Any]:
    """The `model.*` values an HF config.json describes (what the model must be to hold its weights; `m`: the run's
    model, whose own family reads a model_type tpframe's GPT does not); HFMappingError naming the first HF setting
    with no equivalent, or malformed (every size a positive integer, the heads dividing the width, ...)."""
    kind = config.get("model_type")
    family = reading_family(kind, m)
    if family is None:
        kinds = [repr(k) for k in FAMILIES]
        listed = f"{', '.join(kinds[:-1])} and {kinds[-1]}"
        raise HFMappingError(f"{where}: model_type={kind!r} has no tpframe mapping; tpframe reads {listed}")
    return family.from_config(Fields(config, where, family.kinds[kind]))


def hf_context(config: dict[str, Any]) -> int:
    """The longest context the directory's model was made for: max_position_embeddings (transformers' default 2048)."""
    return config.get("max_position_embeddings", 2048)


def check_model_matches(m: ModelConfig, config: dict[str, Any], where: str) -> None:
    """HFMappingError, one line naming every model.* value that differs from what config.json describes."""
    want = model_fields(config, where, m)
    want.setdefault("qkv_bias", want["bias"])  # a model without the key has model.bias's
    if m.head_dim is not None:  # compared where either side gives it (else both are hidden/heads)
        want.setdefault("head_dim", want["hidden"] // want["heads"])
    want.setdefault("qk_norm", False)
    want.setdefault("sliding_window", None)
    want.setdefault("moe_experts", 0)  # a dense directory needs a dense model; experts need Mixtral's router
    if want["moe_experts"]:
        want.update(moe_shared_ffn=0, moe_router_score="softmax", moe_expert_bias=False)
    if want["position"] == "rotary":  # an unscaled rotary model needs model.rope_scaling_factor unset
        want.setdefault("rope_scaling_factor", None)
    mine = {k: getattr(m, k) for k in want}
    mine["kv_heads"] = m.kv_heads or m.heads
    mine["qkv_bias"], mine["head_dim"] = qkv_bias(m), head_dim(m)
    mine["ffn_hidden"] = ffn_hidden_size(m) if want.get("ffn_hidden") is not None else None  # Mixtral: unused
    if "moe_ffn_hidden" in want:
        mine["moe_ffn_hidden"] = moe_ffn_hidden_size(m)
    diffs = []
    for key, value in want.items():
        if None not in (value, mine[key]) and (isinstance(value, float) or isinstance(mine[key], float)):
            same = abs(float(mine[key]) - float(value)) <= 1e-12 * max(1.0, abs(float(value)))
        else:
            same = mine[key] == value
        if not same:
            diffs.append(f"model.{key}={_yaml(mine[key])} but it needs {_yaml(value)}")
    if diffs:
        raise HFMappingError(
            f"{where} describes another model: "
            + "; ".join(diffs)
            + " (set these model.* values in the config or as overrides)"
        )


def _yaml(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (bool, type(None))) else str(value)


# -- the HF directory --------------------------------------------------------------------------------


def is_hf_dir(path: str | Path) -> bool:
    """A directory with a config.json that is not a tpframe checkpoint (its meta.json wins: one answer everywhere)."""
    return Path(path).is_dir() and (Path(path) / CONFIG).is_file() and not (Path(path) / "meta.json").exists()


def read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads((path / CONFIG).read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise HFMappingError(f"{path / CONFIG} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise HFMappingError(f"{path / CONFIG} must hold a JSON object")
    return config


def weight_files(path: Path) -> dict[str, Path]:
    """{HF tensor name: the safetensors file holding it} of an HF directory (one file or an index), every file's
    header read: HFMappingError naming the file that is missing, unreadable or not holding what the index says.
    model.safetensors wins over an index beside it, as in transformers (an export --force onto a sharded model)."""
    index = path / WEIGHTS_INDEX
    if index.is_file() and not (path / WEIGHTS).is_file():
        files = _index_files(index)
        for file in sorted(set(files.values())):
            with safetensors_file(file) as f:
                held = set(f.keys())
            missing = sorted(name for name, where in files.items() if where == file and name not in held)
            if missing:
                raise HFMappingError(
                    f"{index} puts {missing[0]!r} in {file.name}, which does not hold it "
                    f"({len(missing)} such); the index belongs to other files: download them again"
                )
    elif (path / WEIGHTS).is_file():
        with safetensors_file(path / WEIGHTS) as f:
            files = {name: path / WEIGHTS for name in f.keys()}
    else:
        raise HFMappingError(
            f"{path} has a {CONFIG} but no {WEIGHTS} (or {WEIGHTS_INDEX}); tpframe reads "
            "safetensors weights: save the model with save_pretrained(..., safe_serialization=True)"
        )
    return files


def _index_files(index: Path) -> dict[str, Path]:
    """The index's weight_map as {tensor name: file}, each file present."""
    try:
        content = json.loads(index.read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise HFMappingError(f"{index} is not valid JSON ({e}); download or save the model again") from None
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) and v for v in weight_map.values()):
        raise HFMappingError(
            f'{index} has no "weight_map" object of tensor name: file name; download or save the model again'
        )
    files = {name: index.parent / file for name, file in weight_map.items()}
    for file in sorted(set(files.values())):
        if not file.is_file():
            raise HFMappingError(f"{index} names {file.name}, which is missing; download or save the model again")
    return files


@contextlib.contextmanager
def safetensors_file(file: Path) -> Iterator[Any]:
    """safe_open(file), or HFMappingError when it is not a readable safetensors file (truncated, not one)."""
    from safetensors import safe_open

    try:
        handle = safe_open(str(file), framework="pt")
    except Exception as e:  # noqa: BLE001 - the Rust side raises its own types
        raise HFMappingError(f"{file} is not a readable safetensors file ({e}); download or save it again") from None
    with handle as f:
        yield f


class HFWeights(Mapping):
    """The logical tensors of an HF directory, read lazily (one HF tensor at a time, on the CPU):
    what `copy_logical_tensors` loads into any TP layout without holding the whole model in memory."""

    def __init__(self, path: str | Path, m: ModelConfig):
        self.path, self.m = Path(path), m
        self.files = weight_files(self.path)
        self.kind = read_config(self.path).get("model_type")  # its names (Phi-3 fuses some tensors)
        self.rules = rules(m, self.kind)
        bare = family_of(m).bare_prefix  # GPT-2 checkpoints are saved with and without `transformer.`
        self.names = {
            r.hf: next((n for n in (r.hf, r.hf.removeprefix(bare)) if n in self.files), None) for r in self.rules
        }
        self.part_of = {p: (r, i) for r in self.rules for i, p in enumerate(r.parts)}
        self._cache: tuple[str, torch.Tensor] | None = None

    def check(self, where: str | None = None) -> None:
        """Every tensor present with its shape and a floating-point dtype, nothing unknown (pre-flight: headers only,
        no data read); errors begin with `where` (default: the init_from setting)."""
        where = where or f"checkpoint.init_from={str(self.path)!r}"
        missing = [hf for hf, stored in self.names.items() if stored is None]
        if missing:
            raise HFMappingError(
                f"{where}: no tensor {missing[0]!r} in its safetensors ({len(missing)} missing); "
                "it does not hold the model its config.json describes"
            )
        for r in self.rules:
            stored = self.names[r.hf]
            with safetensors_file(self.files[stored]) as f:
                part = f.get_slice(stored)
                shape, dtype = tuple(part.get_shape()), part.get_dtype()
            if shape != r.shape:
                raise HFMappingError(f"{where}: {stored} has shape {shape}, config.json implies {r.shape}")
            if dtype not in _FLOAT_DTYPES:
                raise HFMappingError(
                    f"{where}: {stored} is {dtype}; tpframe reads {', '.join(_FLOAT_DTYPES)} weights "
                    "(not quantized ones): save the model in one of them"
                )
        known = set(self.names.values()) | {"lm_head.weight"}  # a tied GPT-2 may store its head too
        extra = sorted(n for n in self.files if n not in known and not n.endswith(_BUFFERS))
        if extra:
            raise HFMappingError(
                f"{where}: tensors tpframe's {hf_architecture(self.m)} has no place for: "
                f"{extra[:3]}{' ...' if len(extra) > 3 else ''}"
            )

    def _read(self, hf: str) -> torch.Tensor:
        if self._cache is None or self._cache[0] != hf:
            stored = self.names[hf]
            with safetensors_file(self.files[stored]) as f:
                self._cache = (hf, f.get_tensor(stored))
        return self._cache[1]

    def __getitem__(self, name: str) -> torch.Tensor:
        rule, i = self.part_of[name]
        return rule.part(self._read(rule.hf), i)

    def __iter__(self) -> Iterator[str]:
        return iter(self.part_of)

    def __len__(self) -> int:
        return len(self.part_of)


def check_hf_dir(m: ModelConfig, path: str | Path) -> None:
    """Pre-flight for `checkpoint.init_from=<HF dir>`: config.json equals the model section, weights complete and
    finite."""
    path = Path(path)
    where = f"checkpoint.init_from={str(path)!r}: its {CONFIG}"
    config = read_config(path)
    check_model_matches(m, config, where)
    weights = HFWeights(path, m)
    weights.check()  # the model section describes the HF model: now its tensors and shapes
    check_finite_weights(
        safetensors_items(sorted(set(weights.files.values())), set(weights.names.values())),
        f"checkpoint.init_from={str(path)!r}",
    )


def to_hf(tensors: Mapping[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    """Logical tensors (tpframe names, full) -> HF tensors, contiguous, every logical tensor used once."""
    out, used = {}, set()
    for r in rules(m):
        out[r.hf] = r.join([tensors[p] for p in r.parts])
        used.update(r.parts)
    unused = sorted(set(tensors) - used)
    if unused:
        raise HFMappingError(
            f"tensors with no Hugging Face place: {unused[:3]}; was the checkpoint written by "
            "another version of tpframe's GPT?"
        )
    return out
