"""Tensor-parallel building blocks: mappings, linear, embedding and head, cross entropy, norms, attention, MLP."""

from tpframe.layers.cross_entropy import vocab_parallel_cross_entropy
from tpframe.layers.embedding import ParallelLMHead, VocabParallelEmbedding, padded_vocab_size
from tpframe.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    column_parallel_linear,
    row_parallel_linear,
)
from tpframe.layers.mappings import (
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_tp,
)
from tpframe.layers.mlp import ParallelMLP
from tpframe.layers.norm import LayerNorm, RMSNorm, build_norm

__all__ = [
    "ColumnParallelLinear",
    "LayerNorm",
    "ParallelLMHead",
    "ParallelMLP",
    "RMSNorm",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "build_norm",
    "column_parallel_linear",
    "copy_to_tp",
    "gather_from_sp",
    "gather_from_tp",
    "padded_vocab_size",
    "reduce_from_tp",
    "reduce_scatter_to_sp",
    "row_parallel_linear",
    "scatter_to_tp",
    "vocab_parallel_cross_entropy",
]
