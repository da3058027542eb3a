"""No loss on the token after an end-of-document (data.eod_mask_loss, Megatron's --eod-mask-loss), with the loss
averaged over the tokens that carry one, across the whole global batch.

An end-of-document token's label is the first token of an unrelated document. With the mask on, that label
becomes -100 (the cross entropy ignores it: loss 0, no gradient), and the step's loss is the sum over the
tokens that count divided by how many there are in the global batch, not by every token: on every layout
the same number (micro-batches hold different counts, so a mean per micro-batch would weigh tokens unequally).

    batches = StepBatches(train_data, num_micro_batches, eod_id)     # the step's micro-batches, read up front
    scale = per_token_scale(batches.valid_tokens, state)             # dp*cp / (valid tokens, all ranks)
    loss = schedule(model, batches, num_micro_batches, ..., loss_scale=scale)

A schedule given `loss_scale` backpropagates `per_token_loss.sum() * loss_scale` per micro-batch: after the data-
parallel average of the gradients (a division by dp*cp) each token weighs 1/N, N the global batch's valid tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

IGNORE_INDEX = -100  # the label the cross entropy skips


def mask_after_end_of_document(input_ids: torch.Tensor, labels: torch.Tensor, eod_id: int) -> torch.Tensor:
    """`labels` with IGNORE_INDEX where the input token is `eod_id` (a new tensor)."""
    return labels.masked_fill(input_ids == eod_id, IGNORE_INDEX)


class StepBatches:
    """`n` micro-batches of `batches`, read at once, their labels masked after each end-of-document token;
    `valid_tokens` counts the labels that carry a loss. Other attributes are the wrapped iterator's."""

    def __init__(self, batches, n: int, eod_id: int):
        self.batches = batches
        self.items = []
        for _ in range(n):
            ids, labels = batches.next()
            self.items.append((ids, mask_after_end_of_document(ids, labels, eod_id)))
        self.valid_tokens = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in self.items)
        self._next = 0

    def next(self):
        if self._next == len(self.items):
            raise RuntimeError(f"a schedule asked for more than the step's {len(self.items)} micro-batches")
        self._next += 1
        return self.items[self._next - 1]

    __next__ = next

    def __getattr__(self, name):
        return getattr(self.batches, name)


def per_token_scale(valid_tokens: int, state) -> float:
    """dp*cp over the valid tokens of every DP x CP rank (TP and PP peers read the same tokens: counted once)."""
    total = torch.tensor([float(valid_tokens)], dtype=torch.float64)
    if state.dp_cp > 1:
        device = state.device if dist.get_backend(state.dp_cp_group) == dist.Backend.NCCL else torch.device("cpu")
        total = total.to(device)
        dist.all_reduce(total, group=state.dp_cp_group)
    return state.dp_cp / max(float(total.item()), 1.0)
