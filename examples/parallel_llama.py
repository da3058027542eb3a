"""A model of your own, from tpframe.layers: a Llama-style decoder with PaLM's parallel block.

Differences from tpframe.models.gpt: attention and MLP read the same normalized input and are added
to the residual together (one norm per block), RMSNorm, rotary positions, SwiGLU, no biases, an
untied output head.

Train it with the same entry point:
    torchrun --nproc-per-node 2 train.py --config configs/tiny_llama_cpu.yaml
    (it sets model.name=examples.parallel_llama:build and the choices this model fixes)

A builder takes (ModelConfig, BuildContext) and returns a module with forward(input_ids, labels) ->
per-token loss [b, s], num_params() and flops_per_token(seq_len) (see tpframe/models/__init__.py).
"""

from __future__ import annotations

import torch
from torch import nn

from tpframe.layers import ParallelMLP, RMSNorm, VocabParallelEmbedding, column_parallel_linear, vocab_parallel_cross_entropy
from tpframe.layers.attention import ParallelAttention, RotaryEmbedding
from tpframe.layers.embedding import init_vocab_shard
from tpframe.layers.utils import normal_init, scaled_normal_init, tag_param
from tpframe.models import BuildContext
from tpframe.models.gpt import seeded
from tpframe.parallel import checkpoint
from tpframe.training.config import ConfigError, ModelConfig, ffn_hidden_size


class ParallelBlock(nn.Module):
    """x + attn(norm(x)) + mlp(norm(x)), [s(/tp), b, h] in and out."""

    def __init__(self, cfg: ModelConfig, ctx: BuildContext):
        super().__init__()
        sp = ctx.sequence_parallel
        init, out_init = normal_init(cfg.init_std), scaled_normal_init(cfg.init_std, cfg.layers)
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps, sp, ctx.dtype, ctx.device)
        self.attn = ParallelAttention(
            cfg.hidden, cfg.heads, cfg.kv_heads, False, cfg.attention_dropout, sp, ctx.comm, init, out_init,
            ctx.rng_tracker, ctx.dtype, ctx.device,
        )
        self.mlp = ParallelMLP(cfg.hidden, ffn_hidden_size(cfg), "swiglu", False, sp, ctx.comm, init, out_init, ctx.dtype, ctx.device)

    def forward(self, x: torch.Tensor, rotary) -> torch.Tensor:
        h = self.norm(x)
        return x + self.attn(h, rotary) + self.mlp(h)


class ParallelLlama(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: BuildContext):
        super().__init__()
        self.cfg, self.ctx = cfg, ctx
        comm, sp = ctx.comm, ctx.sequence_parallel
        with seeded(ctx.seed):
            self.embedding = VocabParallelEmbedding(
                cfg.vocab_size, cfg.hidden, sp, cfg.vocab_multiple, comm, normal_init(cfg.init_std), ctx.dtype, ctx.device
            )
        self.rotary = RotaryEmbedding(cfg.hidden // cfg.heads, cfg.max_seq_len, cfg.rope_theta).to(ctx.device)
        blocks = []
        for i in range(cfg.layers):
            with seeded(ctx.seed + 1000 * (i + 1)):
                blocks.append(ParallelBlock(cfg, ctx))
        self.blocks = nn.ModuleList(blocks)
        self.final_norm = RMSNorm(cfg.hidden, cfg.norm_eps, sp, ctx.dtype, ctx.device)
        with seeded(ctx.seed + 2):
            shard = init_vocab_shard(
                cfg.vocab_size, cfg.hidden, self.embedding.padded_num_embeddings, comm.rank, comm.size,
                normal_init(cfg.init_std), ctx.dtype, ctx.device,
            )
        self.head = tag_param(nn.Parameter(shard), tp_dim=0)
        self.head.vocab_rows = cfg.vocab_size

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embedding(input_ids.t())  # [s(/tp), b, h]
        rotary = self.rotary(input_ids.shape[1], x.dtype)
        for block in self.blocks:
            x = checkpoint(block, x, rotary) if self.ctx.activation_checkpointing and self.training else block(x, rotary)
        logits = column_parallel_linear(self.final_norm(x), self.head, None, self.ctx.comm, self.ctx.sequence_parallel)
        return vocab_parallel_cross_entropy(logits, labels.t(), comm=self.ctx.comm, vocab_size=self.cfg.vocab_size).t()

    def num_params(self) -> int:
        tp = self.ctx.comm.size
        padding = 2 * (self.embedding.padded_num_embeddings - self.cfg.vocab_size) * self.cfg.hidden
        return sum(p.numel() * (tp if p.tp_dim is not None else 1) for p in self.parameters()) - padding

    def flops_per_token(self, seq_len: int) -> float:
        c = self.cfg
        h, kv = c.hidden, (c.kv_heads or c.heads) * (c.hidden // c.heads)
        ffn = ffn_hidden_size(c)
        layer = 2 * (h * (h + 2 * kv) + h * h + 3 * h * ffn) + 4 * seq_len * h
        return 3.0 * (c.layers * layer + 2 * h * self.embedding.padded_num_embeddings)


FIXED_CHOICES = {"norm": "rmsnorm", "position": "rotary", "activation": "swiglu", "bias": False, "tie_embeddings": False}


def build(cfg: ModelConfig, ctx: BuildContext) -> nn.Module:
    """The builder train.py calls for model.name=examples.parallel_llama:build."""
    wrong = {k: v for k, v in FIXED_CHOICES.items() if getattr(cfg, k) != v}
    if wrong:  # this model fixes these choices: refuse a config that asks for others
        fixes = " ".join(f"model.{k}={str(v).lower()}" for k, v in wrong.items())
        raise ConfigError(f"examples.parallel_llama needs {fixes} (see configs/tiny_llama_cpu.yaml)")
    return ParallelLlama(cfg, ctx)
