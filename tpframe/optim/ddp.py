"""`ddp`: every DP rank holds the whole model and optimizer; gradients averaged by bucketed all-reduces.

Buckets launch their all-reduce while the last micro-batch's backward is still running
(tpframe.optim.grad_buffer), so the DP traffic hides behind compute. AdamW runs on fp32 masters
(bf16 params get an fp32 copy; fp32 params are their own master).
"""

from __future__ import annotations

import torch
from torch import nn

from tpframe.optim.config import OptimConfig
from tpframe.optim.grad_buffer import allreduce_shared_grads, replica_grad_buffers
from tpframe.optim.strategy import (
    STEP_KEY,
    GradStrategy,
    add_chunks,
    add_master_chunks,
    clip_by_global_norm,
    counts_once,
    ensure_adamw_state,
    finish_state,
    make_adamw,
    master_state_bytes,
    named_frozen,
    named_trainable,
    restore_masters,
    set_adamw_step_count,
    step_masters,
    weights_key,
)
from tpframe.parallel.state import ParallelState


class DDPStrategy(GradStrategy):
    name = "ddp"

    def __init__(
        self,
        model: nn.Module,
        cfg: OptimConfig,
        parallel: ParallelState,
        *,
        bucket_bytes: int = 40 * 2**20,
        overlap: bool = True,
        reduce_dtype: torch.dtype = torch.float32,
    ):
        self.parallel = parallel
        self.named = named_trainable(model)
        self.frozen = named_frozen(model)
        self.params = [p for _, p in self.named]
        self.buffers = replica_grad_buffers(
            self.params,
            parallel,
            mode="all_reduce",
            bucket_bytes=bucket_bytes,
            overlap=overlap,
            reduce_dtype=reduce_dtype,
        )
        self.grads = self.buffers[0]
        self.expert_grads = self.buffers[1] if len(self.buffers) > 1 else None
        # expert parallelism: experts differ between EP ranks and are replicated over the edp group only
        self.expert_params = [p for p in self.params if p.expert] if self.expert_grads else []
        self._expert_ids = {id(p) for p in self.expert_params}
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().clone() for p in self.params]
        self.optimizer = make_adamw(self.masters, self.params, cfg)

    def zero_grad(self) -> None:
        for g in self.buffers:
            g.zero()

    def start_grad_sync(self) -> None:
        for g in self.buffers:
            g.start_sync()

    def finish_grad_sync(self) -> None:
        for g in self.buffers:
            g.finish_sync()
        allreduce_shared_grads([(p, p.main_grad) for p in self.params], self.parallel)

    def clip_grad_norm(self, max_norm: float) -> float:
        # grads are equal on every DP replica: sum over one model replica (tp x pp) only
        counted = [
            p.main_grad
            for p in self.params
            if counts_once(p, self.parallel.tp_rank, self.parallel.pp_rank) and id(p) not in self._expert_ids
        ]
        experts = [p.main_grad for p in self.expert_params]  # TP shards: each counts; different on each EP rank
        return clip_by_global_norm(
            counted,
            [g.buffer for g in self.buffers],
            max_norm,
            [self.parallel.mp_comm],
            self.grads.buffer.device,
            optimizer=self.optimizer,
            split=(experts, self.parallel.ep_comm) if experts else None,
        )

    def step(self, lr: float) -> None:
        step_masters(self.optimizer, lr, self.masters, [p.main_grad for p in self.params], self.params)

    def state_dict(self, available: set[str] | None = None) -> dict:
        ensure_adamw_state(self.optimizer)
        tp_rank, tp = self.parallel.tp_rank, self.parallel.tp
        out: dict = {}
        for (name, p), m in zip(self.named, self.masters):
            add_chunks(
                out, "model/{}" if m is not p else weights_key(available), name, p, tp_rank, tp, p.detach().view(-1)
            )
            add_master_chunks(out, self.optimizer, name, p, m, tp_rank, tp, own=m is p)
        return finish_state(out, available, optimizer=self.optimizer, frozen=self.frozen, parallel=self.parallel)

    def load_state_dict(self, state: dict) -> None:
        set_adamw_step_count(self.optimizer, state[STEP_KEY])
        restore_masters(self.masters, self.params, state)
        self.zero_grad()

    def state_bytes(self) -> int:
        ensure_adamw_state(self.optimizer)
        return master_state_bytes(self.masters, self.params)

    def describe(self) -> str:
        n = sum(len(g.buckets) for g in self.buffers)
        experts = f", experts over ep={self.parallel.ep}" if self.expert_grads is not None else ""
        reduced = ", reduced in bf16" if self.grads.reduce_dtype == torch.bfloat16 else ""
        return (
            f"ddp ({n} gradient bucket{'s' * (n != 1)}, overlap {'on' if self.grads.overlap else 'off'}"
            f"{reduced}{experts})"
        )
