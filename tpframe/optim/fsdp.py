"""`fsdp`: PyTorch's own FSDP2 (`fully_shard`) over the DP dimension, composed with tpframe's TP layers.

TP lives inside a replica (the layers hold plain local shards), FSDP2 shards each TP-local param by
rows across DP ranks (`mesh["dp"]`): every block is one FSDP unit, the root holds the embedding,
positions, final norm and head. Params are stored in fp32 (they are the masters); with
`train.dtype=bfloat16` FSDP2 all-gathers them as bf16 for compute and reduce-scatters gradients in
fp32 (`MixedPrecisionPolicy`). Gradients are reduce-scattered after every micro-batch, so the sharded
fp32 grads accumulate across micro-batches (no unsharded bf16 accumulation). AdamW runs on the shards.

With expert parallelism (parallel.ep > 1) each MoE expert is an FSDP unit of its own, sharded over its
replicas (the `edp` group, dp*cp/ep ranks) rather than all of DP x CP, its gradients summed there and
divided by dp*cp like every other gradient (each expert already saw every EP rank's tokens).

FSDP2 replaces the parameter objects, so the TP tags (`tp_dim`, ...) are recorded by name first and
put back on the sharded params: checkpoints hold the same global logical tensors as ddp and zero1.
"""

from __future__ import annotations

import torch
from torch import nn

from tpframe.layers.moe import MoE
from tpframe.layers.utils import param_tags, tag_param
from tpframe.optim.config import OptimConfig
from tpframe.optim.grad_buffer import allreduce_shared_grads
from tpframe.optim.strategy import (
    MOMENTS,
    STEP_KEY,
    GradStrategy,
    add_chunks,
    clip_by_global_norm,
    counts_once,
    ensure_adamw_state,
    finish_state,
    make_adamw,
    named_frozen,
    named_trainable,
    replicas_label,
    set_adamw_lr,
    set_adamw_step_count,
    weights_key,
)
from tpframe.parallel.sharding import local_tensor
from tpframe.parallel.state import ParallelState


