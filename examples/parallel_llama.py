"""A model of your own, from tpframe.layers: a Llama-style decoder with PaLM's parallel block.

Differences from tpframe.models.gpt: attention and MLP read the same normalized input and are added
to the residual together (one norm per block), RMSNorm, rotary positions, SwiGLU, no biases, an
untied output head.

Train it with the same entry point:
    torchrun --nproc-per-node 2 train.py --config configs/tiny_llama_cpu.yaml
    (it sets model.name=examples.parallel_llama:build and the choices this model fixes)

A builder takes (ModelConfig, BuildContext) and returns a module with forward(input_ids, labels) ->
per-token loss [b, s] and flops_per_token(seq_len) (tpframe/models/protocol.py); examples/gpt_neox.py is one that
also generates and has a Hugging Face family.
"""

from __future__ import annotations

import torch
from torch import nn

from tpframe.errors import ConfigError
from tpframe.layers import ParallelLMHead, ParallelMLP, RMSNorm, VocabParallelEmbedding, vocab_parallel_cross_entropy
from tpframe.layers.attention import ParallelAttention, RotaryEmbedding
from tpframe.layers.documents import Documents
from tpframe.layers.utils import normal_init, scaled_normal_init
from tpframe.models import BuildContext
from tpframe.models.config import ModelConfig, ffn_hidden_size, head_dim, rope_scaling
from tpframe.models.gpt import layer_seed, seeded
from tpframe.models.protocol import ModelSpec
from tpframe.parallel import recompute


class ParallelBlock(nn.Module):
    """x + attn(norm(x)) + mlp(norm(x)), [s(/tp), b, h] in and out."""

    def __init__(self, cfg: ModelConfig, ctx: BuildContext):
        super().__init__()
        common = dict(
            bias=False,
            sequence_parallel=ctx.sequence_parallel,
            comm=ctx.comm,
            init_method=normal_init(cfg.init_std),
            output_init_method=scaled_normal_init(cfg.init_std, cfg.layers),
            dtype=ctx.dtype,
            device=ctx.device,
            mode=ctx.mode,  # the layer mode (fused kernels, float8, async TP): each layer decides from it
        )
        norm = dict(sequence_parallel=ctx.sequence_parallel, dtype=ctx.dtype, device=ctx.device, mode=ctx.mode)
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps, **norm)
        self.attn = ParallelAttention(
            cfg.hidden,
            cfg.heads,
            kv_heads=cfg.kv_heads,
            head_dim=cfg.head_dim,
            qk_norm=cfg.qk_norm,
            norm_eps=cfg.norm_eps,
            qkv_bias=cfg.qkv_bias,
            attention_dropout=cfg.attention_dropout,
            window=cfg.sliding_window,
            rng_tracker=ctx.rng_tracker,
            **common,
        )
        self.mlp = ParallelMLP(cfg.hidden, ffn_hidden_size(cfg), activation="swiglu", **common)

    def forward(self, x: torch.Tensor, rotary, documents: Documents | None = None) -> torch.Tensor:
        h = self.norm(x)
        return x + self.attn(h, rotary, documents=documents) + self.mlp(h)


class ParallelLlama(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: BuildContext):
        super().__init__()
        self.cfg, self.ctx = cfg, ctx
        vocab = dict(
            sequence_parallel=ctx.sequence_parallel,
            pad_to_multiple_of=cfg.vocab_multiple,
            comm=ctx.comm,
            init_method=normal_init(cfg.init_std),
            dtype=ctx.dtype,
            device=ctx.device,
        )
        with seeded(ctx.seed):
            self.embedding = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden, **vocab)
        self.rotary = RotaryEmbedding(head_dim(cfg), cfg.max_seq_len, cfg.rope_theta, scaling=rope_scaling(cfg)).to(
            ctx.device
        )
        blocks = {}
        for i in range(cfg.layers):
            with seeded(layer_seed(ctx.seed, i)):
                blocks[str(i)] = ParallelBlock(cfg, ctx)
        self.blocks = nn.ModuleDict(blocks)
        norm = dict(sequence_parallel=ctx.sequence_parallel, dtype=ctx.dtype, device=ctx.device, mode=ctx.mode)
        self.final_norm = RMSNorm(cfg.hidden, cfg.norm_eps, **norm)
        with seeded(ctx.seed + 2):
            self.head = ParallelLMHead(cfg.hidden, cfg.vocab_size, mode=ctx.mode, **vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embedding(input_ids.t())  # [s(/tp), b, h]
        docs = None  # model.attention_mask=document: each packed document attends to itself, from position 0
        if self.cfg.attention_mask == "document":
            docs = Documents.from_tokens(input_ids, self.cfg.eod_id)
        rotary = self.rotary(input_ids.shape[1], x.dtype) if docs is None else self.rotary.at(docs.positions, x.dtype)
        for n, block in enumerate(self.blocks.values()):
            if self.training and self.ctx.recomputes_block(n):  # full recompute (of the first N, ctx.recompute_layers)
                x = recompute(block, x, rotary, docs, preserve_rng=self.cfg.attention_dropout > 0)
            else:
                x = block(x, rotary, docs)
        logits = self.head(self.final_norm(x))  # [s, b, V/tp]
        return vocab_parallel_cross_entropy(logits, labels.t(), comm=self.ctx.comm, vocab_size=self.cfg.vocab_size).t()

    def flops_per_token(self, seq_len: int) -> float:
        c = self.cfg
        h, q, kv = c.hidden, c.heads * head_dim(c), (c.kv_heads or c.heads) * head_dim(c)
        ffn = ffn_hidden_size(c)
        layer = 2 * (h * (q + 2 * kv) + q * h + 3 * h * ffn) + 4 * seq_len * q
        return 3.0 * (c.layers * layer + 2 * h * self.embedding.padded_num_embeddings)


FIXED_CHOICES = {
    "norm": "rmsnorm",
    "position": "rotary",
    "activation": "swiglu",
    "bias": False,
    "tie_embeddings": False,
}


def _build(cfg: ModelConfig, ctx: BuildContext) -> nn.Module:
    """The builder train.py calls for model.name=examples.parallel_llama:build."""
    wrong = {k: v for k, v in FIXED_CHOICES.items() if getattr(cfg, k) != v}
    if wrong:  # this model fixes these choices: refuse a config that asks for others
        fixes = " ".join(f"model.{k}={str(v).lower()}" for k, v in wrong.items())
        raise ConfigError(f"examples.parallel_llama needs {fixes} (see configs/tiny_llama_cpu.yaml)")
    return ParallelLlama(cfg, ctx)


# what train.py finds at model.name=examples.parallel_llama:build (tpframe/models/protocol.py): the builder and the
# options it honours, ctx.recompute_layers and model.attention_mask=document (ctx.selective_recompute it does not)
build = ModelSpec(_build, supports_recompute_layers=True, supports_document_mask=True)
