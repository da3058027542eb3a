"""The reference GPT, built only from tpframe.layers.

    input_ids [b, s] -> transpose -> vocab-parallel embedding (+ positions) -> [s, b, h]
      -> N x (norm -> attention -> +residual -> norm -> MLP -> +residual)
      -> final norm -> vocab-parallel head [s, b, V/tp] -> vocab-parallel CE -> loss [b, s]

Activations are sequence-first so that sequence parallelism is a contiguous dim-0 split:
with it on, everything between the TP regions is [s/tp, b, h].
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from tpframe.comm import Communicator
from tpframe.layers import (
    ParallelMLP,
    VocabParallelEmbedding,
    build_norm,
    column_parallel_linear,
    vocab_parallel_cross_entropy,
)
from tpframe.layers.attention import ParallelAttention, RotaryEmbedding
from tpframe.layers.embedding import init_vocab_shard
from tpframe.layers.utils import normal_init, scaled_normal_init, tag_param
from tpframe.parallel.random import RNGStatesTracker, checkpoint
from tpframe.training.config import ModelConfig, ffn_hidden_size


@contextlib.contextmanager
def seeded(seed: int):
    """Draw a submodule's master weights from its own seed (CPU generator), whatever was built before.

    Layer i gets the same weights at any TP size and in any construction order.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


