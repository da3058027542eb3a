"""The reference GPT, built only from tpframe.layers.

    input_ids [b, s] -> transpose -> vocab-parallel embedding (+ positions) -> [s, b, h]
      -> N x (norm -> attention -> +residual -> norm -> MLP -> +residual)
      -> final norm -> vocab-parallel head [s, b, V/tp] -> vocab-parallel CE -> loss [b, s]

Activations are sequence-first so that sequence parallelism is a contiguous dim-0 split:
with it on, everything between the TP regions is [s/tp, b, h].

Stage-aware for pipeline parallelism (`ctx.stage`): a stage builds only its blocks, kept under their
*global* layer index (`blocks.17.*` on any stage, so checkpoint names do not depend on PP); the first
stage owns the embedding, the last the final norm and head (and, with tied embeddings, a copy of the
embedding table that the pipeline keeps equal to the first stage's).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from tpframe.layers import (
    ParallelLMHead,
    ParallelMLP,
    VocabParallelEmbedding,
    build_norm,
    column_parallel_linear,
    vocab_parallel_cross_entropy,
)
from tpframe.layers.attention import ParallelAttention, RotaryEmbedding
from tpframe.layers.context import gather_token_ids, local_positions
from tpframe.layers.cross_entropy import vocab_parallel_head_cross_entropy
from tpframe.layers.documents import Documents
from tpframe.layers.embedding import padded_vocab_size
from tpframe.layers.moe import MoE, reset_expert_load, update_expert_biases
from tpframe.layers.utils import normal_init, scaled_normal_init, tag_param
from tpframe.models import BuildContext
from tpframe.models.config import ModelConfig, ffn_hidden_size, head_dim, moe_ffn_hidden_size, rope_scaling
from tpframe.models.protocol import KVCacheSpec
from tpframe.parallel.recompute import RecomputedOutput, recompute, selective_checkpoint
from tpframe.parallel.rng import RNGStatesTracker


@contextlib.contextmanager
def seeded(seed: int):
    """Draw a submodule's master weights from its own seed (CPU generator), whatever was built before.

    Layer i gets the same weights at any TP size, on any pipeline stage, in any construction order.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def layer_seed(seed: int, layer: int) -> int:
    return seed + 1000 * (layer + 1)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then + drop(mlp(norm(x))). [s(/tp), b, h] in and out."""

    def __init__(self, cfg: ModelConfig, ctx: BuildContext):
        super().__init__()
        sp, dtype, device = ctx.sequence_parallel, ctx.dtype, ctx.device
        init, out_init = normal_init(cfg.init_std), scaled_normal_init(cfg.init_std, cfg.layers)
        norm = dict(bias=cfg.bias, sequence_parallel=sp, dtype=dtype, device=device, mode=ctx.mode)
        self.norm1 = build_norm(cfg.norm, cfg.hidden, cfg.norm_eps, **norm)
        self.norm2 = build_norm(cfg.norm, cfg.hidden, cfg.norm_eps, **norm)
        common = dict(
            bias=cfg.bias,
            sequence_parallel=sp,
            comm=ctx.comm,
            init_method=init,
            output_init_method=out_init,
            dtype=dtype,
            device=device,
            mode=ctx.mode,
        )
        self.attn = ParallelAttention(
            cfg.hidden,
            cfg.heads,
            kv_heads=cfg.kv_heads,
            head_dim=cfg.head_dim,
            qk_norm=cfg.qk_norm,
            norm_eps=cfg.norm_eps,
            qkv_bias=cfg.qkv_bias,
            attention_dropout=cfg.attention_dropout,
            rng_tracker=ctx.rng_tracker,
            cp_comm=ctx.cp_comm,
            window=cfg.sliding_window,
            **common,
        )
        if cfg.moe_experts:
            common.pop("bias")
            self.mlp = MoE(
                cfg.hidden,
                moe_ffn_hidden_size(cfg),
                cfg.moe_experts,
                cfg.moe_top_k,
                activation=cfg.activation,
                aux_loss_coeff=cfg.moe_aux_loss,
                z_loss_coeff=cfg.moe_z_loss,
                score=cfg.moe_router_score,
                expert_bias=cfg.moe_expert_bias,
                shared_ffn_hidden=cfg.moe_shared_ffn,
                ep_comm=ctx.ep_comm,
                cp_comm=ctx.cp_comm,
                **common,
            )
        else:
            self.mlp = ParallelMLP(cfg.hidden, ffn_hidden_size(cfg), activation=cfg.activation, **common)
        self.dropout = ResidualDropout(cfg.dropout, sp, ctx.rng_tracker)
        self.selective_recompute = ctx.selective_recompute

    def forward(self, x: torch.Tensor, rotary=None, cache=None, documents: Documents | None = None) -> torch.Tensor:
        """`documents`: the micro-batch's packed documents (model.attention_mask=document), else None."""
        if self.selective_recompute and cache is None and self.training and torch.is_grad_enabled():
            if torch.compiler.is_compiling():  # Inductor recomputes what torch's selective checkpointing marks
                return selective_checkpoint(self._forward, x, rotary, None, documents)
            return self._forward_selective(x, rotary, documents)
        return self._forward(x, rotary, cache, documents)

    def _forward(self, x: torch.Tensor, rotary=None, cache=None, documents: Documents | None = None) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.norm1(x), rotary, cache, documents=documents))
        return x + self.dropout(self.mlp(self.norm2(x)))

    def _forward_selective(self, x: torch.Tensor, rotary, documents: Documents | None = None) -> torch.Tensor:
        """`_forward` keeping neither the norm outputs (all-gathered under SP) nor the MLP activation for
        backward: each is freed once its GEMM has run and recomputed when backward reaches that GEMM."""
        normed = RecomputedOutput(lambda t: self.attn.qkv.enter(self.norm1(t)), x)
        a = self.attn(normed.output, rotary, entered=True, documents=documents)
        normed.discard(after=a)
        x = x + self.dropout(a)
        normed = RecomputedOutput(lambda t: self.mlp.enter(self.norm2(t)), x)
        m = self.mlp(normed.output, entered=True, recompute_activation=True)
        normed.discard(after=m)
        return x + self.dropout(m)


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
    def __init__(self, cfg: ModelConfig, ctx: BuildContext):
        super().__init__()
        if ctx.device is None:
            ctx = dataclasses.replace(ctx, device=ctx.comm.device)
        self.cfg, self.ctx, self.comm = cfg, ctx, ctx.comm
        self.stage = ctx.stage
        self.sequence_parallel = ctx.sequence_parallel
        self.cp_rank, self.cp = ctx.cp  # context parallelism: this rank holds S/cp tokens of each sequence
        self.uses_dropout = cfg.dropout > 0 or cfg.attention_dropout > 0  # draws random numbers in training
        sp, dtype, device, seed = ctx.sequence_parallel, ctx.dtype, ctx.device, ctx.seed
        init = normal_init(cfg.init_std)
        vocab = dict(pad_to_multiple_of=cfg.vocab_multiple, comm=ctx.comm, init_method=init, dtype=dtype, device=device)
        self.embedding = self.position = self.final_norm = self.head = None
        if self.stage.first or (self.stage.last and cfg.tie_embeddings):
            with seeded(seed):  # the last stage's tied copy draws the same table
                self.embedding = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden, sequence_parallel=sp, **vocab)
            if cfg.tie_embeddings and not (self.stage.first and self.stage.last):  # gradients summed over both
                tag_param(self.embedding.weight, pipeline_tied=True)
        if self.stage.first and cfg.position == "learned":
            with seeded(seed + 1):
                table = torch.empty(cfg.max_seq_len, cfg.hidden).normal_(0, cfg.init_std)
            # Replicated; under SP each rank embeds only its positions, so its gradient is partial.
            self.position = tag_param(
                nn.Parameter(table.to(device=device, dtype=dtype)), tp_dim=None, sequence_parallel=sp
            )
        self.rotary = (
            RotaryEmbedding(head_dim(cfg), cfg.max_seq_len, cfg.rope_theta, scaling=rope_scaling(cfg)).to(device)
            if cfg.position == "rotary"
            else None
        )
        self.embed_dropout = ResidualDropout(cfg.dropout, sp, ctx.rng_tracker)
        blocks = {}
        for i in self.stage.layer_ids(cfg.layers):
            with seeded(layer_seed(seed, i)):
                blocks[str(i)] = TransformerBlock(cfg, ctx)
        self.blocks = nn.ModuleDict(blocks)
        if self.stage.last:
            norm = dict(bias=cfg.bias, sequence_parallel=sp, dtype=dtype, device=device, mode=ctx.mode)
            self.final_norm = build_norm(cfg.norm, cfg.hidden, cfg.norm_eps, **norm)
            if not cfg.tie_embeddings:
                with seeded(seed + 2):
                    self.head = ParallelLMHead(cfg.hidden, cfg.vocab_size, sequence_parallel=sp, mode=ctx.mode, **vocab)
        self.fused_head_loss = ctx.mode.fused_kernels  # the chunked head + loss kernel; the tied head's decode kernel

    # -- forward --------------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """[b, s] ids -> [s, b, h] (or this rank's [s/tp, b, h] under SP). `positions` [b, s]: each
        token's position (generation); default 0..s-1."""
        ids = input_ids.t()
        x = self.embedding(ids)
        if self.position is not None and positions is not None:
            positions = positions.t()  # [s, b]
            if self.sequence_parallel:  # this rank's tokens
                s = positions.shape[0] // self.comm.size
                positions = positions[self.comm.rank * s : (self.comm.rank + 1) * s]
            x = x + self.position[positions]  # [s(/tp), b, h]
        elif self.position is not None:
            s, tp = ids.shape[0], self.comm.size
            table = self.position[self._local_positions(s)] if self.cp > 1 else self.position[:s]
            if self.sequence_parallel:
                table = table[self.comm.rank * (s // tp) : (self.comm.rank + 1) * (s // tp)]
            x = x + table.unsqueeze(1)
        return self.embed_dropout(x)

    def _local_positions(self, s: int) -> torch.Tensor:
        """Global positions of this CP rank's s tokens (tpframe/layers/context.py)."""
        if s * self.cp > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {s * self.cp} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        return local_positions(s, rank=self.cp_rank, size=self.cp, device=self.ctx.device)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and head: [s(/tp), b, h] -> local logits [s, b, V_padded/tp]."""
        x = self.final_norm(x)
        if self.head is not None:
            return self.head(x)
        return column_parallel_linear(
            x, self.embedding.weight, None, self.comm, self.sequence_parallel, decode_kernel=self.fused_head_loss
        )

    @property
    def needs_input_ids(self) -> bool:
        """Whether a later pipeline stage needs the micro-batch's input ids too (`input_ids=`): it finds the
        documents in them (model.attention_mask=document)."""
        return self.cfg.attention_mask == "document"

    def documents(self, input_ids: torch.Tensor) -> Documents | None:
        """The packed documents of input ids [b, s] (model.attention_mask=document), else None."""
        if self.cfg.attention_mask != "document":
            return None
        if self.cfg.eod_id is None:
            raise ValueError("model.attention_mask=document needs model.eod_id (train.py sets it from the data)")
        if self.cp > 1:  # this rank's tokens [b, S/cp]: the documents are those of the whole rows
            rows = gather_token_ids(input_ids, self.ctx.cp_comm)
            if self.ctx.mode.cp_comm == "all_to_all":  # attention sees whole rows (tpframe/layers/ulysses.py)
                return Documents.from_tokens(rows, self.cfg.eod_id)
            return Documents.for_cp_rank(rows, self.cfg.eod_id, rank=self.cp_rank, size=self.cp)
        return Documents.from_tokens(input_ids, self.cfg.eod_id)

    def forward(
        self, x: torch.Tensor, labels: torch.Tensor | None = None, *, cache=None, input_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """First stage: `x` is input_ids [b, s]; later stages: hidden states [s(/tp), b, h] (and, with
        model.attention_mask=document, `input_ids` [b, s], where the documents are found).

        Returns hidden states [s(/tp), b, h] on a stage that is not the last; on the last, the
        per-token loss [b, s] in fp32 when `labels` is given, else local logits [b, s, V/tp].
        Generation passes a KV cache (tpframe.inference.kv_cache.KVCache, its `begin` already called
        for these tokens): tokens sit at the cache's positions, attention appends to and reads the
        cache, and the result is the local logits of the last position only, [b, V/tp].
        """
        positions = cache.positions if cache is not None else None
        documents = None
        if cache is None and self.cfg.attention_mask == "document":
            if input_ids is None and not self.stage.first:
                raise ValueError("model.attention_mask=document: a later pipeline stage needs input_ids= as well")
            ids = x if self.stage.first else input_ids
            documents = self.documents(ids)
            positions = documents.positions  # [b, S]; under CP, those of this rank's tokens (next line)
            positions = positions if self.cp == 1 else positions[:, self._local_positions(ids.shape[1])]
        if self.stage.first:
            if x.shape[1] > self.cfg.max_seq_len:
                raise ValueError(f"sequence length {x.shape[1]} exceeds model.max_seq_len={self.cfg.max_seq_len}")
            x = self.embed(x, positions)
        rotary = self._rotary(x, positions)
        for n, (i, block) in enumerate(self.blocks.items()):
            if cache is not None:
                x = block(x, rotary, cache.layer(i))
            elif self.training and self.ctx.recomputes_block(n):
                x = recompute(block, x, rotary, None, documents, preserve_rng=self.uses_dropout)
            else:
                x = block(x, rotary, documents=documents)
        if not self.stage.last:
            return x
        if cache is not None:
            return self.logits(x[-1:])[0]  # [b, V/tp]
        return self._loss(x, labels)

    def _rotary(self, x: torch.Tensor, positions: torch.Tensor | None):
        """The rotary tables of these tokens: at `positions` [b, s] (documents, generation), at this CP rank's
        positions, or 0..s-1; None with learned positions."""
        if self.rotary is None:
            return None
        if positions is not None:
            return self.rotary.at(positions, x.dtype)
        s = x.shape[0] * (self.comm.size if self.sequence_parallel else 1)
        if self.cp > 1:
            return self.rotary.at(self._local_positions(s)[None], x.dtype)  # one row of positions, shared by the batch
        return self.rotary(s, x.dtype)

    def _loss(self, x: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """The last stage's end: the per-token loss [b, s] with `labels`, else local logits [b, s, V/tp]. The loss is
        not a view (FSDP2 warns on each rank when a module returns one)."""
        if labels is not None and self.fused_head_loss:  # head + loss without the fp32 logits
            weight = self.head.merged_weight() if self.head is not None else self.embedding.weight
            loss = vocab_parallel_head_cross_entropy(
                self.final_norm(x),
                weight,
                labels.t(),
                comm=self.comm,
                sequence_parallel=self.sequence_parallel,
                vocab_size=self.cfg.vocab_size,
            )
            return loss.t().contiguous()
        logits = self.logits(x)  # [s, b, V/tp]
        if labels is None:
            return logits.transpose(0, 1)
        loss = vocab_parallel_cross_entropy(logits, labels.t(), comm=self.comm, vocab_size=self.cfg.vocab_size)
        return loss.t().contiguous()

    # -- accounting -----------------------------------------------------------------------------
    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token of the whole model (forward + backward = 3x forward), matmuls and attention.

        For the standard GPT this is Megatron's 72*L*h^2 + 12*L*h*s + 6*h*V per token. A MoE model counts
        the experts a token is routed through (top_k), not all of them. With the weights frozen (LoRA) their
        weight-gradient GEMMs do not run: 2x forward for them, not 3x (the rank-r adapters are not counted).
        """
        c = self.cfg
        h, d = c.hidden, head_dim(c)
        q, kv = c.heads * d, (c.kv_heads or c.heads) * d

        def mlp_macs(ffn: int) -> int:  # fc1 (gate and up for swiglu) and fc2
            return h * (2 * ffn if c.activation == "swiglu" else ffn) + ffn * h

        mlp = mlp_macs(ffn_hidden_size(c))
        if c.moe_experts:  # the router, the experts each token goes through, and the shared expert
            mlp = h * c.moe_experts + c.moe_top_k * mlp_macs(moe_ffn_hidden_size(c)) + mlp_macs(c.moe_shared_ffn)
        layer = 2 * (h * (q + 2 * kv) + q * h + mlp) + 4 * seq_len * q
        padded = padded_vocab_size(c.vocab_size, self.comm.size, c.vocab_multiple)
        weights = c.layers * (layer - 4 * seq_len * q) + 2 * h * padded  # forward FLOPs of the weight GEMMs
        matrices = [p for n, p in self.named_parameters() if n.endswith("weight") and p.dim() == 2]
        frozen = bool(matrices) and not any(p.requires_grad for p in matrices)
        return 3.0 * (c.layers * layer + 2 * h * padded) - (weights if frozen else 0)

    # -- what generation and the trainer ask of a model (tpframe/models/protocol.py) ----------------
    def kv_cache_spec(self) -> KVCacheSpec:
        attn = next(iter(self.blocks.values())).attn
        return KVCacheSpec(tuple(self.blocks.keys()), attn.kv_local, attn.head_dim)

    def _moe_layers(self) -> list[MoE]:
        return [block.mlp for block in self.blocks.values() if isinstance(block.mlp, MoE)]

    def start_step(self, micro_batches: int) -> None:
        """MoE: the load-balancing loss weighed like each micro-batch's loss; the step's expert loads counted anew."""
        layers = self._moe_layers()
        for m in layers:
            m.aux_loss_scale = 1.0 / micro_batches
        reset_expert_load(layers)

    def finish_step(self, dp_comm) -> dict[str, float]:
        """MoE with expert biases: after the update, as Megatron-Core does, on the counts of this step only."""
        load_max = update_expert_biases(self._moe_layers(), dp_comm, self.cfg.moe_expert_bias_rate)
        return {} if load_max is None else {"moe_load_max": load_max}

    def aux_losses(self) -> dict[str, torch.Tensor]:
        """The last micro-batch's load-balancing loss (and router z-loss, when on), [sum, count] over this stage's
        MoE layers."""
        kinds = {"moe_aux_loss": "last_aux_loss", **({"moe_z_loss": "last_z_loss"} if self.cfg.moe_z_loss else {})}
        out = {}
        for key, attr in kinds.items() if self.cfg.moe_experts else ():
            values = [v.float() for m in self._moe_layers() if (v := getattr(m, attr)) is not None]
            total = torch.stack(values).sum() if values else torch.zeros((), device=self.ctx.device)
            out[key] = torch.stack([total, torch.tensor(float(len(values)), device=total.device)])
        return out
