"""Llama and its kin: rmsnorm, rotary (rotate-half, like ours: no permutation), SwiGLU, any GQA.

Llama: biases as attention_bias + mlp_bias, Llama 3.1's rotary scaling; Mistral: Llama with a sliding window (read;
a windowed Llama is written as one); Qwen2: biases on q/k/v only (model.qkv_bias); Qwen3: no biases, per-head
query/key RMSNorms (model.qk_norm), any head width; Phi-3: Llama with q, k, v in one tensor (qkv_proj) and the MLP's
gate and up in another (gate_up_proj), read only (written as Llama). A sliding window is model.sliding_window where
every layer has one (hf_window). The Mixture-of-experts kin (Mixtral, Qwen3-MoE) are tpframe/models/hf/moe.py.
"""

from __future__ import annotations

from typing import Any

from tpframe.models.config import ModelConfig, ffn_hidden_size, head_dim, qkv_bias
from tpframe.models.hf.family import Family, Fields, HFMappingError, positive_number

L, B = "model.layers.{}.", "blocks.{}."
NAMES = {
    "model.embed_tokens": "embedding",
    L + "input_layernorm": B + "norm1",
    L + "post_attention_layernorm": B + "norm2",
    L + "self_attn.q_proj": B + "attn.qkv.q",
    L + "self_attn.k_proj": B + "attn.qkv.k",
    L + "self_attn.v_proj": B + "attn.qkv.v",
    L + "self_attn.q_norm": B + "attn.q_norm",
    L + "self_attn.k_norm": B + "attn.k_norm",
    L + "self_attn.o_proj": B + "attn.proj",
    L + "mlp.gate_proj": B + "mlp.fc1.gate",
    L + "mlp.up_proj": B + "mlp.fc1.up",
    L + "mlp.down_proj": B + "mlp.fc2",
    "model.norm": "final_norm",
    "lm_head": "head",
}
PHI3 = {  # Phi-3's fused tensors, in place of Llama's separate ones
    **{k: v for k, v in NAMES.items() if not k.endswith(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))},
    L + "self_attn.qkv_proj": (B + "attn.qkv.q", B + "attn.qkv.k", B + "attn.qkv.v"),
    L + "mlp.gate_up_proj": (B + "mlp.fc1.gate", B + "mlp.fc1.up"),
}
KINDS = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "phi3": "Phi-3"}
# Llama 3.1's rotary scaling: config.json's keys (rope_type "llama3") and the model.* fields holding them
_LLAMA3_ROPE_KEYS = (
    ("factor", "rope_scaling_factor"),
    ("low_freq_factor", "rope_low_freq_factor"),
    ("high_freq_factor", "rope_high_freq_factor"),
    ("original_max_position_embeddings", "rope_original_max_seq_len"),
)


def check_activation(m: ModelConfig) -> None:
    if m.activation != "swiglu":
        raise HFMappingError(
            f"model.activation={m.activation} has no Llama equivalent (rmsnorm + rotary is Llama, whose MLP is "
            "SwiGLU); set model.activation=swiglu"
        )


def check_rope_scaling(m: ModelConfig, name: str) -> None:
    if m.rope_scaling_factor is not None:
        raise HFMappingError(
            f"model.rope_scaling_factor={m.rope_scaling_factor} has no {name} equivalent in tpframe's export (Llama "
            "3.1's rotary scaling is written for Llama); leave it unset, or use tpframe's own format"
        )


def architecture(m: ModelConfig) -> str:
    check_activation(m)
    if m.bias and not qkv_bias(m):
        raise HFMappingError(
            "model.bias=true with model.qkv_bias=false has no Hugging Face equivalent (Llama's attention_bias covers "
            "q, k, v and o together); leave model.qkv_bias unset"
        )
    if m.qk_norm and (m.bias or qkv_bias(m)):
        raise HFMappingError(
            "model.qk_norm=true maps to Qwen3, which has no biases; set model.bias=false and leave model.qkv_bias unset"
        )
    kind = "qwen3" if m.qk_norm else "qwen2" if qkv_bias(m) and not m.bias else "llama"
    if kind == "llama" and m.sliding_window is not None:  # Llama has no window: Mistral is Llama with one
        if m.bias:
            raise HFMappingError(
                f"model.sliding_window={m.sliding_window} with model.bias=true has no Hugging Face equivalent (a "
                "windowed Llama is Mistral, which has no biases); set model.bias=false, or leave "
                "model.sliding_window unset"
            )
        kind = "mistral"
    if kind != "llama":
        check_rope_scaling(m, KINDS[kind])
    return kind


