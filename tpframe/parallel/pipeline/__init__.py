"""Pipeline parallelism: the model cut into stages by layer, micro-batches flowing through them.

orders.py   which actions (F, B, W per micro-batch and chunk) each rank runs, per schedule:
            all-forward-all-backward, 1F1B, interleaved 1F1B, ZB-H1; `simulate` checks and costs them
p2p.py      the links between neighbouring stages: one process group per direction and kind,
            fixed shapes, receives bounded by a timeout that names the stage, micro-batch and peer
runtime.py  `PipelineSchedule`: runs an order on this rank's model chunk(s); a sibling of
            tpframe.parallel.schedules.forward_backward_no_pipelining
layout.py   which layers each (virtual) stage holds (tpframe.models.build_stages builds this rank's part)
weight_grad.py  the zero-bubble schedule's deferred weight gradients (the one seam in the layers' GEMMs)
"""

from __future__ import annotations

import torch

from tpframe.parallel.pipeline.layout import (
    ModelChunks,
    local_stages,
    model_chunks,
    pipeline_numel,
    pipeline_union,
    split_layers,
)
from tpframe.parallel.pipeline.orders import (
    SCHEDULES,
    Action,
    schedule_order,
    simulate,
    splits_backward,
    theoretical_bubble,
)
from tpframe.parallel.pipeline.p2p import PipelineLinks, PipelineTimeout
from tpframe.parallel.pipeline.runtime import PipelineSchedule, StageTimer
from tpframe.parallel.state import ParallelState


def build_pipeline(
    state: ParallelState,
    *,
    schedule: str,
    virtual_stages: int = 1,
    seq_len: int,
    micro_batch_size: int,
    hidden: int,
    sequence_parallel: bool,
    dtype: torch.dtype,
    timeout_s: float = 300.0,
    timer: StageTimer | None = None,
) -> PipelineSchedule:
    """The schedule for this rank (collective: every rank of the world calls it, to build the links)."""
    links = PipelineLinks(state, wrap=virtual_stages > 1, timeout_s=timeout_s)
    tokens = seq_len // state.tp if sequence_parallel else seq_len
    return PipelineSchedule(
        state,
        links,
        schedule=schedule,
        virtual_stages=virtual_stages,
        activation_shape=(tokens, micro_batch_size, hidden),
        dtype=dtype,
        timer=timer,
    )


__all__ = [
    "SCHEDULES",
    "Action",
    "ModelChunks",
    "PipelineLinks",
    "PipelineSchedule",
    "PipelineTimeout",
    "StageTimer",
    "build_pipeline",
    "local_stages",
    "model_chunks",
    "pipeline_numel",
    "pipeline_union",
    "schedule_order",
    "simulate",
    "split_layers",
    "splits_backward",
    "theoretical_bubble",
]
