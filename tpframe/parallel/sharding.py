"""From local TP shards to logical global tensors, and back.

Every parameter carries `tp_dim` (the dim split across TP, or None), optionally `fused_parts`
(several logical tensors fused along dim 0, each row-split on its own) and `vocab_rows` (a
vocabulary table padded past its real rows). `param_shards` turns a rank's parameters into
pieces of named global tensors (what checkpoints store, so any TP layout can read them):

    blocks.0.attn.qkv.weight  [(q+2kv)/tp, h]  ->  blocks.0.attn.qkv.q.weight [q, h] rows r*q/tp..
                                                    blocks.0.attn.qkv.k.weight [kv, h] ...
    embedding.weight          [Vp/tp, h]       ->  embedding.weight [V, h] (padding rows dropped)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from tpframe.comm import Communicator


@dataclass
class LogicalShard:
    name: str  # the logical (global) tensor's name
    param_name: str  # the local parameter it comes from
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]  # where this rank's piece starts in the global tensor
    tp_dim: int | None
    index: tuple[slice, ...]  # the piece inside the local parameter

    def view(self, local: torch.Tensor) -> torch.Tensor:
        """This shard's piece of `local` (the parameter, its master copy or an optimizer moment)."""
        return local[self.index]


def _part_name(param_name: str, part: str) -> str:
    module, _, leaf = param_name.rpartition(".")
    return f"{module}.{part}.{leaf}" if module else f"{part}.{leaf}"


def param_shards(name: str, p: torch.Tensor, tp_rank: int, tp_size: int, trim_vocab: bool = True) -> list[LogicalShard]:
    """The logical pieces of one local parameter. `trim_vocab=False` keeps vocabulary padding rows
    (checkpoints store the padded table, so every rank's piece is an even chunk)."""
    tp_dim = getattr(p, "tp_dim", None)
    full = tuple(p.shape)
    whole = tuple(slice(None) for _ in full)
    if tp_dim is None:
        return [LogicalShard(name, name, full, (0,) * len(full), None, whole)]
    parts = getattr(p, "fused_parts", None)
    if parts is not None:
        shards, start = [], 0
        for part, size in parts:
            rows = size // tp_size
            index = (slice(start, start + rows),) + whole[1:]
            shards.append(LogicalShard(_part_name(name, part), name, (size,) + full[1:], (tp_rank * rows,) + (0,) * (len(full) - 1), 0, index))
            start += rows
        return shards
    local = full[tp_dim]
    global_shape = full[:tp_dim] + (local * tp_size,) + full[tp_dim + 1 :]
    offset = [0] * len(full)
    offset[tp_dim] = tp_rank * local
    index = list(whole)
    vocab_rows = getattr(p, "vocab_rows", None) if trim_vocab else None
    if vocab_rows is not None:  # drop the padding rows from the logical tensor
        assert tp_dim == 0
        global_shape = (vocab_rows,) + full[1:]
        keep = max(0, min(local, vocab_rows - tp_rank * local))
        index[0] = slice(0, keep)
        offset[0] = min(tp_rank * local, vocab_rows)
    return [LogicalShard(name, name, global_shape, tuple(offset), tp_dim, tuple(index))]


def logical_numel(model: nn.Module, tp_size: int) -> int:
    """Parameters of the TP-unsplit model that `model` is one TP shard of (vocabulary padding excluded)."""
    return sum(math.prod(s.global_shape) for n, p in model.named_parameters() for s in param_shards(n, p, 0, tp_size))


@torch.no_grad()
def gather_full_tensors(model: nn.Module, comm: Communicator, source: str = "param") -> dict[str, torch.Tensor]:
    """Assemble every logical tensor in full on every TP rank (for tests, export and debugging).

    `source` is "param" (the weights) or "main_grad"/"grad" (the gradients).
    """
    full: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        local = p.detach() if source == "param" else getattr(p, source)
        # untrimmed pieces are equal-sized on every rank; the vocabulary padding is cut after the gather
        for shard in param_shards(name, p, comm.rank, comm.size, trim_vocab=False):
            if shard.tp_dim is None:
                full[shard.name] = local.clone()
                continue
            gathered = comm.all_gather(shard.view(local).contiguous(), dim=shard.tp_dim)
            rows = getattr(p, "vocab_rows", None)
            full[shard.name] = gathered[:rows] if rows is not None else gathered
    return full
