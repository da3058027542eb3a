"""The Hugging Face families tpframe's GPT maps to, one module each (family.py says what a family is); a plug-in
model names its own (ModelSpec.hf_family, examples/gpt_neox.py). tpframe/checkpoint/hf.py reads and writes them."""

from __future__ import annotations

from tpframe.models.config import ModelConfig
from tpframe.models.hf import gpt2, llama, moe
from tpframe.models.hf.family import Family, HFMappingError

# config.json's model_type -> the family reading it (tpframe's GPT)
FAMILIES: dict[str, Family] = {kind: f for f in (gpt2.FAMILY, llama.FAMILY, moe.FAMILY) for kind in f.kinds}
FAMILIES["phi3"] = FAMILIES.pop("phi3")  # read only (written as Llama): named last


def gpt_family(m: ModelConfig) -> Family:
    """The family tpframe's GPT `m` is written as: GPT-2 is layernorm + learned positions, Llama rmsnorm + rotary."""
    if (m.norm, m.position) == ("layernorm", "learned"):
        return gpt2.FAMILY
    if (m.norm, m.position) == ("rmsnorm", "rotary"):
        return moe.FAMILY if m.moe_experts else llama.FAMILY
    raise HFMappingError(
        f"model.norm={m.norm} with model.position={m.position} has no Hugging Face equivalent: GPT-2 is layernorm + "
        "learned, Llama is rmsnorm + rotary"
    )
