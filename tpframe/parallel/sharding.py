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

import sys
from dataclasses import dataclass

import torch


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: an FSDP2 DTensor's local shard, any other tensor itself. (No DTensor exists before
    its module is imported: importing it here would cost every process a second at start.)"""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return t._local_tensor if dtensor is not None and isinstance(t, dtensor.DTensor) else t


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
    tp_dim = p.tp_dim
    full = tuple(p.shape)
    whole = tuple(slice(None) for _ in full)
    parts = p.fused_parts
    if parts is not None:  # each part row-split over TP (or, replicated, whole on every rank: a LoRA adapter's A)
        shards, start = [], 0
        split = tp_size if tp_dim is not None else 1
        for part, size in parts:
            rows = size // split
            index = (slice(start, start + rows),) + whole[1:]
            offset = ((tp_rank if tp_dim is not None else 0) * rows,) + (0,) * (len(full) - 1)
            shards.append(LogicalShard(_part_name(name, part), name, (size,) + full[1:], offset, tp_dim, index))
            start += rows
        return shards
    if tp_dim is None:
        return [LogicalShard(name, name, full, (0,) * len(full), None, whole)]
    local = full[tp_dim]
    global_shape = full[:tp_dim] + (local * tp_size,) + full[tp_dim + 1 :]
    offset = [0] * len(full)
    offset[tp_dim] = tp_rank * local
    index = list(whole)
    vocab_rows = p.vocab_rows if trim_vocab else None
    if vocab_rows is not None:  # drop the padding rows from the logical tensor
        assert tp_dim == 0
        global_shape = (vocab_rows,) + full[1:]
        keep = max(0, min(local, vocab_rows - tp_rank * local))
        index[0] = slice(0, keep)
        offset[0] = min(tp_rank * local, vocab_rows)
    return [LogicalShard(name, name, global_shape, tuple(offset), tp_dim, tuple(index))]


# -- pieces of global tensors, as DCP stores them ---------------------------------------------


class LogicalChunks:
    """This rank's pieces of one global (logical) tensor, each a rectangle at an explicit offset.

    What every gradient/optimizer strategy hands the checkpointer: a TP shard is one rectangle, a
    ZeRO-1 flat range of a parameter up to three (partial first row, whole rows, partial last row),
    an FSDP2 row shard one per logical part. Pieces are views into live storage, so DCP writes them
    out and loads into them in place. Implements DCP's `_Checkpointable` hooks; replicated pieces
    (same offset on several ranks) are written once by DCP's de-duplication.
    """

    def __init__(self, global_shape: tuple[int, ...], pieces: list[tuple[tuple[int, ...], torch.Tensor]]):
        self.global_shape = torch.Size(global_shape)
        self.pieces = [(tuple(o), t) for o, t in pieces]
        for offset, t in self.pieces:
            assert len(offset) == len(self.global_shape) == t.dim(), (offset, t.shape, self.global_shape)

    def size(self) -> torch.Size:
        return self.global_shape

    def map(self, fn) -> LogicalChunks:
        """The same pieces, each tensor passed through `fn` (e.g. a CPU copy for an async save)."""
        return LogicalChunks(self.global_shape, [(o, fn(t)) for o, t in self.pieces])

    def __create_write_items__(self, fqn: str, obj: object) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(o)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.shape),
                    properties=TensorProperties.create_from_tensor(t),
                    size=self.global_shape,
                ),
            )
            for o, t in self.pieces
        ]

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.shape) for o, t in self.pieces]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        for o, t in self.pieces:
            if torch.Size(o) == index.offset:
                return t
        raise ValueError(f"{index.fqn}: no piece at offset {tuple(index.offset)} on this rank")


def range_rectangles(
    shard: LogicalShard, shape: tuple[int, ...], flat: torch.Tensor, start: int = 0
) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """The rectangles of `shard`'s piece held in `flat`, as (global offset, view of `flat`) pairs.

    `flat` holds elements [start, start + flat.numel()) of a parameter-shaped tensor of `shape`
    (flattened): the whole parameter (ddp), a ZeRO-1 flat range, an FSDP2 row shard. A piece is a
    block of whole rows of the parameter; the part of it inside the range is at most three
    rectangles: the tail of a first row, whole rows, the head of a last row.
    """
    if len(shape) > 2:
        raise ValueError(f"{shard.name}: sharded state supports parameters of at most 2 dims, got {tuple(shape)}")
    if len(shape) == 0:
        return [((), flat.view(()))] if flat.numel() else []
    cols = shape[1] if len(shape) == 2 else 1
    rows = shard.index[0]
    p0 = rows.start or 0
    p1 = shape[0] if rows.stop is None else rows.stop
    lo, hi = max(start, p0 * cols), min(start + flat.numel(), p1 * cols)
    if hi <= lo:
        return []

    def part(a: int, b: int) -> torch.Tensor:
        return flat[a - start : b - start]

    if len(shape) == 1:
        return [((shard.offset[0] + lo - p0,), part(lo, hi))]
    off_r, off_c = shard.offset[0] - p0, shard.offset[1]  # global row of local row 0, global column of local column 0
    r0, c0 = divmod(lo, cols)
    r1, c1 = divmod(hi, cols)
    if r0 == r1:
        return [((off_r + r0, off_c + c0), part(lo, hi).view(1, -1))]
    out = []
    if c0:
        out.append(((off_r + r0, off_c + c0), part(lo, (r0 + 1) * cols).view(1, -1)))
        r0 += 1
    if r1 > r0:
        out.append(((off_r + r0, off_c), part(r0 * cols, r1 * cols).view(r1 - r0, cols)))
    if c1:
        out.append(((off_r + r1, off_c), part(r1 * cols, hi).view(1, -1)))
    return out


def chunks_of(
    name: str,
    param: torch.Tensor,
    tp_rank: int,
    tp: int,
    flat: torch.Tensor,
    start: int = 0,
    shape: tuple[int, ...] | None = None,
) -> dict[str, tuple[tuple[int, ...], list]]:
    """{logical name: (global shape, rectangles)} of a parameter-shaped tensor's elements held in `flat`
    ([start, start + numel) of the flattened tensor; `shape` defaults to `param`'s). Vocabulary tables
    keep their padding rows (every rank's piece an even chunk)."""
    out = {}
    for shard in param_shards(name, param, tp_rank, tp, trim_vocab=False):
        rects = range_rectangles(shard, tuple(param.shape) if shape is None else shape, flat, start)
        if rects:
            out[shard.name] = (shard.global_shape, rects)
    return out
