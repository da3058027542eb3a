"""Hugging Face interop: tpframe's GPT as transformers' GPT-2, Llama, Mistral, Qwen2, Qwen3, Mixtral or Qwen3-MoE,
both ways (and Phi-3 read).

    export_hf(step_dir, out_dir)        # config.json + model.safetensors + tokenizer files (when known)
    AutoModelForCausalLM.from_pretrained(out_dir)
    checkpoint.init_from=<HF dir>       # check_hf_dir in pre-flight, HFWeights at load time

The architectures and what fixes them (every other combination has no HF equivalent):
  GPT-2: layernorm, learned positions, gelu (tanh approximation: "gelu_new") or relu, biases, heads = kv_heads;
  Llama: rmsnorm, rotary (rotate-half, like ours), swiglu, any GQA, biases as attention_bias + mlp_bias; Mistral
      is Llama (read; written as Llama, or as Mistral with a sliding window);
  Qwen2: Llama with biases on the q/k/v projections only (model.bias=false, model.qkv_bias=true);
  Phi-3 (Phi-3 mini/medium, Phi-4): Llama with q, k, v in one tensor (qkv_proj) and the MLP's gate and up in
      another (gate_up_proj), read (written as Llama), its rotary whole (partial_rotary_factor 1);
  a sliding window (Mistral 7B v0.1's, Phi-3-mini's, a Qwen's use_sliding_window) is model.sliding_window, read
      and written where every layer has it (hf_window);
  Qwen3: Llama without biases, with per-head query/key RMSNorms (model.qk_norm) and any head width (model.head_dim);
  Mixtral: Llama's attention with a mixture of experts (model.moe_experts), no biases; the experts are
      written one tensor each (w1 gate, w3 up, w2 down), the hub layout transformers 4 and 5 both load;
  Qwen3-MoE: Qwen3's attention with Mixtral's router (softmax, top k renormalized: norm_topk_prob) in every layer
      (decoder_sparse_step 1, no mlp_only_layers), no shared expert; experts one tensor each (gate_proj, up_proj,
      down_proj), as Mixtral's.
The weights are the logical tensors of tpframe.parallel.sharding, renamed: `Rule(hf, parts, transpose)`
says the HF tensor is the logical `parts` concatenated along dim 0 (GPT-2's fused c_attn is q, k, v),
transposed for GPT-2's Conv1D layers ([in, out] weights). Rotary needs no permutation: HF Llama's q/k
rows are already in rotate-half order. `transformers` is never imported here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tpframe.data.corpus import EOD_BYTE
from tpframe.data.tokenizer import BYTE_SOURCES, ByteTokenizer, first_path
from tpframe.errors import ConfigError
from tpframe.models.config import ModelConfig, ffn_hidden_size, head_dim, moe_ffn_hidden_size, qkv_bias
from tpframe.paths import link_target, recorded_path, refuse_existing, temporary_name

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# export_hf's own file, {"exported_by": "tpframe", ...}: what tells an earlier export (which a new one may replace) from
# any other model directory. Not in the weights' header: safetensors writes its keys in no fixed order, and the export
# is byte-for-byte the same every time
MARKER = "tpframe_export.json"
EXPORT_FILES = (CONFIG, WEIGHTS, *TOKENIZER_FILES, MARKER)  # all that export_hf writes
BYTES = {"kind": "bytes", "eot_id": EOD_BYTE}
# buffers some HF checkpoints carry that are not weights (GPT-2's causal mask, rotary frequencies)
_BUFFERS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")
_FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")  # safetensors' names of the weight dtypes tpframe converts from


class HFMappingError(ConfigError):
    """A model, config.json or weights file with no equivalent on the other side, explained in one line."""


@dataclass(frozen=True)
class Rule:
    hf: str  # the HF tensor's name
    parts: tuple[str, ...]  # logical tensors concatenated along dim 0 to make it
    transpose: bool = False  # GPT-2 Conv1D stores [in, out]


# -- which architecture ---------------------------------------------------------------------------


# each architecture's name in messages
_NAMES = {
    "gpt2": "GPT-2",
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "mixtral": "Mixtral",
    "qwen3_moe": "Qwen3-MoE",
}


def hf_architecture(m: ModelConfig) -> str:
    """'gpt2', 'llama', 'mistral', 'qwen2', 'qwen3', 'mixtral' or 'qwen3_moe' for a model config, or HFMappingError
    naming the option with no equivalent."""
    if m.name != "gpt":
        raise HFMappingError(f"model.name={m.name!r} has no Hugging Face mapping: only the built-in 'gpt' exports")
    if (m.norm, m.position) == ("layernorm", "learned"):
        if m.activation == "swiglu":
            raise HFMappingError(
                "model.activation=swiglu has no GPT-2 equivalent (layernorm + learned positions is "
                "GPT-2, whose MLP is not gated); use gelu or relu, or rmsnorm + rotary for Llama"
            )
        if not m.bias:
            raise HFMappingError(
                "model.bias=false has no GPT-2 equivalent (GPT-2 has biases in every linear layer "
                "and norm); set model.bias=true"
            )
        if not qkv_bias(m):
            raise HFMappingError(
                "model.qkv_bias=false has no GPT-2 equivalent (GPT-2 has biases in every linear "
                "layer); leave model.qkv_bias unset"
            )
        if head_dim(m) * m.heads != m.hidden or m.qk_norm:
            raise HFMappingError(
                f"model.{'qk_norm=true' if m.qk_norm else f'head_dim={m.head_dim}'} has no GPT-2 "
                "equivalent (GPT-2's heads split model.hidden, without norms); leave it unset"
            )
        if m.kv_heads not in (None, m.heads):
            raise HFMappingError(
                f"model.kv_heads={m.kv_heads} has no GPT-2 equivalent (GPT-2 has no grouped-query "
                f"attention); set model.kv_heads={m.heads} or use the Llama shape"
            )
        if m.moe_experts:
            raise HFMappingError(
                "a mixture of experts with layernorm + learned positions has no Hugging Face "
                "equivalent; Mixtral is rmsnorm + rotary + swiglu without biases"
            )
        if m.sliding_window is not None:
            raise HFMappingError(
                f"model.sliding_window={m.sliding_window} has no GPT-2 equivalent (GPT-2 attends to "
                "every earlier token); leave it unset, or use the Llama shape (written as Mistral)"
            )
        return "gpt2"
    if (m.norm, m.position) == ("rmsnorm", "rotary"):
        if m.activation != "swiglu":
            raise HFMappingError(
                f"model.activation={m.activation} has no Llama equivalent (rmsnorm + rotary is Llama, "
                "whose MLP is SwiGLU); set model.activation=swiglu"
            )
        moe = "Qwen3-MoE" if m.qk_norm else "Mixtral"  # a mixture of experts with Qwen3's attention, or Llama's
        if m.moe_experts and (m.bias or qkv_bias(m)):
            raise HFMappingError(
                f"model.{'bias' if m.bias else 'qkv_bias'}=true has no {moe} equivalent ({moe} has "
                f"no biases); set model.{'bias' if m.bias else 'qkv_bias'}=false"
            )
        if m.bias and not qkv_bias(m):
            raise HFMappingError(
                "model.bias=true with model.qkv_bias=false has no Hugging Face equivalent (Llama's "
                "attention_bias covers q, k, v and o together); leave model.qkv_bias unset"
            )
        if m.moe_shared_ffn:
            raise HFMappingError(
                f"model.moe_shared_ffn={m.moe_shared_ffn} has no {moe} equivalent ({moe} has no "
                "shared expert); export without one, or use tpframe's own format"
            )
        if m.moe_experts and (m.moe_router_score != "softmax" or m.moe_expert_bias):
            raise HFMappingError(
                "model.moe_router_score=sigmoid and model.moe_expert_bias (DeepSeek-V3's router) have "
                f"no {moe} equivalent ({moe} routes by softmax, without a bias); use tpframe's own "
                "format (python tools/checkpoint.py export)"
            )
        if m.qk_norm and (m.bias or qkv_bias(m)):
            raise HFMappingError(
                "model.qk_norm=true maps to Qwen3, which has no biases; set model.bias=false and "
                "leave model.qkv_bias unset"
            )
        arch = (
            "qwen3_moe"
            if m.moe_experts and m.qk_norm
            else "mixtral"
            if m.moe_experts
            else "qwen3"
            if m.qk_norm
            else "qwen2"
            if qkv_bias(m) and not m.bias
            else "llama"
        )
        if arch == "llama" and m.sliding_window is not None:  # Llama has no window: Mistral is Llama with one
            if m.bias:
                raise HFMappingError(
                    f"model.sliding_window={m.sliding_window} with model.bias=true has no Hugging "
                    "Face equivalent (a windowed Llama is Mistral, which has no biases); set "
                    "model.bias=false, or leave model.sliding_window unset"
                )
            arch = "mistral"
        if arch != "llama" and m.rope_scaling_factor is not None:
            raise HFMappingError(
                f"model.rope_scaling_factor={m.rope_scaling_factor} has no {_NAMES[arch]} "
                "equivalent in tpframe's export (Llama 3.1's rotary scaling is written for Llama); "
                "leave it unset, or use tpframe's own format"
            )
        return arch
    raise HFMappingError(
        f"model.norm={m.norm} with model.position={m.position} has no Hugging Face equivalent: GPT-2 is layernorm + "
        "learned, Llama is rmsnorm + rotary"
    )


def _heads(m: ModelConfig) -> tuple[int, int, int]:
    """(heads, kv_heads, head_dim)."""
    return m.heads, m.kv_heads or m.heads, head_dim(m)


def rules(m: ModelConfig, source: str | None = None) -> list[Rule]:
    """Every HF tensor of the model and the logical tensors it is made of; `source`: the model_type of the directory
    read, where its names differ from the export's (Phi-3's fused qkv_proj and gate_up_proj)."""
    arch = hf_architecture(m)
    fused = source == "phi3"  # q, k, v in one tensor, and the MLP's gate and up in one
    out: list[Rule] = []
    if arch == "gpt2":
        t = "transformer."
        out += [Rule(t + "wte.weight", ("embedding.weight",)), Rule(t + "wpe.weight", ("position",))]
        for i in range(m.layers):
            b, h = f"blocks.{i}.", f"{t}h.{i}."
            for leaf in ("weight", "bias"):
                out += [
                    Rule(h + "ln_1." + leaf, (b + "norm1." + leaf,)),
                    Rule(h + "attn.c_attn." + leaf, tuple(f"{b}attn.qkv.{p}.{leaf}" for p in "qkv"), leaf == "weight"),
                    Rule(h + "attn.c_proj." + leaf, (b + "attn.proj." + leaf,), leaf == "weight"),
                    Rule(h + "ln_2." + leaf, (b + "norm2." + leaf,)),
                    Rule(h + "mlp.c_fc." + leaf, (b + "mlp.fc1." + leaf,), leaf == "weight"),
                    Rule(h + "mlp.c_proj." + leaf, (b + "mlp.fc2." + leaf,), leaf == "weight"),
                ]
        out += [Rule(t + "ln_f.weight", ("final_norm.weight",)), Rule(t + "ln_f.bias", ("final_norm.bias",))]
    else:
        out.append(Rule("model.embed_tokens.weight", ("embedding.weight",)))
        leaves = ("weight", "bias") if m.bias else ("weight",)
        qkv_leaves = ("weight", "bias") if qkv_bias(m) else ("weight",)
        for i in range(m.layers):
            b, h = f"blocks.{i}.", f"model.layers.{i}."
            out += [
                Rule(h + "input_layernorm.weight", (b + "norm1.weight",)),
                Rule(h + "post_attention_layernorm.weight", (b + "norm2.weight",)),
            ]
            for leaf in qkv_leaves:
                out += (
                    [Rule(f"{h}self_attn.qkv_proj.{leaf}", tuple(f"{b}attn.qkv.{p}.{leaf}" for p in "qkv"))]
                    if fused
                    else [Rule(f"{h}self_attn.{p}_proj.{leaf}", (f"{b}attn.qkv.{p}.{leaf}",)) for p in "qkv"]
                )
            if m.qk_norm:
                out += [Rule(f"{h}self_attn.{p}_norm.weight", (f"{b}attn.{p}_norm.weight",)) for p in "qk"]
            for leaf in leaves:
                out.append(Rule(f"{h}self_attn.o_proj.{leaf}", (f"{b}attn.proj.{leaf}",)))
                if not m.moe_experts:
                    out += [
                        *(
                            [Rule(f"{h}mlp.gate_up_proj.{leaf}", (f"{b}mlp.fc1.gate.{leaf}", f"{b}mlp.fc1.up.{leaf}"))]
                            if fused
                            else [
                                Rule(f"{h}mlp.gate_proj.{leaf}", (f"{b}mlp.fc1.gate.{leaf}",)),
                                Rule(f"{h}mlp.up_proj.{leaf}", (f"{b}mlp.fc1.up.{leaf}",)),
                            ]
                        ),
                        Rule(f"{h}mlp.down_proj.{leaf}", (f"{b}mlp.fc2.{leaf}",)),
                    ]
            if m.moe_experts:
                out += _expert_rules(arch, h, b, m.moe_experts)
        out.append(Rule("model.norm.weight", ("final_norm.weight",)))
    if not m.tie_embeddings:
        out.append(Rule("lm_head.weight", ("head.weight",)))
    return out


# an HF layer's MoE: its prefix, then each expert's names for tpframe's gate, up and down projections (_EXPERT_PARTS)
_EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe.", ("w1", "w3", "w2")),
    "qwen3_moe": ("mlp.", ("gate_proj", "up_proj", "down_proj")),
}
_EXPERT_PARTS = ("fc1.gate", "fc1.up", "fc2")


def _expert_rules(arch: str, h: str, b: str, experts: int) -> list[Rule]:
    """The MoE of HF layer `h` (tpframe block `b`): its router, then each expert's tensors, one each."""
    block, names = _EXPERT_NAMES[arch]
    out = [Rule(f"{h}{block}gate.weight", (b + "mlp.router.weight",))]  # both call the router "gate"
    for e in range(experts):
        x, y = f"{h}{block}experts.{e}.", f"{b}mlp.experts.{e}."
        out += [Rule(f"{x}{name}.weight", (y + part + ".weight",)) for name, part in zip(names, _EXPERT_PARTS)]
    return out


