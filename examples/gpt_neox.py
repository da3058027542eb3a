"""A model of your own with its own Hugging Face family: GPT-NeoX's shape (Pythia's), from tpframe.layers.

    python train.py --config configs/tiny_cpu.yaml parallel.tp=1 model.name=examples.gpt_neox:build \\
        model.position=rotary model.tie_embeddings=false checkpoint.save_at_end=true
    python tools/checkpoint.py export runs/tiny_cpu/checkpoints --format hf --out neox_hf   # GPTNeoXForCausalLM
    python generate.py --checkpoint runs/tiny_cpu/checkpoints --prompt "The "

Differences from tpframe.models.gpt: attention and MLP each read the block's input through their own LayerNorm and
are added to the residual together (GPT-NeoX's use_parallel_residual); rotary positions over whole heads; biases in
every norm and linear layer; an untied head. It implements tpframe/models/protocol.py's Model (forward with a KV
cache, kv_cache_spec: generate.py runs it), and `build` names its Hugging Face family, FAMILY below: the name table
(HF's query_key_value holds q, k, v interleaved per head) and the config.json translation.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tpframe.errors import ConfigError
from tpframe.layers import LayerNorm, ParallelLMHead, ParallelMLP, VocabParallelEmbedding, vocab_parallel_cross_entropy
from tpframe.layers.attention import ParallelAttention, RotaryEmbedding
from tpframe.layers.utils import normal_init, scaled_normal_init
from tpframe.models import BuildContext
from tpframe.models.config import ModelConfig, ffn_hidden_size, head_dim
from tpframe.models.gpt import layer_seed, seeded
from tpframe.models.hf.family import Family, Fields, Fused
from tpframe.models.protocol import KVCacheSpec, ModelSpec
from tpframe.parallel import recompute

NAME = "examples.gpt_neox:build"


class NeoXBlock(nn.Module):
    """x + attn(norm1(x)) + mlp(norm2(x)), [s(/tp), b, h] in and out."""

    def __init__(self, cfg: ModelConfig, ctx: BuildContext):
        super().__init__()
        sp, dtype, device, mode = ctx.sequence_parallel, ctx.dtype, ctx.device, ctx.mode
        self.norm1 = LayerNorm(cfg.hidden, cfg.norm_eps, sequence_parallel=sp, dtype=dtype, device=device, mode=mode)
        self.norm2 = LayerNorm(cfg.hidden, cfg.norm_eps, sequence_parallel=sp, dtype=dtype, device=device, mode=mode)
        common = dict(
            sequence_parallel=sp,
            comm=ctx.comm,
            init_method=normal_init(cfg.init_std),
            output_init_method=scaled_normal_init(cfg.init_std, cfg.layers),
            dtype=dtype,
            device=device,
            mode=mode,  # the layer mode (fused kernels, float8, async TP): each layer decides from it
        )
        self.attn = ParallelAttention(
            cfg.hidden, cfg.heads, attention_dropout=cfg.attention_dropout, rng_tracker=ctx.rng_tracker, **common
        )
        self.mlp = ParallelMLP(cfg.hidden, ffn_hidden_size(cfg), activation=cfg.activation, **common)

    def forward(self, x: torch.Tensor, rotary, cache=None) -> torch.Tensor:
        return x + self.attn(self.norm1(x), rotary, cache) + self.mlp(self.norm2(x))


class GPTNeoX(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: BuildContext):
        super().__init__()
        self.cfg, self.ctx = cfg, ctx
        sp, dtype, device = ctx.sequence_parallel, ctx.dtype, ctx.device
        vocab = dict(
            sequence_parallel=sp,
            pad_to_multiple_of=cfg.vocab_multiple,
            comm=ctx.comm,
            init_method=normal_init(cfg.init_std),
            dtype=dtype,
            device=device,
        )
        with seeded(ctx.seed):
            self.embedding = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden, **vocab)
        self.rotary = RotaryEmbedding(head_dim(cfg), cfg.max_seq_len, cfg.rope_theta).to(device)
        blocks = {}
        for i in range(cfg.layers):
            with seeded(layer_seed(ctx.seed, i)):
                blocks[str(i)] = NeoXBlock(cfg, ctx)
        self.blocks = nn.ModuleDict(blocks)
        self.final_norm = LayerNorm(
            cfg.hidden, cfg.norm_eps, sequence_parallel=sp, dtype=dtype, device=device, mode=ctx.mode
        )
        with seeded(ctx.seed + 2):
            self.head = ParallelLMHead(cfg.hidden, cfg.vocab_size, mode=ctx.mode, **vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *, cache=None) -> torch.Tensor:
        """The per-token loss [b, s]; without labels the local logits [b, s, V/tp]; with a KV cache (generation)
        those of the last position [b, V/tp]."""
        x = self.embedding(input_ids.t())  # [s(/tp), b, h]
        if cache is None:
            rotary = self.rotary(input_ids.shape[1], x.dtype)
        else:
            rotary = self.rotary.at(cache.positions, x.dtype)
        for n, (i, block) in enumerate(self.blocks.items()):
            if cache is None and self.training and self.ctx.recomputes_block(n):
                x = recompute(block, x, rotary, preserve_rng=self.cfg.attention_dropout > 0)
            else:
                x = block(x, rotary, None if cache is None else cache.layer(i))
        logits = self.head(self.final_norm(x if cache is None else x[-1:]))  # [s, b, V/tp]
        if cache is not None:
            return logits[0]
        if labels is None:
            return logits.transpose(0, 1)
        loss = vocab_parallel_cross_entropy(logits, labels.t(), comm=self.ctx.comm, vocab_size=self.cfg.vocab_size)
        return loss.t().contiguous()

    def flops_per_token(self, seq_len: int) -> float:
        h, ffn = self.cfg.hidden, ffn_hidden_size(self.cfg)
        layer = 2 * (4 * h * h + 2 * h * ffn) + 4 * seq_len * h  # q, k, v, proj; the MLP; attention
        return 3.0 * (self.cfg.layers * layer + 2 * h * self.embedding.padded_num_embeddings)

    def kv_cache_spec(self) -> KVCacheSpec:
        attn = self.blocks["0"].attn
        return KVCacheSpec(tuple(self.blocks.keys()), attn.kv_local, attn.head_dim)


# What GPT-NeoX is, in ModelConfig's terms: everything else is refused (and has no Hugging Face equivalent).
FIXED_CHOICES = {
    "norm": "layernorm",
    "position": "rotary",
    "activation": "gelu",
    "bias": True,
    "qkv_bias": None,
    "tie_embeddings": False,
    "kv_heads": None,
    "head_dim": None,
    "qk_norm": False,
    "moe_experts": 0,
    "rope_scaling_factor": None,
    "attention_mask": "causal",
}


def _build(cfg: ModelConfig, ctx: BuildContext) -> nn.Module:
    wrong = {k: v for k, v in FIXED_CHOICES.items() if getattr(cfg, k) != v}
    if wrong:
        fixes = " ".join(f"model.{k}={'null' if v is None else str(v).lower()}" for k, v in wrong.items())
        raise ConfigError(f"{NAME} needs {fixes}")
    return GPTNeoX(cfg, ctx)


# -- its Hugging Face family: GPTNeoXForCausalLM ------------------------------------------------------------

L, B = "gpt_neox.layers.{}.", "blocks.{}."
NAMES = {
    "gpt_neox.embed_in": "embedding",
    L + "input_layernorm": B + "norm1",
    L + "post_attention_layernorm": B + "norm2",
    L + "attention.dense": B + "attn.proj",
    L + "mlp.dense_h_to_4h": B + "mlp.fc1",
    L + "mlp.dense_4h_to_h": B + "mlp.fc2",
    "gpt_neox.final_layer_norm": "final_norm",
    "embed_out": "head",  # the hub's name, which transformers 5 reads as lm_head
}


def _names(m: ModelConfig, kind: str) -> dict:
    qkv = Fused((B + "attn.qkv.q", B + "attn.qkv.k", B + "attn.qkv.v"), groups=m.heads)  # [heads, (q, k, v), d]
    return {**NAMES, L + "attention.query_key_value": qkv}


def to_config(m: ModelConfig, kind: str) -> dict[str, Any]:
    return {
        "architectures": ["GPTNeoXForCausalLM"],
        "model_type": "gpt_neox",
        "hidden_size": m.hidden,
        "num_hidden_layers": m.layers,
        "num_attention_heads": m.heads,
        "intermediate_size": ffn_hidden_size(m),
        "hidden_act": "gelu_new",  # tpframe's gelu: the tanh approximation
        "max_position_embeddings": m.max_seq_len,
        "layer_norm_eps": m.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta, "partial_rotary_factor": 1.0},
        "rotary_pct": 1.0,  # transformers 4's names of the two
        "rotary_emb_base": m.rope_theta,
        "use_parallel_residual": True,
        "attention_bias": True,
        "attention_dropout": m.attention_dropout,
        "hidden_dropout": m.dropout,
    }


def from_config(r: Fields) -> dict[str, Any]:
    for key, ok in (("tie_word_embeddings", False), ("use_parallel_residual", True), ("attention_bias", True)):
        if r.get(key, ok) != ok:
            raise r.refuse(key, f"has no equivalent in {NAME}")
    if r.get("hidden_act", "gelu") != "gelu_new":
        raise r.refuse("hidden_act", "has no tpframe equivalent (tpframe's gelu is the tanh approximation, gelu_new)")
    rope = r.get("rope_parameters") or {}
    if rope.get("partial_rotary_factor", r.get("rotary_pct", 0.25)) != 1:
        raise r.refuse("rope_parameters", "rotates part of each head; tpframe's rotary turns every dimension")
    hidden, heads = r.size("hidden_size", 6144), r.size("num_attention_heads", 64)
    if hidden % heads:
        raise r.refuse("num_attention_heads", f"does not divide hidden_size={hidden}")
    r.size("max_position_embeddings", 2048)  # the context: model.max_seq_len, chosen by the user
    return {
        "name": NAME,
        "vocab_size": r.size("vocab_size", 50432),
        "hidden": hidden,
        "layers": r.size("num_hidden_layers", 44),
        "heads": heads,
        "ffn_hidden": r.size("intermediate_size", 24576),
        "norm": "layernorm",
        "norm_eps": r.number("layer_norm_eps", 1e-5),
        "position": "rotary",
        "rope_theta": rope.get("rope_theta", r.get("rotary_emb_base", 10000.0)),
        "activation": "gelu",
        "bias": True,
        "tie_embeddings": False,
    }


FAMILY = Family({"gpt_neox": "GPT-NeoX"}, lambda m: "gpt_neox", to_config, from_config, _names)
build = ModelSpec(_build, supports_recompute_layers=True, hf_family=lambda m: FAMILY)
