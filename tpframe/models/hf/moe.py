"""Mixtral and Qwen3-MoE: Llama's (Qwen3's) attention with a mixture of experts in every block, no biases.

  Mixtral: a softmax router, the top k renormalized (tpframe's softmax router), no shared expert;
  Qwen3-MoE: Qwen3's attention with that router in every layer (decoder_sparse_step 1, no mlp_only_layers).
The experts are one tensor each (Mixtral's w1 gate, w3 up, w2 down; Qwen3-MoE's gate_proj, up_proj, down_proj), the
hub layout transformers 4 and 5 both load.
"""

from __future__ import annotations

from typing import Any

from tpframe.models.config import ModelConfig, head_dim, moe_ffn_hidden_size, qkv_bias
from tpframe.models.hf import llama
from tpframe.models.hf.family import Family, Fields, HFMappingError


def _experts(block: str, gate: str, up: str, down: str) -> dict[str, str]:
    """An HF layer's router and experts (under `block`), by tpframe's names."""
    x, y = f"model.layers.{{}}.{block}experts.{{}}.", "blocks.{}.mlp.experts.{}."
    return {
        f"model.layers.{{}}.{block}gate": "blocks.{}.mlp.router",  # both call the router "gate"
        x + gate: y + "fc1.gate",
        x + up: y + "fc1.up",
        x + down: y + "fc2",
    }


EXPERTS = {
    "mixtral": _experts("block_sparse_moe.", "w1", "w3", "w2"),
    "qwen3_moe": _experts("mlp.", "gate_proj", "up_proj", "down_proj"),
}
KINDS = {"mixtral": "Mixtral", "qwen3_moe": "Qwen3-MoE"}


def architecture(m: ModelConfig) -> str:
    llama.check_activation(m)
    kind = "qwen3_moe" if m.qk_norm else "mixtral"  # a mixture of experts with Qwen3's attention, or Llama's
    name = KINDS[kind]
    if m.bias or qkv_bias(m):
        key = "bias" if m.bias else "qkv_bias"
        raise HFMappingError(f"model.{key}=true has no {name} equivalent ({name} has no biases); set model.{key}=false")
    if m.moe_shared_ffn:
        raise HFMappingError(
            f"model.moe_shared_ffn={m.moe_shared_ffn} has no {name} equivalent ({name} has no shared expert); export "
            "without one, or use tpframe's own format"
        )
    if m.moe_router_score != "softmax" or m.moe_expert_bias:
        raise HFMappingError(
            "model.moe_router_score=sigmoid and model.moe_expert_bias (DeepSeek-V3's router) have no "
            f"{name} equivalent ({name} routes by softmax, without a bias); use tpframe's own format (python "
            "tools/checkpoint.py export)"
        )
    llama.check_rope_scaling(m, name)
    return kind


def to_config(m: ModelConfig, kind: str) -> dict[str, Any]:
    common = {"router_aux_loss_coef": m.moe_aux_loss, "output_router_logits": False}
    if kind == "qwen3_moe":  # every layer sparse, the top k renormalized; intermediate_size, the dense MLP's, unused
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            **llama.llama_like(m),
            "attention_bias": False,
            **llama.qwen_window(m),
            "num_experts": m.moe_experts,
            "num_experts_per_tok": m.moe_top_k,
            "moe_intermediate_size": moe_ffn_hidden_size(m),
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            **common,
        }
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": m.hidden,
        "num_hidden_layers": m.layers,
        "num_attention_heads": m.heads,
        "num_key_value_heads": m.kv_heads or m.heads,
        "head_dim": head_dim(m),
        "intermediate_size": moe_ffn_hidden_size(m),
        "num_local_experts": m.moe_experts,
        "num_experts_per_tok": m.moe_top_k,
        **common,
        "hidden_act": "silu",
        "max_position_embeddings": m.max_seq_len,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "sliding_window": m.sliding_window,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "attention_dropout": m.attention_dropout,
    }


def from_config(r: Fields) -> dict[str, Any]:
    """Llama's (Qwen3's) fields, then the experts: every block a mixture of SwiGLU MLPs, no dense MLP (ffn_hidden
    unused), no biases. transformers' defaults apply to what config.json leaves out."""
    fields = llama.from_config(r)
    if r.kind == "mixtral":
        return fields | _experts_fields(r, "num_local_experts", "intermediate_size", defaults=(8, 2, 14336))
    step, dense = r.get("decoder_sparse_step", 1), r.get("mlp_only_layers")
    if isinstance(step, bool) or step != 1:
        raise r.error(
            f"decoder_sparse_step={step!r} makes some layers dense MLPs, which tpframe has no equivalent for (every "
            "block of a tpframe MoE is a mixture of experts); tpframe reads Qwen3-MoE with decoder_sparse_step=1"
        )
    if dense not in (None, []):
        raise r.error(
            f"mlp_only_layers={dense!r} makes those layers dense MLPs, which tpframe has no equivalent for (every "
            "block of a tpframe MoE is a mixture of experts); tpframe reads Qwen3-MoE with mlp_only_layers=[]"
        )
    if r.get("norm_topk_prob", False) is not True:  # transformers' default: false
        raise r.error(
            f"norm_topk_prob={r.get('norm_topk_prob', False)!r} has no tpframe equivalent (tpframe's softmax router "
            "renormalizes the top k's weights to sum 1); tpframe reads Qwen3-MoE with norm_topk_prob=true"
        )
    both = r.get("num_experts"), r.get("num_local_experts")  # the hub's name, and transformers 5's
    if None not in both and both[0] != both[1]:
        raise r.error(
            f"num_experts={both[0]!r} with num_local_experts={both[1]!r}: transformers names one count both ways; "
            "keep one of them in config.json"
        )
    experts = "num_experts" if both[0] is not None else "num_local_experts"
    return fields | _experts_fields(r, experts, "moe_intermediate_size", defaults=(128, 8, 768))


def _experts_fields(r: Fields, experts_key: str, ffn_key: str, *, defaults: tuple[int, int, int]) -> dict[str, Any]:
    experts, top_k = r.size(experts_key, defaults[0]), r.size("num_experts_per_tok", defaults[1])
    if top_k > experts:
        raise r.error(f"num_experts_per_tok={top_k} exceeds {experts_key}={experts}; fix it in config.json")
    return {
        "moe_experts": experts,
        "moe_top_k": top_k,
        "moe_ffn_hidden": r.size(ffn_key, defaults[2]),
        "ffn_hidden": None,
        "bias": False,
    }


FAMILY = Family(KINDS, architecture, to_config, from_config, lambda m, kind: {**llama.NAMES, **EXPERTS[kind]})