def logical_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The global shape of every logical tensor of tpframe's GPT with config `m` (vocabulary unpadded)."""
    heads, kv, d = _heads(m)
    h, ffn, v = m.hidden, ffn_hidden_size(m), m.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"embedding.weight": (v, h)}
    if m.position == "learned":
        shapes["position"] = (m.max_seq_len, h)
    norm_leaves = ("weight", "bias") if m.bias and m.norm == "layernorm" else ("weight",)
    leaves = ("weight", "bias") if m.bias else ("weight",)
    mlp_in = (("fc1.gate", ffn), ("fc1.up", ffn)) if m.activation == "swiglu" else (("fc1", ffn),)
    for i in range(m.layers):
        b = f"blocks.{i}."
        for leaf in norm_leaves:
            shapes[f"{b}norm1.{leaf}"] = shapes[f"{b}norm2.{leaf}"] = (h,)
        if m.qk_norm:
            shapes[f"{b}attn.q_norm.weight"] = shapes[f"{b}attn.k_norm.weight"] = (d,)
        linears = (
            ("attn.qkv.q", heads * d, h),
            ("attn.qkv.k", kv * d, h),
            ("attn.qkv.v", kv * d, h),
            ("attn.proj", h, heads * d),
            *((f"mlp.{n}", f, h) for n, f in mlp_in),
            ("mlp.fc2", h, ffn),
        )
        if m.moe_experts:  # the router and bias-free experts instead of the MLP
            f = moe_ffn_hidden_size(m)
            linears = linears[:4]
            shapes[f"{b}mlp.router.weight"] = (m.moe_experts, h)
            for e in range(m.moe_experts):
                for name, shape in (("fc1.gate", (f, h)), ("fc1.up", (f, h)), ("fc2", (h, f))):
                    shapes[f"{b}mlp.experts.{e}.{name}.weight"] = shape
        for name, out_dim, in_dim in linears:
            shapes[f"{b}{name}.weight"] = (out_dim, in_dim)
            if qkv_bias(m) if name.startswith("attn.qkv.") else "bias" in leaves:
                shapes[f"{b}{name}.bias"] = (out_dim,)
    for leaf in norm_leaves:
        shapes[f"final_norm.{leaf}"] = (h,)
    if not m.tie_embeddings:
        shapes["head.weight"] = (v, h)
    return shapes


