"""Vocab-parallel embedding: each TP rank holds a contiguous block of vocabulary rows."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tpframe.comm import Communicator
from tpframe.layers.linear import column_parallel_linear
from tpframe.layers.lora import column_adapter, merged_weight
from tpframe.layers.mappings import reduce_from_tp, reduce_scatter_to_sp
from tpframe.layers.mode import DEFAULT_MODE, LayerMode
from tpframe.layers.utils import InitMethod, normal_init, tag_param
from tpframe.parallel.state import default_tp_comm


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 1) -> int:
    """Smallest size >= vocab_size divisible by both tp and `multiple` (e.g. 128 for fast GEMMs).

    With `multiple` a multiple of tp (128 and tp in 1..128, powers of two) the padded size does
    not depend on tp, so checkpoints move between layouts unchanged.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    step = math.lcm(tp, max(1, multiple))
    return -(-vocab_size // step) * step


def vocab_parameter(
    vocab_size: int,
    hidden: int,
    *,
    padded: int,
    comm: Communicator,
    init_method: InitMethod | None,
    dtype: torch.dtype,
    device: torch.device | str | None,
) -> nn.Parameter:
    """This rank's rows [padded/tp, hidden] of a vocabulary table, tagged as split by rows over TP.

    The master covers the real vocabulary only (the same draws at any padding), padded with zeros.
    """
    master = torch.empty(vocab_size, hidden, dtype=torch.float32)
    init = init_method or normal_init()
    init(master)
    master = F.pad(master, (0, 0, 0, padded - vocab_size))
    rows = padded // comm.size
    shard = master[comm.rank * rows : (comm.rank + 1) * rows].to(device=device or comm.device, dtype=dtype)
    return tag_param(nn.Parameter(shard.contiguous()), tp_dim=0, vocab_rows=vocab_size)  # then padding rows


class VocabParallelEmbedding(nn.Module):
    """Token ids -> embeddings, with the table split by vocabulary rows across TP.

    weight: [V_padded/tp, H], rank r holds rows r*V_padded/tp:(r+1)*V_padded/tp. Rows past the real
    vocabulary are zero padding. Output: ids.shape + [H], summed over TP (all-reduce), or
    reduce-scattered along dim 0 with sequence parallelism (ids given sequence-first, [s, b]).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        sequence_parallel: bool = False,
        pad_to_multiple_of: int = 1,
        comm: Communicator | None = None,
        init_method: InitMethod | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.comm = comm or default_tp_comm()
        tp, rank = self.comm.size, self.comm.rank
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padded_num_embeddings = padded_vocab_size(num_embeddings, tp, pad_to_multiple_of)
        self.rows_per_rank = self.padded_num_embeddings // tp
        self.vocab_start = rank * self.rows_per_rank
        self.sequence_parallel = sequence_parallel
        self.weight = vocab_parameter(
            num_embeddings,
            embedding_dim,
            padded=self.padded_num_embeddings,
            comm=self.comm,
            init_method=init_method,
            dtype=dtype,
            device=device,
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.comm.size == 1:
            out = F.embedding(ids, self.weight)
        else:
            local = ids - self.vocab_start
            outside = (local < 0) | (local >= self.rows_per_rank)
            out = F.embedding(local.masked_fill(outside, 0), self.weight)
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        # the masked lookup is fresh and not saved for backward: NCCL may reduce it in place
        if self.sequence_parallel:
            return reduce_scatter_to_sp(out, self.comm)
        return reduce_from_tp(out, self.comm, donate=True)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings} (padded {self.padded_num_embeddings}, {self.rows_per_rank}/rank), "
            f"{self.embedding_dim}, sp={self.sequence_parallel}"
        )


class ParallelLMHead(nn.Module):
    """The output layer: hidden [s(/tp), b, h] -> local logits [s, b, V_padded/tp] (column-parallel).

    weight [V_padded/tp, h], split by vocabulary rows like `VocabParallelEmbedding` (padding rows are
    zero and never a target). A tied head has no weight of its own: call `logits(x, embedding.weight)`.
    """

    def __init__(
        self,
        hidden: int,
        vocab_size: int,
        *,
        sequence_parallel: bool = False,
        pad_to_multiple_of: int = 1,
        comm: Communicator | None = None,
        init_method: InitMethod | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        mode: LayerMode = DEFAULT_MODE,
    ):
        super().__init__()
        self.comm = comm or default_tp_comm()
        self.vocab_size, self.sequence_parallel = vocab_size, sequence_parallel
        padded = padded_vocab_size(vocab_size, self.comm.size, pad_to_multiple_of)
        self.weight = vocab_parameter(
            vocab_size, hidden, padded=padded, comm=self.comm, init_method=init_method, dtype=dtype, device=device
        )
        where = dict(in_features=hidden, tp=self.comm.size, dtype=dtype, device=device or self.comm.device)
        column_adapter(self, mode.lora, "head", (("weight", padded),), fused=False, vocab_rows=vocab_size, **where)
        self.fused_decode = mode.fused_kernels  # the one-row kernel in batch-1 decode graphs (tpframe/kernels/gemv.py)

    def merged_weight(self) -> torch.Tensor:
        """The weight the head computes with: W, or W + (alpha/r) B A with an adapter (optim.lora_targets: head)."""
        return merged_weight(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_parallel_linear(
            x, self.merged_weight(), None, self.comm, self.sequence_parallel, decode_kernel=self.fused_decode
        )