class TransformerBlock(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then + drop(mlp(norm(x))). [s(/tp), b, h] in and out."""

    def __init__(self, cfg: ModelConfig, comm: Communicator, sequence_parallel: bool, tracker, dtype, device):
        super().__init__()
        init, out_init = normal_init(cfg.init_std), scaled_normal_init(cfg.init_std, cfg.layers)
        norm = lambda: build_norm(cfg.norm, cfg.hidden, cfg.norm_eps, cfg.bias, sequence_parallel, dtype, device)  # noqa: E731
        self.norm1, self.norm2 = norm(), norm()
        self.attn = ParallelAttention(
            cfg.hidden, cfg.heads, cfg.kv_heads, cfg.bias, cfg.attention_dropout, sequence_parallel, comm,
            init, out_init, tracker, dtype, device,
        )
        self.mlp = ParallelMLP(
            cfg.hidden, ffn_hidden_size(cfg), cfg.activation, cfg.bias, sequence_parallel, comm, init, out_init, dtype, device
        )
        self.dropout = ResidualDropout(cfg.dropout, sequence_parallel, tracker)

    def forward(self, x: torch.Tensor, rotary=None) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.norm1(x), rotary))
        return x + self.dropout(self.mlp(self.norm2(x)))


class ResidualDropout(nn.Module):
    """Dropout on activations outside the TP regions.

    Replicated activations (no SP) use the default stream, identical on every TP rank; under SP
    each rank holds different tokens and draws from its own "tp" stream.
    """

    def __init__(self, p: float, sequence_parallel: bool, tracker: RNGStatesTracker | None):
        super().__init__()
        self.p, self.sequence_parallel, self.tracker = p, sequence_parallel, tracker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if self.sequence_parallel and self.tracker is not None:
            with self.tracker.fork():
                return F.dropout(x, self.p, True)
        return F.dropout(x, self.p, True)


class GPT(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        comm: Communicator,
        sequence_parallel: bool = False,
        activation_checkpointing: bool = False,
        rng_tracker: RNGStatesTracker | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        seed: int = 1234,
    ):
        super().__init__()
        self.cfg, self.comm = cfg, comm
        self.sequence_parallel, self.activation_checkpointing = sequence_parallel, activation_checkpointing
        device = device or comm.device
        init = normal_init(cfg.init_std)
        with seeded(seed):
            self.embedding = VocabParallelEmbedding(
                cfg.vocab_size, cfg.hidden, sequence_parallel, cfg.vocab_multiple, comm, init, dtype, device
            )
        self.position = None
        if cfg.position == "learned":
            with seeded(seed + 1):
                table = torch.empty(cfg.max_seq_len, cfg.hidden).normal_(0, cfg.init_std)
            # Replicated; under SP each rank embeds only its positions, so its gradient is partial.
            self.position = tag_param(nn.Parameter(table.to(device=device, dtype=dtype)), None, sequence_parallel)
        self.rotary = RotaryEmbedding(cfg.hidden // cfg.heads, cfg.max_seq_len, cfg.rope_theta).to(device) if cfg.position == "rotary" else None
        self.embed_dropout = ResidualDropout(cfg.dropout, sequence_parallel, rng_tracker)
        blocks = []
        for i in range(cfg.layers):
            with seeded(seed + 1000 * (i + 1)):
                blocks.append(TransformerBlock(cfg, comm, sequence_parallel, rng_tracker, dtype, device))
        self.blocks = nn.ModuleList(blocks)
        self.final_norm = build_norm(cfg.norm, cfg.hidden, cfg.norm_eps, cfg.bias, sequence_parallel, dtype, device)
        self.head_weight = None  # tied: the head reuses the embedding table [V/tp, h]
        if not cfg.tie_embeddings:
            with seeded(seed + 2):
                shard = init_vocab_shard(
                    cfg.vocab_size, cfg.hidden, self.embedding.padded_num_embeddings, comm.rank, comm.size, init, dtype, device
                )
            self.head_weight = tag_param(nn.Parameter(shard), tp_dim=0)  # column-parallel: rows split
            self.head_weight.vocab_rows = cfg.vocab_size

    # -- forward --------------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[b, s] ids -> [s, b, h] (or this rank's [s/tp, b, h] under SP)."""
        ids = input_ids.t()
        x = self.embedding(ids)
        if self.position is not None:
            s, tp = ids.shape[0], self.comm.size
            if self.sequence_parallel:
                positions = self.position[self.comm.rank * (s // tp) : (self.comm.rank + 1) * (s // tp)]
            else:
                positions = self.position[:s]
            x = x + positions.unsqueeze(1)
        return self.embed_dropout(x)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Per-token loss [b, s] in fp32 when `labels` is given, else local logits [b, s, V/tp]."""
        b, s = input_ids.shape
        if s > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {s} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        x = self.embed(input_ids)
        rotary = self.rotary(s, x.dtype) if self.rotary is not None else None
        for block in self.blocks:
            if self.activation_checkpointing and self.training:
                x = checkpoint(block, x, rotary)
            else:
                x = block(x, rotary)
        x = self.final_norm(x)
        weight = self.embedding.weight if self.head_weight is None else self.head_weight
        logits = column_parallel_linear(x, weight, None, self.comm, self.sequence_parallel)  # [s, b, V/tp]
        if labels is None:
            return logits.transpose(0, 1)
        loss = vocab_parallel_cross_entropy(logits, labels.t(), comm=self.comm, vocab_size=self.cfg.vocab_size)
        return loss.t()

    # -- accounting -----------------------------------------------------------------------------
    def num_params(self) -> int:
        """Parameters of the whole model (all TP shards), padding rows of the vocabulary excluded."""
        total = 0
        for p in self.parameters():
            total += p.numel() * (self.comm.size if getattr(p, "tp_dim", None) is not None else 1)
        pad = self.embedding.padded_num_embeddings - self.cfg.vocab_size
        total -= pad * self.cfg.hidden * (1 if self.head_weight is None else 2)
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward = 3x forward), matmuls and attention.

        For the standard GPT this is Megatron's 72*L*h^2 + 12*L*h*s + 6*h*V per token.
        """
        c = self.cfg
        h, d = c.hidden, c.hidden // c.heads
        kv = (c.kv_heads or c.heads) * d
        ffn = ffn_hidden_size(c)
        fc1 = 2 * ffn if c.activation == "swiglu" else ffn
        layer = 2 * (h * (h + 2 * kv) + h * h + h * fc1 + ffn * h) + 4 * seq_len * h
        return 3.0 * (c.layers * layer + 2 * h * self.embedding.padded_num_embeddings)