def hf_shapes(m: ModelConfig, source: str | None = None) -> dict[str, tuple[int, ...]]:
    logical = logical_shapes(m)
    out = {}
    for r in rules(m, source):
        first = logical[r.parts[0]]
        shape = (sum(logical[p][0] for p in r.parts),) + first[1:]
        out[r.hf] = tuple(reversed(shape)) if r.transpose else shape
    return out


# -- config.json ------------------------------------------------------------------------------------

_GPT2_ACT = {"gelu": "gelu_new", "relu": "relu"}
_GPT2_ACT_BACK = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "relu": "relu"}
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_config(m: ModelConfig, *, dtype: torch.dtype = torch.float32, eos_token_id: int | None = None) -> dict[str, Any]:
    """config.json for transformers (read by 4.x and 5.x) describing tpframe's model `m`."""
    arch = hf_architecture(m)
    heads, kv, d = _heads(m)
    common = {
        "vocab_size": m.vocab_size,
        "tie_word_embeddings": m.tie_embeddings,
        "torch_dtype": _DTYPES[dtype],
        "initializer_range": m.init_std,
        "use_cache": True,
        "bos_token_id": eos_token_id,
        "eos_token_id": eos_token_id,
    }
    if arch == "gpt2":
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "n_embd": m.hidden,
            "n_layer": m.layers,
            "n_head": heads,
            "n_inner": ffn_hidden_size(m),
            "n_positions": m.max_seq_len,
            "activation_function": _GPT2_ACT[m.activation],
            "layer_norm_epsilon": m.norm_eps,
            "resid_pdrop": m.dropout,
            "embd_pdrop": m.dropout,
            "attn_pdrop": m.attention_dropout,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            **common,
        }
    if arch == "mixtral":
        return {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "hidden_size": m.hidden,
            "num_hidden_layers": m.layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "head_dim": d,
            "intermediate_size": moe_ffn_hidden_size(m),
            "num_local_experts": m.moe_experts,
            "num_experts_per_tok": m.moe_top_k,
            "router_aux_loss_coef": m.moe_aux_loss,
            "output_router_logits": False,
            "hidden_act": "silu",
            "max_position_embeddings": m.max_seq_len,
            "rms_norm_eps": m.norm_eps,
            "rope_theta": m.rope_theta,
            "sliding_window": m.sliding_window,
            "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
            "attention_dropout": m.attention_dropout,
            **common,
        }
    scaled = m.rope_scaling_factor is not None
    rope = (
        {"rope_type": "default"}
        if not scaled
        else {"rope_type": "llama3", **{hf_key: getattr(m, mine) for hf_key, mine in _LLAMA3_ROPE_KEYS}}
    )
    llama_like = {
        "hidden_size": m.hidden,
        "num_hidden_layers": m.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": d,
        "intermediate_size": ffn_hidden_size(m),
        "hidden_act": "silu",
        "max_position_embeddings": m.max_seq_len,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "rope_scaling": rope if scaled else None,  # transformers 4
        "rope_parameters": {**rope, "rope_theta": m.rope_theta},  # transformers >= 5
        "attention_dropout": m.attention_dropout,
    }
    if arch == "mistral":  # Llama without biases, with a sliding window
        return {
            "architectures": ["MistralForCausalLM"],
            "model_type": "mistral",
            **llama_like,
            "sliding_window": m.sliding_window,
            **common,
        }
    # Qwen: a window in every layer (max_window_layers 0) or in none
    window = {
        "use_sliding_window": m.sliding_window is not None,
        "sliding_window": m.sliding_window,
        "max_window_layers": 0 if m.sliding_window is not None else m.layers,
    }
    if arch == "qwen2":  # q/k/v biases are Qwen2's own: no bias options
        return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **llama_like, **window, **common}
    qwen3 = {**llama_like, "attention_bias": False, **window}
    if arch == "qwen3":  # per-head q/k norms are Qwen3's own
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **qwen3, **common}
    if arch == "qwen3_moe":  # every layer sparse, the top k renormalized (tpframe's softmax router); intermediate_size,
        # the dense MLP's, is unused
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            **qwen3,
            "num_experts": m.moe_experts,
            "num_experts_per_tok": m.moe_top_k,
            "moe_intermediate_size": moe_ffn_hidden_size(m),
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "router_aux_loss_coef": m.moe_aux_loss,
            "output_router_logits": False,
            **common,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **llama_like,
        "attention_bias": m.bias,
        "mlp_bias": m.bias,
        "pretraining_tp": 1,
        **common,
    }


