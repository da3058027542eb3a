"""Schedules: how one optimizer step's micro-batches run forward and backward on this rank.

A schedule is a plain function `(model, batches, num_micro_batches, *, grad_sync, device, loss_scale=None) -> loss`,
where `batches.next()` gives (input_ids, labels) on the CPU and `grad_sync` is the gradient strategy
(its `start_grad_sync()` is called right before the step's last backward, so DP traffic can overlap
it and no earlier micro-batch syncs). The returned loss is the mean over micro-batches (a 0-dim fp32
tensor on `device`), on every rank. Pipeline schedules (tpframe.parallel.pipeline: `PipelineSchedule`,
its `forward_backward` and `forward_only`) are siblings of the two functions here.
"""

from __future__ import annotations

import torch
from torch import nn


def micro_batch_loss(per_token: torch.Tensor, num_micro_batches: int, loss_scale: float | None) -> torch.Tensor:
    """What one micro-batch backpropagates: its mean over the step's micro-batches, or with `loss_scale` (masked
    labels, tpframe/training/loss_mask.py) its sum times the scale."""
    if loss_scale is None:
        return per_token.mean() / num_micro_batches
    return per_token.sum() * loss_scale


def forward_backward_no_pipelining(
    model: nn.Module,
    batches,
    num_micro_batches: int,
    *,
    grad_sync,
    device: torch.device,
    loss_scale: float | None = None,
) -> torch.Tensor:
    """Every micro-batch forward then backward on the whole model; gradients accumulate."""
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    for i in range(num_micro_batches):
        input_ids, labels = batches.next()
        input_ids, labels = input_ids.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        loss = micro_batch_loss(model(input_ids, labels), num_micro_batches, loss_scale)
        if i == num_micro_batches - 1:
            grad_sync.start_grad_sync()
        loss.backward()
        loss_sum += loss.detach()
    return loss_sum


@torch.no_grad()
def forward_only_no_pipelining(
    model: nn.Module, batches, num_micro_batches: int, *, device: torch.device, loss_scale: float | None = None
) -> torch.Tensor:
    """Mean loss over `num_micro_batches` micro-batches, no gradients (evaluation); with `loss_scale`, the sum of
    `micro_batch_loss` (as in training)."""
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    for _ in range(num_micro_batches):
        input_ids, labels = batches.next()
        loss_sum += micro_batch_loss(model(input_ids.to(device), labels.to(device)), 1, loss_scale)
    return loss_sum / max(1, num_micro_batches) if loss_scale is None else loss_sum


def get_forward_backward(pp: int = 1, pipeline=None):
    """The schedule function for a pipeline size (pp=1: no pipelining; else `pipeline`, a PipelineSchedule)."""
    if pp == 1:
        return forward_backward_no_pipelining
    if pipeline is None:
        raise ValueError(f"pp={pp} needs a pipeline schedule (tpframe.parallel.pipeline.build_pipeline)")
    return pipeline.forward_backward


def get_forward_only(pp: int = 1, pipeline=None):
    """The evaluation sibling of `get_forward_backward`."""
    if pp == 1:
        return forward_only_no_pipelining
    if pipeline is None:
        raise ValueError(f"pp={pp} needs a pipeline schedule (tpframe.parallel.pipeline.build_pipeline)")
    return pipeline.forward_only
