"""Which layers each pipeline stage holds, and building this rank's stage(s) of a model.

With `pp` ranks and `v` virtual stages per rank the model is cut into pp*v consecutive virtual stages;
virtual stage s lives on pipeline rank s % pp as its local chunk s // pp (v > 1: interleaved
schedules). Layers split evenly, or by `layers_per_stage` (one count per virtual stage, in model order).
"""

from __future__ import annotations

from torch import nn


def split_layers(num_layers: int, stages: int, layers_per_stage: list[int] | None = None) -> list[tuple[int, ...]]:
    """The global layer indices of each virtual stage, in model order."""
    if layers_per_stage is None:
        if num_layers % stages:
            raise ValueError(f"{num_layers} layers do not split evenly into {stages} pipeline stages")
        layers_per_stage = [num_layers // stages] * stages
    if len(layers_per_stage) != stages or sum(layers_per_stage) != num_layers or min(layers_per_stage) < 1:
        raise ValueError(f"layers per stage {layers_per_stage}: need {stages} counts >= 1 adding up to {num_layers}")
    out, start = [], 0
    for count in layers_per_stage:
        out.append(tuple(range(start, start + count)))
        start += count
    return out


def local_stages(pp_rank: int, pp: int, virtual_stages: int = 1) -> list[int]:
    """The virtual stages pipeline rank `pp_rank` holds, as its chunks 0, 1, ..."""
    return [chunk * pp + pp_rank for chunk in range(virtual_stages)]


class ModelChunks(nn.Module):
    """A rank's model chunks under an interleaved schedule. Parameters keep the chunks' own names
    (blocks under global layer indices), so strategies and checkpoints see one model, not a split."""

    def __init__(self, chunks: list[nn.Module]):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for chunk in self.chunks:
            yield from chunk.named_parameters(prefix, recurse, remove_duplicate)

    def flops_per_token(self, seq_len: int) -> float:
        return self.chunks[0].flops_per_token(seq_len)

    # the trainer's hooks (tpframe/models/protocol.py), each chunk's in turn
    def start_step(self, micro_batches: int) -> None:
        for chunk in self.chunks:
            if hasattr(chunk, "start_step"):
                chunk.start_step(micro_batches)

    def finish_step(self, dp_comm) -> dict[str, float]:
        done = [chunk.finish_step(dp_comm) for chunk in self.chunks if hasattr(chunk, "finish_step")]
        return {k: max(d[k] for d in done) for k in done[0]} if done else {}  # e.g. the worst expert load

    def aux_losses(self) -> dict:
        done = [chunk.aux_losses() for chunk in self.chunks if hasattr(chunk, "aux_losses")]
        return {k: sum(d[k] for d in done) for k in done[0]} if done else {}  # [sum, count] pairs add up

    def forward(self, *args, **kwargs):
        raise RuntimeError("model chunks run through a pipeline schedule (tpframe.parallel.pipeline), not forward()")


def model_chunks(model: nn.Module) -> list[nn.Module]:
    return list(model.chunks) if isinstance(model, ModelChunks) else [model]


def pipeline_numel(model: nn.Module, state) -> int:
    """Parameters of the whole model this rank holds a part of (every stage's, every EP rank's experts, a tied copy
    once; TP-unsplit, vocabulary padding excluded). Collective over the pipeline and expert-parallel groups."""
    import math

    import torch

    from tpframe.parallel.sharding import param_shards

    held = [(n, p) for n, p in model.named_parameters() if not (p.pipeline_tied and state.pp_rank)]

    def numel(params) -> int:
        return sum(math.prod(s.global_shape) for n, p in params for s in param_shards(n, p, 0, state.tp))

    mine = numel((n, p) for n, p in held if not p.expert)
    experts = numel((n, p) for n, p in held if p.expert)  # this EP rank's experts only
    if state.ep > 1:
        experts = int(
            state.ep_comm.all_reduce(torch.tensor([experts], dtype=torch.float64, device=state.device)).item()
        )
    mine += experts
    if state.pp == 1:
        return mine
    return int(state.pp_comm.all_reduce(torch.tensor([mine], dtype=torch.float64, device=state.device)).item())


def pipeline_union(state, names: list[str]) -> list[str]:
    """The union of `names` over the pipeline stages (e.g. every vocabulary table of the model). Collective."""
    if state.pp == 1:
        return names
    import torch.distributed as dist

    gathered: list = [None] * state.pp
    dist.all_gather_object(gathered, names, group=state.pp_group)
    return sorted({n for part in gathered for n in part})
