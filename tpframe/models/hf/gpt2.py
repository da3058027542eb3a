"""GPT-2 (GPT2LMHeadModel): layernorm, learned positions, gelu (tanh approximation: "gelu_new") or relu, biases
everywhere, heads = kv_heads; q, k, v in one Conv1D (c_attn), every Conv1D weight stored [in, out]."""

from __future__ import annotations

from typing import Any

from tpframe.models.config import ModelConfig, ffn_hidden_size, head_dim, qkv_bias
from tpframe.models.hf.family import Family, Fields, HFMappingError

H = "transformer.h.{}."
NAMES = {
    "transformer.wte": "embedding",
    "transformer.wpe.weight": "position",
    H + "ln_1": "blocks.{}.norm1",
    H + "attn.c_attn": ("blocks.{}.attn.qkv.q", "blocks.{}.attn.qkv.k", "blocks.{}.attn.qkv.v"),
    H + "attn.c_proj": "blocks.{}.attn.proj",
    H + "ln_2": "blocks.{}.norm2",
    H + "mlp.c_fc": "blocks.{}.mlp.fc1",
    H + "mlp.c_proj": "blocks.{}.mlp.fc2",
    "transformer.ln_f": "final_norm",
    "lm_head": "head",
}
CONV1D = frozenset({H + "attn.c_attn", H + "attn.c_proj", H + "mlp.c_fc", H + "mlp.c_proj"})
_ACT = {"gelu": "gelu_new", "relu": "relu"}
_ACT_BACK = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "relu": "relu"}


def architecture(m: ModelConfig) -> str:
    if m.activation == "swiglu":
        raise HFMappingError(
            "model.activation=swiglu has no GPT-2 equivalent (layernorm + learned positions is GPT-2, whose MLP is "
            "not gated); use gelu or relu, or rmsnorm + rotary for Llama"
        )
    if not m.bias:
        raise HFMappingError(
            "model.bias=false has no GPT-2 equivalent (GPT-2 has biases in every linear layer and norm); set "
            "model.bias=true"
        )
    if not qkv_bias(m):
        raise HFMappingError(
            "model.qkv_bias=false has no GPT-2 equivalent (GPT-2 has biases in every linear layer); leave "
            "model.qkv_bias unset"
        )
    if head_dim(m) * m.heads != m.hidden or m.qk_norm:
        raise HFMappingError(
            f"model.{'qk_norm=true' if m.qk_norm else f'head_dim={m.head_dim}'} has no GPT-2 equivalent (GPT-2's "
            "heads split model.hidden, without norms); leave it unset"
        )
    if m.kv_heads not in (None, m.heads):
        raise HFMappingError(
            f"model.kv_heads={m.kv_heads} has no GPT-2 equivalent (GPT-2 has no grouped-query attention); set "
            f"model.kv_heads={m.heads} or use the Llama shape"
        )
    if m.moe_experts:
        raise HFMappingError(
            "a mixture of experts with layernorm + learned positions has no Hugging Face equivalent; Mixtral is "
            "rmsnorm + rotary + swiglu without biases"
        )
    if m.sliding_window is not None:
        raise HFMappingError(
            f"model.sliding_window={m.sliding_window} has no GPT-2 equivalent (GPT-2 attends to every earlier "
            "token); leave it unset, or use the Llama shape (written as Mistral)"
        )
    return "gpt2"


def to_config(m: ModelConfig, kind: str) -> dict[str, Any]:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "n_embd": m.hidden,
        "n_layer": m.layers,
        "n_head": m.heads,
        "n_inner": ffn_hidden_size(m),
        "n_positions": m.max_seq_len,
        "activation_function": _ACT[m.activation],
        "layer_norm_epsilon": m.norm_eps,
        "resid_pdrop": m.dropout,
        "embd_pdrop": m.dropout,
        "attn_pdrop": m.attention_dropout,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
    }


def from_config(r: Fields) -> dict[str, Any]:
    tied = r.flag("tie_word_embeddings", True)
    act = r.get("activation_function", "gelu_new")
    if act not in _ACT_BACK:
        raise r.refuse(
            "activation_function",
            "has no tpframe equivalent (tpframe's gelu is the tanh approximation, gelu_new; relu is relu)",
        )
    for key, ok in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("add_cross_attention", False),
    ):
        if r.get(key, ok) != ok:
            raise r.refuse(key, "has no tpframe equivalent")
    hidden, heads = r.size("n_embd", 768), r.size("n_head", 12)
    if hidden % heads:
        raise r.refuse("n_head", f"does not divide n_embd={hidden} (each head has n_embd/n_head dimensions)")
    ffn = r.size("n_inner", 4 * hidden) if r.get("n_inner") is not None else 4 * hidden
    return {
        "name": "gpt",
        "vocab_size": r.size("vocab_size", 50257),
        "hidden": hidden,
        "layers": r.size("n_layer", 12),
        "heads": heads,
        "kv_heads": heads,
        "ffn_hidden": ffn,
        "max_seq_len": r.size("n_positions", 1024),
        "norm": "layernorm",
        "norm_eps": r.number("layer_norm_epsilon", 1e-5),
        "position": "learned",
        "activation": _ACT_BACK[act],
        "bias": True,
        "tie_embeddings": tied,
    }


FAMILY = Family({"gpt2": "GPT-2"}, architecture, to_config, from_config, lambda m, kind: NAMES, CONV1D, "transformer.")