def llama_like(m: ModelConfig) -> dict[str, Any]:
    """config.json's keys every Llama-shaped model has (Mixtral aside)."""
    scaled = m.rope_scaling_factor is not None
    llama3 = {"rope_type": "llama3", **{k: getattr(m, mine) for k, mine in _LLAMA3_ROPE_KEYS}}
    rope = llama3 if scaled else {"rope_type": "default"}
    return {
        "hidden_size": m.hidden,
        "num_hidden_layers": m.layers,
        "num_attention_heads": m.heads,
        "num_key_value_heads": m.kv_heads or m.heads,
        "head_dim": head_dim(m),
        "intermediate_size": ffn_hidden_size(m),
        "hidden_act": "silu",
        "max_position_embeddings": m.max_seq_len,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "rope_scaling": rope if scaled else None,  # transformers 4
        "rope_parameters": {**rope, "rope_theta": m.rope_theta},  # transformers >= 5
        "attention_dropout": m.attention_dropout,
    }


def qwen_window(m: ModelConfig) -> dict[str, Any]:
    """A Qwen's window: in every layer (max_window_layers 0) or in none."""
    windowed = m.sliding_window is not None
    return {
        "use_sliding_window": windowed,
        "sliding_window": m.sliding_window,
        "max_window_layers": 0 if windowed else m.layers,
    }


def to_config(m: ModelConfig, kind: str) -> dict[str, Any]:
    head = {"architectures": [f"{KINDS[kind].replace('-', '')}ForCausalLM"], "model_type": kind, **llama_like(m)}
    if kind == "mistral":  # Llama without biases, with a sliding window
        return {**head, "sliding_window": m.sliding_window}
    if kind == "qwen2":  # q/k/v biases are Qwen2's own: no bias options
        return {**head, **qwen_window(m)}
    if kind == "qwen3":  # per-head q/k norms are Qwen3's own
        return {**head, "attention_bias": False, **qwen_window(m)}
    return {**head, "attention_bias": m.bias, "mlp_bias": m.bias, "pretraining_tp": 1}


def from_config(r: Fields) -> dict[str, Any]:
    """The model.* values of a Llama-shaped config.json (the Mixture-of-experts kin's too, but their experts)."""
    tied = r.flag("tie_word_embeddings", False)
    if r.get("hidden_act", "silu") != "silu":
        raise r.refuse("hidden_act", "has no tpframe equivalent (tpframe's gated MLP is SwiGLU: silu)")
    window = hf_window(r.config, r.where)
    if r.kind == "llama" and r.get("attention_bias", False) != r.get("mlp_bias", False):
        raise r.refuse(
            "attention_bias",
            f"with mlp_bias={r.get('mlp_bias', False)!r} has no tpframe equivalent (model.bias puts biases on both "
            "or neither)",
        )
    key, rope = _rope(r)
    hidden, heads = r.size("hidden_size", 4096), r.size("num_attention_heads", 32)
    kv = r.size("num_key_value_heads", heads) if r.get("num_key_value_heads") is not None else heads
    d = _head_dim(r, hidden, heads, kv)
    r.size("max_position_embeddings", 2048)  # the context: checked here, chosen by the user (model.max_seq_len)
    theta = rope.get("rope_theta", r.get("rope_theta", 10000.0))
    if not positive_number(theta):
        raise r.error(f"rope_theta={theta!r} must be a positive number; fix it in config.json")
    fields = {
        "name": "gpt",
        "vocab_size": r.size("vocab_size", 32000),
        "hidden": hidden,
        "layers": r.size("num_hidden_layers", 32),
        "heads": heads,
        "kv_heads": kv,
        "ffn_hidden": r.size("intermediate_size", 11008),
        "norm": "rmsnorm",
        "norm_eps": r.number("rms_norm_eps", 1e-6),
        "position": "rotary",
        "rope_theta": theta,
        "activation": "swiglu",
        "bias": bool(r.get("attention_bias", False)),
        "tie_embeddings": tied,
    }
    if d * heads != hidden:  # heads of their own width (Qwen3, Mistral-Nemo)
        fields["head_dim"] = d
    if r.kind in ("qwen3", "qwen3_moe"):  # per-head query and key norms; attention_bias: biases on q, k, v and o alone
        if r.get("attention_bias", False):
            raise r.refuse(
                "attention_bias",
                f"in a {r.name} has no tpframe equivalent (tpframe's biases are on every linear layer, or on q/k/v "
                "alone); tpframe reads it without biases",
            )
        fields["qk_norm"] = True
    if rope.get("rope_type", rope.get("type", "default")) == "llama3":
        fields |= _llama3_rope_fields(rope, f"{r.where}: {key}")
    if r.kind == "qwen2":  # q/k/v biases only (its config has no bias options)
        fields["qkv_bias"] = True
    if window is not None:
        fields["sliding_window"] = window
    return fields