def model_fields(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The `model.*` values an HF config.json describes (what tpframe's GPT must be to hold its weights);
    HFMappingError naming the first HF setting tpframe has no equivalent for, or that is malformed (every size a
    positive integer, the heads dividing the width, ...)."""
    kind = config.get("model_type")

    def refuse(key: str, why: str) -> HFMappingError:
        return HFMappingError(f"{where}: {key}={config.get(key)!r} {why}")

    def size(key: str, default: int) -> int:
        value = config.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise refuse(key, "must be a positive integer; fix it in config.json")
        return value

    def number(key: str, default: float) -> float:
        if not _positive_number(value := config.get(key, default)):
            raise refuse(key, "must be a positive number; fix it in config.json")
        return value

    if kind not in ("gpt2", "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "phi3"):
        raise HFMappingError(
            f"{where}: model_type={kind!r} has no tpframe mapping; tpframe reads 'gpt2', 'llama', "
            "'mistral', 'qwen2', 'qwen3', 'mixtral', 'qwen3_moe' and 'phi3'"
        )
    tied = config.get("tie_word_embeddings", kind == "gpt2")
    if not isinstance(tied, bool):
        raise refuse("tie_word_embeddings", "must be true or false; fix it in config.json")
    if kind == "gpt2":
        act = config.get("activation_function", "gelu_new")
        if act not in _GPT2_ACT_BACK:
            raise refuse(
                "activation_function",
                "has no tpframe equivalent (tpframe's gelu is the tanh approximation, gelu_new; relu is relu)",
            )
        for key, ok in (
            ("scale_attn_weights", True),
            ("scale_attn_by_inverse_layer_idx", False),
            ("add_cross_attention", False),
        ):
            if config.get(key, ok) != ok:
                raise refuse(key, "has no tpframe equivalent")
        hidden, heads = size("n_embd", 768), size("n_head", 12)
        if hidden % heads:
            raise refuse("n_head", f"does not divide n_embd={hidden} (each head has n_embd/n_head dimensions)")
        ffn = size("n_inner", 4 * hidden) if config.get("n_inner") is not None else 4 * hidden
        return {
            "name": "gpt",
            "vocab_size": size("vocab_size", 50257),
            "hidden": hidden,
            "layers": size("n_layer", 12),
            "heads": heads,
            "kv_heads": heads,
            "ffn_hidden": ffn,
            "max_seq_len": size("n_positions", 1024),
            "norm": "layernorm",
            "norm_eps": number("layer_norm_epsilon", 1e-5),
            "position": "learned",
            "activation": _GPT2_ACT_BACK[act],
            "bias": True,
            "tie_embeddings": tied,
        }
    # llama, mistral, qwen2, qwen3, mixtral, qwen3_moe, phi3
    if config.get("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", "has no tpframe equivalent (tpframe's gated MLP is SwiGLU: silu)")
    window = hf_window(config, where)
    if kind == "llama" and config.get("attention_bias", False) != config.get("mlp_bias", False):
        raise refuse(
            "attention_bias",
            f"with mlp_bias={config.get('mlp_bias', False)!r} has no tpframe "
            "equivalent (model.bias puts biases on both or neither)",
        )
    key = "rope_parameters" if config.get("rope_parameters") is not None else "rope_scaling"
    rope = config.get(key) or {}
    if not isinstance(rope, dict):
        raise refuse(key, "must be an object (or null); fix it in config.json")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    partial = next(
        (
            v
            for v in (rope.get("partial_rotary_factor"), config.get("partial_rotary_factor"))
            if v is not None and v != 1
        ),
        1,
    )  # transformers 5 keeps it in rope_parameters, 4 at the top
    if partial != 1:  # Phi-3.5/4-mini rotate part of each head
        raise HFMappingError(
            f"{where}: partial_rotary_factor={partial!r} has no tpframe equivalent (tpframe's rotary "
            "turns every dimension of a head)"
        )
    if rope_type not in ("default", "llama3") or rope_type == "llama3" and kind != "llama":
        raise HFMappingError(
            f"{where}: rope scaling {rope_type!r} has no tpframe equivalent (tpframe's rotary is "
            "unscaled, or Llama 3.1's 'llama3' scaling in a Llama)"
        )
    hidden, heads = size("hidden_size", 4096), size("num_attention_heads", 32)
    kv = size("num_key_value_heads", heads) if config.get("num_key_value_heads") is not None else heads
    if config.get("head_dim") is None and hidden % heads:
        raise refuse(
            "num_attention_heads",
            f"does not divide hidden_size={hidden} (the head dim is "
            "hidden_size/num_attention_heads where config.json gives no head_dim)",
        )
    d = hidden // heads if config.get("head_dim") is None else size("head_dim", 128)
    if d % 2:
        raise refuse(
            "head_dim" if config.get("head_dim") is not None else "num_attention_heads",
            f"gives an odd head dim, {d}; rotary positions need an even one",
        )
    if heads % kv:
        raise refuse(
            "num_key_value_heads",
            f"does not divide num_attention_heads={heads} (grouped-query "
            "attention shares each key/value head among a whole group)",
        )
    size("max_position_embeddings", 2048)  # the context: checked here, chosen by the user (model.max_seq_len)
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    if not _positive_number(theta):
        raise HFMappingError(f"{where}: rope_theta={theta!r} must be a positive number; fix it in config.json")
    fields = {
        "name": "gpt",
        "vocab_size": size("vocab_size", 32000),
        "hidden": hidden,
        "layers": size("num_hidden_layers", 32),
        "heads": heads,
        "kv_heads": kv,
        "ffn_hidden": size("intermediate_size", 11008),
        "norm": "rmsnorm",
        "norm_eps": number("rms_norm_eps", 1e-6),
        "position": "rotary",
        "rope_theta": theta,
        "activation": "swiglu",
        "bias": bool(config.get("attention_bias", False)),
        "tie_embeddings": tied,
    }
    if d * heads != hidden:  # heads of their own width (Qwen3, Mistral-Nemo)
        fields["head_dim"] = d
    if kind in ("qwen3", "qwen3_moe"):  # per-head query and key norms; attention_bias would put biases on q, k, v
        # and o alone
        if config.get("attention_bias", False):
            raise refuse(
                "attention_bias",
                f"in a {_NAMES[kind]} has no tpframe equivalent (tpframe's biases are on "
                "every linear layer, or on q/k/v alone); tpframe reads it without biases",
            )
        fields["qk_norm"] = True
    if rope_type == "llama3":
        fields |= _llama3_rope_fields(rope, f"{where}: {key}")
    if kind == "qwen2":  # q/k/v biases only (its config has no bias options)
        fields["qkv_bias"] = True
    if window is not None:
        fields["sliding_window"] = window
    if kind == "mixtral":
        fields |= _moe_fields(
            config, where, size, experts_key="num_local_experts", ffn_key="intermediate_size", defaults=(8, 2, 14336)
        )
    if kind == "qwen3_moe":
        fields |= _qwen3_moe_fields(config, where, size)
    return fields


# Llama 3.1's rotary scaling: config.json's keys (rope_type "llama3") and the model.* fields holding them
_LLAMA3_ROPE_KEYS = (
    ("factor", "rope_scaling_factor"),
    ("low_freq_factor", "rope_low_freq_factor"),
    ("high_freq_factor", "rope_high_freq_factor"),
    ("original_max_position_embeddings", "rope_original_max_seq_len"),
)


def _llama3_rope_fields(rope: dict[str, Any], where: str) -> dict[str, Any]:
    """Llama 3.1's rotary scaling as model.rope_* values."""
    out = {}
    for hf_key, mine in _LLAMA3_ROPE_KEYS:
        value = rope.get(hf_key)
        ok = (
            _positive_number(value)
            if hf_key != "original_max_position_embeddings"
            else isinstance(value, int) and not isinstance(value, bool) and value >= 1
        )
        if not ok:
            raise HFMappingError(
                f"{where}: the llama3 scaling's {hf_key}={value!r} must be a positive "
                f"{'integer' if mine.endswith('len') else 'number'}; fix it in config.json"
            )
        out[mine] = value
    if not out["rope_high_freq_factor"] > out["rope_low_freq_factor"]:
        raise HFMappingError(
            f"{where}: the llama3 scaling's high_freq_factor={out['rope_high_freq_factor']!r} must "
            f"exceed its low_freq_factor={out['rope_low_freq_factor']!r}; fix it in config.json"
        )
    return out


def _positive_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value < float("inf")


def _moe_fields(
    config: dict[str, Any],
    where: str,
    size: Callable[[str, int], int],
    *,
    experts_key: str,
    ffn_key: str,
    defaults: tuple[int, int, int],
) -> dict[str, Any]:
    """Every block a mixture of `experts_key` SwiGLU MLPs of `ffn_key` hidden units, `num_experts_per_tok` per token
    (`defaults`: transformers' for the three, in that order); no dense MLP (ffn_hidden unused), no biases."""
    experts, top_k = size(experts_key, defaults[0]), size("num_experts_per_tok", defaults[1])
    if top_k > experts:
        raise HFMappingError(
            f"{where}: num_experts_per_tok={top_k} exceeds {experts_key}={experts}; fix it in config.json"
        )
    return {
        "moe_experts": experts,
        "moe_top_k": top_k,
        "moe_ffn_hidden": size(ffn_key, defaults[2]),
        "ffn_hidden": None,
        "bias": False,
    }


def _qwen3_moe_fields(config: dict[str, Any], where: str, size: Callable[[str, int], int]) -> dict[str, Any]:
    """Qwen3-MoE's experts, where tpframe can hold them: a mixture in every layer (no dense ones), its router's top k
    renormalized as tpframe's softmax router does. The hub names the count num_experts, transformers 5 saves it as
    num_local_experts."""
    step, dense = config.get("decoder_sparse_step", 1), config.get("mlp_only_layers")
    if isinstance(step, bool) or step != 1:
        raise HFMappingError(
            f"{where}: decoder_sparse_step={step!r} makes some layers dense MLPs, which tpframe has "
            "no equivalent for (every block of a tpframe MoE is a mixture of experts); tpframe reads "
            "Qwen3-MoE with decoder_sparse_step=1"
        )
    if dense not in (None, []):
        raise HFMappingError(
            f"{where}: mlp_only_layers={dense!r} makes those layers dense MLPs, which tpframe has no "
            "equivalent for (every block of a tpframe MoE is a mixture of experts); tpframe reads "
            "Qwen3-MoE with mlp_only_layers=[]"
        )
    if config.get("norm_topk_prob", False) is not True:  # transformers' default: false
        raise HFMappingError(
            f"{where}: norm_topk_prob={config.get('norm_topk_prob', False)!r} has no tpframe "
            "equivalent (tpframe's softmax router renormalizes the top k's weights to sum 1); "
            "tpframe reads Qwen3-MoE with norm_topk_prob=true"
        )
    both = config.get("num_experts"), config.get("num_local_experts")
    if None not in both and both[0] != both[1]:
        raise HFMappingError(
            f"{where}: num_experts={both[0]!r} with num_local_experts={both[1]!r}: transformers names "
            "one count both ways; keep one of them in config.json"
        )
    return _moe_fields(
        config,
        where,
        size,
        experts_key="num_experts" if both[0] is not None else "num_local_experts",
        ffn_key="moe_intermediate_size",
        defaults=(128, 8, 768),
    )


def hf_context(config: dict[str, Any]) -> int:
    """The longest context the directory's model was made for: max_position_embeddings (transformers' default 2048)."""
    return config.get("max_position_embeddings", 2048)


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
    if kind in ("qwen2", "qwen3"):
        layers, types = config.get("num_hidden_layers", 32), config.get("layer_types")
        if types is None:
            first = config.get("max_window_layers", 28)
            if isinstance(first, bool) or not isinstance(first, int) or first < 0:
                raise HFMappingError(
                    f"{where}: max_window_layers={first!r} must be an integer >= 0; fix it in config.json"
                )
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
        if not isinstance(types, list) or len(types) != layers:
            raise HFMappingError(
                f"{where}: layer_types={types!r} must list one type per layer "
                f"(num_hidden_layers={layers}); fix it in config.json"
            )
        windowed = sum(t == "sliding_attention" for t in types)
        if windowed == 0:
            return None
        if windowed != layers:
            raise HFMappingError(
                f"{where}: use_sliding_window=true gives a window of {window} to {windowed} of "
                f"{layers} layers (max_window_layers / layer_types), which tpframe has no equivalent "
                "for (model.sliding_window is every layer's)"
            )
    return window


def check_model_matches(m: ModelConfig, config: dict[str, Any], where: str) -> None:
    """HFMappingError, one line naming every model.* value that differs from what config.json describes."""
    want = model_fields(config, where)
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
    header read: HFMappingError naming the file that is missing, unreadable or not holding what the index says."""
    index = path / WEIGHTS_INDEX
    if index.is_file():
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
        self.names = {r.hf: self._stored_name(r.hf) for r in self.rules}
        self.part_of = {p: (r, i) for r in self.rules for i, p in enumerate(r.parts)}
        self.rows = {p: n[0] for p, n in logical_shapes(m).items()}  # each part's rows in its HF tensor
        self._cache: tuple[str, torch.Tensor] | None = None

    def _stored_name(self, hf: str) -> str | None:
        """GPT-2 checkpoints are saved with and without the `transformer.` prefix."""
        for candidate in (hf, hf.removeprefix("transformer.")):
            if candidate in self.files:
                return candidate
        return None

    def check(self, where: str | None = None) -> None:
        """Every tensor present with its shape and a floating-point dtype, nothing unknown (pre-flight: headers only,
        no data read); errors begin with `where` (default: the init_from setting)."""
        where = where or f"checkpoint.init_from={str(self.path)!r}"
        shapes = hf_shapes(self.m, self.kind)
        missing = [hf for hf, stored in self.names.items() if stored is None]
        if missing:
            raise HFMappingError(
                f"{where}: no tensor {missing[0]!r} in its safetensors ({len(missing)} missing); "
                "it does not hold the model its config.json describes"
            )
        for hf, stored in self.names.items():
            with safetensors_file(self.files[stored]) as f:
                part = f.get_slice(stored)
                shape, dtype = tuple(part.get_shape()), part.get_dtype()
            if shape != shapes[hf]:
                raise HFMappingError(f"{where}: {stored} has shape {shape}, config.json implies {shapes[hf]}")
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
        full = self._read(rule.hf)
        if rule.transpose:
            full = full.t()
        start = sum(self.rows[p] for p in rule.parts[:i])  # parts of their own sizes (grouped-query k and v)
        return full[start : start + self.rows[name]]

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
    from tpframe.checkpoint.finite import check_finite_weights, safetensors_items

    check_finite_weights(
        safetensors_items(sorted(set(weights.files.values())), set(weights.names.values())),
        f"checkpoint.init_from={str(path)!r}",
    )


# -- export ----------------------------------------------------------------------------------------


def to_hf(tensors: Mapping[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    """Logical tensors (tpframe names, full) -> HF tensors, contiguous, every logical tensor used once."""
    out, used = {}, set()
    for r in rules(m):
        full = torch.cat([tensors[p] for p in r.parts], dim=0) if len(r.parts) > 1 else tensors[r.parts[0]]
        out[r.hf] = (full.t() if r.transpose else full).contiguous()
        used.update(r.parts)
    unused = sorted(set(tensors) - used)
    if unused:
        raise HFMappingError(
            f"tensors with no Hugging Face place: {unused[:3]}; was the checkpoint written by "
            "another version of tpframe's GPT?"
        )
    return out


def tokenizer_record(config: dict[str, Any], warn: Callable[[str], None], cwd: str | None = None) -> dict | None:
    """The tokenizer a run's data was made with: {"kind": "bytes", ...} for byte-level data (the embedded corpora, a
    byte-level token file), else its token file's HF tokenizer (the sidecar's record), if unchanged on disk;
    `cwd`: the folder the run was launched from (relative paths are relative to it)."""
    data = config.get("data", {})
    if data.get("source") in BYTE_SOURCES:
        return BYTES
    if data.get("source") != "tokens" or not first_path(data.get("path")):
        return None
    sidecar = Path(recorded_path(first_path(data["path"]), cwd) + ".json")
    if not sidecar.is_file():
        warn(f"no tokenizer files: the token file's sidecar {sidecar} is gone")
        return None
    meta = json.loads(sidecar.read_text())
    info = meta.get("tokenizer", {})
    if info.get("kind") == "bytes":
        return BYTES
    if info.get("kind") != "huggingface":
        return None
    file = Path(recorded_path(info["file"], cwd))
    if not file.is_file() or hashlib.sha256(file.read_bytes()).hexdigest() != info.get("sha256"):
        warn(f"no tokenizer files: {file}, recorded in {sidecar}, is missing or has changed since the data was made")
        return None
    return {"kind": "huggingface", "file": file, "eot_token": info.get("eot_token"), "eot_id": meta.get("eot_id")}


def write_tokenizer(out_dir: Path, record: dict, model_max_length: int) -> None:
    """tokenizer.json + tokenizer_config.json: what AutoTokenizer.from_pretrained(out_dir) reads."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length}
    if record["kind"] == "bytes":
        (out_dir / "tokenizer.json").write_text(
            json.dumps(ByteTokenizer.hf_json(), ensure_ascii=False) + "\n", encoding="utf-8"
        )
    else:
        shutil.copyfile(record["file"], out_dir / "tokenizer.json")
        config.update(eos_token=record["eot_token"], bos_token=record["eot_token"])
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def foreign_export_dir(out_dir: str | Path) -> str | None:
    """Why an HF export to `out_dir` would replace something tpframe did not write, or None when `out_dir` is missing,
    empty, or an earlier export: only EXPORT_FILES, MARKER among them (exports written before the marker was added
    cannot be told from any other HF model: they need --force once)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        return "is a file; --format hf writes a directory"
    if not out_dir.exists():
        return None
    names = sorted(p.name for p in out_dir.iterdir())
    other = [n for n in names if n not in EXPORT_FILES]
    if other:
        return (
            f"is a directory holding files a tpframe export does not write ({', '.join(map(repr, other[:3]))}"
            f"{', ...' if len(other) > 3 else ''})"
        )
    if names and not _is_marker(out_dir / MARKER):
        return f"is a directory of model files without tpframe's {MARKER}: not a tpframe export"
    return None


def _is_marker(path: Path) -> bool:
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("exported_by") == "tpframe"
    except (OSError, ValueError, AttributeError):  # missing, not JSON, not an object
        return False


def _publish(new: Path, out: Path) -> None:
    """Put the finished export `new` (a folder beside `out`) at `out`. A missing or empty `out`: one rename. An earlier
    export: moved aside, the new one renamed in, the old one deleted, so `out` is never half-written (a crash between
    the renames leaves the old export beside it under a hidden name). Another directory (--force): the export's
    files replaced one by one (a name this export does not write, such as an old tokenizer, removed), the rest kept."""
    if not out.exists() or not any(out.iterdir()):
        os.replace(new, out)  # rename(2) replaces an empty directory
    elif foreign_export_dir(out) is None:
        old = temporary_name(out, "old")
        os.rename(out, old)
        try:
            os.rename(new, out)
        except OSError:
            os.rename(old, out)
            raise
        shutil.rmtree(old)
    else:
        for name in EXPORT_FILES:
            if (new / name).exists():
                os.replace(new / name, out / name)
            else:
                (out / name).unlink(missing_ok=True)
        new.rmdir()


def export_hf(
    checkpoint: str | Path, out_dir: str | Path, warn: Callable[[str], None] = print, force: bool = False
) -> dict[str, Any]:
    """A tpframe checkpoint (any layout) -> an HF directory `AutoModelForCausalLM.from_pretrained` loads.

    Refuses (HFMappingError) before writing anything when the model has no HF equivalent, and (ConfigError) a
    `out_dir` holding anything but an earlier export unless `force`. Written into a new folder beside `out_dir`
    and moved into place when complete (`_publish`).
    Returns a summary: architecture, tensor and parameter counts, the tokenizer written (or None).
    """
    from tpframe.checkpoint.export import read_model_tensors, write_safetensors
    from tpframe.training.config import from_dict

    checkpoint, out_dir = Path(checkpoint), link_target(Path(out_dir))
    if not force and (why := foreign_export_dir(out_dir)):
        refuse_existing(f"--out {str(out_dir)!r}", why)
    meta = json.loads((checkpoint / "meta.json").read_text())
    m = from_dict({"model": meta["config"]["model"]}).model
    arch = hf_architecture(m)  # refuse before reading or writing anything
    tokenizer = tokenizer_record(meta["config"], warn, meta.get("cwd"))
    tensors = to_hf(read_model_tensors(checkpoint), m)
    dtype = next(iter(tensors.values())).dtype
    config = hf_config(m, dtype=dtype, eos_token_id=tokenizer["eot_id"] if tokenizer else None)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    new = temporary_name(out_dir)
    new.mkdir()
    try:
        (new / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        write_safetensors(tensors, new / WEIGHTS, {"format": "pt"})
        if tokenizer:
            write_tokenizer(new, tokenizer, m.max_seq_len)
        mark = {"exported_by": "tpframe", "tpframe_version": meta.get("tpframe_version"), "step": meta["step"]}
        (new / MARKER).write_text(json.dumps(mark, indent=2) + "\n")
        _publish(new, out_dir)
    finally:
        if new.exists():
            shutil.rmtree(new)
    return {
        "architecture": arch,
        "tensors": len(tensors),
        "params": sum(t.numel() for t in tensors.values()),
        "dtype": _DTYPES[dtype],
        "step": meta["step"],
        "tokenizer": tokenizer and ("byte-level" if tokenizer["kind"] == "bytes" else str(tokenizer["file"])),
    }