def _row_start(p: torch.Tensor) -> int:
    """Global row (of the TP-local param) where this rank's FSDP2 shard starts."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return offset[0] if offset else 0


class FSDPStrategy(GradStrategy):
    name = "fsdp"

    def __init__(
        self,
        model: nn.Module,
        cfg: OptimConfig,
        parallel: ParallelState,
        *,
        compute_dtype: torch.dtype,
        reduce_dtype: torch.dtype = torch.float32,
    ):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.parallel, self.compute_dtype, self.reduce_dtype = parallel, compute_dtype, reduce_dtype
        tags = {n: param_tags(p) for n, p in model.named_parameters()}
        bad = sorted({str(p.dtype) for p in model.parameters()} - {"torch.float32"})
        if bad:
            raise ValueError(
                f"fsdp keeps fp32 params (the masters) and computes in train.dtype; build the model in fp32, got {bad}"
            )
        mixed = compute_dtype != torch.float32
        # gradients reduce-scattered in fp32 (or bf16: parallel.grad_reduce_dtype), then kept in the fp32 shards
        policy = MixedPrecisionPolicy(
            param_dtype=compute_dtype if mixed else None,
            reduce_dtype=reduce_dtype if mixed or reduce_dtype != torch.float32 else None,
        )
        mesh = parallel.dp_cp_mesh  # the gradient replicas: dp (x cp)
        expert_mesh = None
        if parallel.ep > 1:  # an expert's replicas
            from torch.distributed.device_mesh import DeviceMesh

            expert_mesh = DeviceMesh.from_group(parallel.edp_group, parallel.device.type)
        frozen_named = named_frozen(model)  # tags read before FSDP2 replaces the parameters
        frozen = {p for _, p in frozen_named}  # replicated as they are (expert biases); a LoRA base is sharded
        for root in getattr(model, "chunks", [model]):  # pipeline model chunks (interleaved): one root each
            for block in root.blocks.values() if hasattr(root, "blocks") else []:
                moes = [m for m in block.modules() if isinstance(m, MoE)] if expert_mesh else []
                for expert in [e for m in moes for e in m.experts.values()]:
                    fully_shard(expert, mesh=expert_mesh, mp_policy=policy, ignored_params=frozen)
                    if parallel.edp > 1:  # summed over the replicas (gloo has no PREMUL_SUM), then / dp*cp
                        expert.set_force_sum_reduction_for_comms(True)
                    # One replica (ep == dp*cp): FSDP2 runs no collective and divides by the factor itself;
                    # forcing a sum there would divide twice (torch 2.13's single-rank path: the copy divides,
                    # then the post-divide divides again), halving every expert gradient at dp*cp = 2.
                    expert.set_gradient_divide_factor(parallel.dp_cp)
                fully_shard(block, mesh=mesh, mp_policy=policy, ignored_params=frozen)
            fully_shard(root, mesh=mesh, mp_policy=policy, ignored_params=frozen)
        self.model = model
        self.named = named_trainable(model)
        self.frozen = frozen_named
        for name, p in model.named_parameters():  # FSDP2's parameters replace the tagged ones
            tag_param(p, **tags[name])
        params = [p for _, p in self.named]
        self.optimizer = make_adamw(params, params, cfg)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def finish_grad_sync(self) -> None:
        # FSDP2 reduce-scattered every micro-batch; DP ranks shard every TP rank's param the same way,
        # so the partial sequence-parallel shards line up across TP; FSDP2 shards each param on its own:
        # a tied weight's rows split alike on the first and last stage
        grads = [(p, local_tensor(p.grad)) for _, p in self.named if p.grad is not None]
        allreduce_shared_grads(grads, self.parallel)

    def clip_grad_norm(self, max_norm: float) -> float:
        grads = [local_tensor(p.grad) for _, p in self.named if p.grad is not None]
        tp_rank, pp_rank = self.parallel.tp_rank, self.parallel.pp_rank
        counted = [
            local_tensor(p.grad) for _, p in self.named if p.grad is not None and counts_once(p, tp_rank, pp_rank)
        ]
        comms = [self.parallel.dp_cp_comm, self.parallel.mp_comm]
        return clip_by_global_norm(counted, grads, max_norm, comms, self.parallel.device)

    @torch.no_grad()
    def step(self, lr: float) -> None:
        set_adamw_lr(self.optimizer, lr)
        self.optimizer.step()

    def _pieces(self, out: dict, key: str, name: str, p: torch.Tensor, data: torch.Tensor) -> None:
        local = local_tensor(data)
        assert local.is_contiguous()
        cols = p.shape[1] if p.dim() == 2 else 1
        add_chunks(out, key, name, p, self.parallel.tp_rank, self.parallel.tp, local.view(-1), _row_start(p) * cols)

    def state_dict(self, available: set[str] | None = None) -> dict:
        ensure_adamw_state(self.optimizer)
        mixed = self.compute_dtype != torch.float32
        out: dict = {}
        for name, p in self.named:
            if available is None:  # saving: the weights computed with, and (bf16 runs) the fp32 master
                param = local_tensor(p.detach()).to(self.compute_dtype) if mixed else p.detach()
                self._pieces(out, "model/{}", name, p, param)
                if mixed:
                    self._pieces(out, "optim/{}/master", name, p, p.detach())
            else:  # loading: the fp32 param is the master, so it takes the checkpoint's master where there is one
                self._pieces(out, weights_key(available), name, p, p.detach())
            for key in MOMENTS:
                self._pieces(out, "optim/{}/" + key, name, p, self.optimizer.state[p][key])
        return finish_state(out, available, optimizer=self.optimizer, frozen=self.frozen, parallel=self.parallel)

    def load_state_dict(self, state: dict) -> None:
        set_adamw_step_count(self.optimizer, state[STEP_KEY])

    def state_bytes(self) -> int:
        ensure_adamw_state(self.optimizer)
        moments = sum(local_tensor(self.optimizer.state[p][k]).numel() * 4 for _, p in self.named for k in MOMENTS)
        return moments  # the sharded fp32 params are the masters and the model at once

    def describe(self) -> str:
        experts = (
            f", experts over their {self.parallel.edp} replicas (ep={self.parallel.ep})" if self.parallel.ep > 1 else ""
        )
        return (
            f"fsdp (FSDP2 over {replicas_label(self.parallel)}{experts}, fp32 shards, "
            f"compute in {str(self.compute_dtype).replace('torch.', '')}"
            f"{', reduced in bf16' if self.reduce_dtype == torch.bfloat16 else ''})"
        )