def _rope(r: Fields) -> tuple[str, dict[str, Any]]:
    """(the key, its value) of the rotary settings: transformers 5's rope_parameters, or 4's rope_scaling; only the
    whole rotary (partial_rotary_factor 1), unscaled or Llama 3.1's scaling in a Llama."""
    key = "rope_parameters" if r.get("rope_parameters") is not None else "rope_scaling"
    rope = r.get(key) or {}
    if not isinstance(rope, dict):
        raise r.refuse(key, "must be an object (or null); fix it in config.json")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    factors = (rope.get("partial_rotary_factor"), r.get("partial_rotary_factor"))  # transformers 5's place, 4's
    partial = next((v for v in factors if v is not None and v != 1), 1)
    if partial != 1:  # Phi-3.5/4-mini rotate part of each head
        raise r.error(
            f"partial_rotary_factor={partial!r} has no tpframe equivalent (tpframe's rotary turns every dimension "
            "of a head)"
        )
    if rope_type not in ("default", "llama3") or rope_type == "llama3" and r.kind != "llama":
        raise r.error(
            f"rope scaling {rope_type!r} has no tpframe equivalent (tpframe's rotary is unscaled, or Llama 3.1's "
            "'llama3' scaling in a Llama)"
        )
    return key, rope


def _head_dim(r: Fields, hidden: int, heads: int, kv: int) -> int:
    if r.get("head_dim") is None and hidden % heads:
        raise r.refuse(
            "num_attention_heads",
            f"does not divide hidden_size={hidden} (the head dim is hidden_size/num_attention_heads where "
            "config.json gives no head_dim)",
        )
    d = hidden // heads if r.get("head_dim") is None else r.size("head_dim", 128)
    if d % 2:
        raise r.refuse(
            "head_dim" if r.get("head_dim") is not None else "num_attention_heads",
            f"gives an odd head dim, {d}; rotary positions need an even one",
        )
    if heads % kv:
        raise r.refuse(
            "num_key_value_heads",
            f"does not divide num_attention_heads={heads} (grouped-query attention shares each key/value head "
            "among a whole group)",
        )
    return d


def _llama3_rope_fields(rope: dict[str, Any], where: str) -> dict[str, Any]:
    """Llama 3.1's rotary scaling as model.rope_* values."""
    out = {}
    for hf_key, mine in _LLAMA3_ROPE_KEYS:
        value = rope.get(hf_key)
        length = hf_key == "original_max_position_embeddings"
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1 if length else positive_number(value)
        if not ok:
            raise HFMappingError(
                f"{where}: the llama3 scaling's {hf_key}={value!r} must be a positive "
                f"{'integer' if length else 'number'}; fix it in config.json"
            )
        out[mine] = value
    if not out["rope_high_freq_factor"] > out["rope_low_freq_factor"]:
        raise HFMappingError(
            f"{where}: the llama3 scaling's high_freq_factor={out['rope_high_freq_factor']!r} must exceed its "
            f"low_freq_factor={out['rope_low_freq_factor']!r}; fix it in config.json"
        )
    return out


def hf_window(config: dict[str, Any], where: str) -> int | None:
    """The sliding window every layer of the directory's model attends within (model.sliding_window), or None, by
    transformers' rules: Mistral's is 4096 where config.json gives none; Mixtral's and Phi-3's only where given;
    a Qwen's only with use_sliding_window, and in Qwen2 and Qwen3 only in the layers from max_window_layers on (or
    those config.json's layer_types name). HFMappingError for a malformed window, or one only some layers have
    (tpframe's window is every layer's)."""
    kind = config.get("model_type")
    if kind in ("qwen2", "qwen3", "qwen3_moe"):  # Qwen keeps a window size it does not use
        use = config.get("use_sliding_window", False)
        if not isinstance(use, bool):
            raise HFMappingError(f"{where}: use_sliding_window={use!r} must be true or false; fix it in config.json")
        window = config.get("sliding_window", 4096) if use else None
        if use and window is None:
            raise HFMappingError(
                f"{where}: use_sliding_window=true without a sliding_window size; fix it in config.json"
            )
    elif kind in ("mistral", "mixtral", "phi3"):
        window = config.get("sliding_window", 4096 if kind == "mistral" else None)
    else:
        return None
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise HFMappingError(
            f"{where}: sliding_window={window!r} must be a positive integer (or null); fix it in config.json"
        )
    if kind in ("qwen2", "qwen3") and not _every_layer(config, where, window):
        return None
    return window


def _every_layer(config: dict[str, Any], where: str, window: int) -> bool:
    """Whether a Qwen2/Qwen3 window is in every layer (False: in none), by max_window_layers or layer_types."""
    layers, types = config.get("num_hidden_layers", 32), config.get("layer_types")
    if types is None:
        first = config.get("max_window_layers", 28)
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise HFMappingError(f"{where}: max_window_layers={first!r} must be an integer >= 0; fix it in config.json")
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers:
        raise HFMappingError(
            f"{where}: layer_types={types!r} must list one type per layer (num_hidden_layers={layers}); fix it in "
            "config.json"
        )
    windowed = sum(t == "sliding_attention" for t in types)
    if windowed not in (0, layers):
        raise HFMappingError(
            f"{where}: use_sliding_window=true gives a window of {window} to {windowed} of {layers} "
            "layers (max_window_layers / layer_types), which tpframe has no equivalent for (model.sliding_window "
            "is every layer's)"
        )
    return windowed == layers


FAMILY = Family(KINDS, architecture, to_config, from_config, lambda m, kind: PHI3 if kind == "phi3" else NAMES)
