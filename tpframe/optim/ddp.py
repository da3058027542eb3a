"""`ddp`: every DP rank holds the whole model and optimizer; gradients averaged by bucketed all-reduces.

Buckets launch their all-reduce while the last micro-batch's backward is still running
(tpframe.optim.grad_buffer), so the DP traffic hides behind compute. AdamW runs on fp32 masters
(bf16 params get an fp32 copy; fp32 params are their own master).
"""

from __future__ import annotations

import torch
from torch import nn

from tpframe.optim.config import OptimConfig
from tpframe.optim.grad_buffer import GradBuffer, allreduce_pipeline_tied_grads, allreduce_sequence_parallel_grads
from tpframe.optim.strategy import (
    MOMENTS,
    STEP_KEY,
    GradStrategy,
    adamw_step,
    adamw_step_count,
    add_chunks,
    add_frozen,
    clip_by_global_norm,
    counts_once,
    ensure_adamw_state,
    make_adamw,
    named_frozen,
    named_trainable,
    needed_keys,
    set_adamw_lr,
    set_adamw_step_count,
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
        # expert parallelism: experts differ between EP ranks and are replicated over the edp group only
        self.expert_params = [p for p in self.params if p.expert] if parallel.ep > 1 else []
        self._expert_ids = {id(p) for p in self.expert_params}
        dense = [p for p in self.params if id(p) not in self._expert_ids]
        self.grads = GradBuffer(
            dense,
            parallel.dp_cp_group,
            dp_size=parallel.dp_cp,
            bucket_bytes=bucket_bytes,
            overlap=overlap,
            mode="all_reduce",
            reduce_dtype=reduce_dtype,
        )
        self.expert_grads = None
        if self.expert_params:  # summed over the expert's replicas, averaged over every rank's loss
            self.expert_grads = GradBuffer(
                self.expert_params,
                parallel.edp_group,
                dp_size=parallel.edp,
                bucket_bytes=bucket_bytes,
                overlap=overlap,
                mode="all_reduce",
                average_over=parallel.dp_cp,
                reduce_dtype=reduce_dtype,
            )
        self.buffers = [g for g in (self.grads, self.expert_grads) if g is not None]
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().clone() for p in self.params]
        # the low-precision params and their fp32 masters, copied back after each update
        self._rounded = [p for p, m in zip(self.params, self.masters) if m is not p]
        self._rounded_masters = [m for p, m in zip(self.params, self.masters) if m is not p]
        decay = [m for m, p in zip(self.masters, self.params) if p.dim() >= 2]
        no_decay = [m for m, p in zip(self.masters, self.params) if p.dim() < 2]
        self.optimizer = make_adamw(decay, no_decay, cfg)

    def zero_grad(self) -> None:
        for g in self.buffers:
            g.zero()

    def start_grad_sync(self) -> None:
        for g in self.buffers:
            g.start_sync()

    def finish_grad_sync(self) -> None:
        for g in self.buffers:
            g.finish_sync()
        sp = [p.main_grad for p in self.params if p.sequence_parallel]
        allreduce_sequence_parallel_grads(sp, self.parallel.tp_comm)
        tied = [p.main_grad for p in self.params if p.pipeline_tied]
        allreduce_pipeline_tied_grads(tied, self.parallel.embedding_comm)

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

    @torch.no_grad()
    def step(self, lr: float) -> None:
        set_adamw_lr(self.optimizer, lr)
        for p, m in zip(self.params, self.masters):
            m.grad = p.main_grad
        adamw_step(self.optimizer)
        for m in self.masters:
            m.grad = None
        if self._rounded:  # one multi-tensor launch, not one copy per parameter
            torch._foreach_copy_(self._rounded, self._rounded_masters)

    def state_dict(self, available: set[str] | None = None) -> dict:
        ensure_adamw_state(self.optimizer)
        tp_rank, tp = self.parallel.tp_rank, self.parallel.tp
        out: dict = {}
        for (name, p), m in zip(self.named, self.masters):
            add_chunks(
                out, "model/{}" if m is not p else weights_key(available), name, p, tp_rank, tp, p.detach().view(-1)
            )
            if m is not p:
                add_chunks(out, "optim/{}/master", name, p, tp_rank, tp, m.view(-1))
            for key in MOMENTS:
                add_chunks(out, "optim/{}/" + key, name, p, tp_rank, tp, self.optimizer.state[m][key].view(-1))
        out[STEP_KEY] = adamw_step_count(self.optimizer)
        add_frozen(out, self.frozen, self.parallel.tp_rank, self.parallel.tp)
        return needed_keys(out, available)

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        set_adamw_step_count(self.optimizer, state[STEP_KEY])
        loaded_masters = any(k.endswith("/master") for k in state)
        for p, m in zip(self.params, self.masters):
            if m is not p:
                if loaded_masters:
                    p.copy_(m)  # the weights the fp32 masters round to
                else:
                    m.copy_(p)  # an fp32 checkpoint into a bf16 run, or weights only
        self.zero_grad()

    def state_bytes(self) -> int:
        ensure_adamw_state(self.optimizer)
        masters = sum(m.numel() * 4 for m, p in zip(self.masters, self.params) if m is not p)
        moments = sum(self.optimizer.state[m][k].numel() * 4 for m in self.masters for k in MOMENTS)
        return masters + moments

    def describe(self) -> str:
        n = sum(len(g.buckets) for g in self.buffers)
        experts = f", experts over ep={self.parallel.ep}" if self.expert_grads is not None else ""
        reduced = ", reduced in bf16" if self.grads.reduce_dtype == torch.bfloat16 else ""
        return (
            f"ddp ({n} gradient bucket{'s' * (n != 1)}, overlap {'on' if self.grads.overlap else 'off'}"
            f"{reduced}{experts})"
        )
