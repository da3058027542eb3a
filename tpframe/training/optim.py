"""AdamW over fp32 master weights, and gradient clipping by the true global norm.

Gradients come from `param.main_grad` (fp32, see tpframe.parallel.data_parallel.GradBuffer).
bf16 parameters get an fp32 master copy that the optimizer updates; the bf16 weights are
refreshed from it after each step. fp32 parameters are their own master.
"""

from __future__ import annotations

import torch
from torch import nn

from tpframe.comm import Communicator
from tpframe.parallel.data_parallel import GradBuffer
from tpframe.training.config import OptimConfig


class MasterAdamW:
    """torch.optim.AdamW on fp32 masters; decay on matrices, none on biases and norm weights."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], cfg: OptimConfig):
        named_params = [(n, p) for n, p in named_params if p.requires_grad]
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().clone() for p in self.params]
        decay = [m for m, p in zip(self.masters, self.params) if p.dim() >= 2]
        no_decay = [m for m, p in zip(self.masters, self.params) if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        on_cuda = self.params[0].device.type == "cuda"
        self.optimizer = torch.optim.AdamW(
            [g for g in groups if g["params"]], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
            fused=on_cuda, foreach=None if on_cuda else True,
        )

    @torch.no_grad()
    def step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        for p, m in zip(self.params, self.masters):
            m.grad = p.main_grad
        self.optimizer.step()
        for p, m in zip(self.params, self.masters):
            m.grad = None
            if m is not p:
                p.copy_(m)

    @torch.no_grad()
    def refresh_masters(self) -> None:
        """Copy the model weights into the fp32 masters (after weights were loaded into the model)."""
        for p, m in zip(self.params, self.masters):
            if m is not p:
                m.copy_(p)

    def named_masters(self) -> list[tuple[str, nn.Parameter, torch.Tensor]]:
        """(name, model param, fp32 master) for every optimized parameter."""
        return list(zip(self.names, self.params, self.masters))


@torch.no_grad()
def clip_grad_norm_(grads: GradBuffer, max_norm: float, mp_comm: Communicator, tp_rank: int) -> float:
    """Global L2 norm of all gradients (each TP shard once, each replicated param once); scale to max_norm.

    Gradients must already be summed over DP (every replica holds the same grads) and over TP for
    sequence-parallel params. `mp_comm` spans one model replica (tp x pp ranks).
    """
    counted = [p.main_grad for p in grads.params if getattr(p, "tp_dim", None) is not None or tp_rank == 0]
    sq = torch.zeros(1, dtype=torch.float32, device=grads.buffer.device)
    if counted:
        sq += torch.stack(torch._foreach_norm(counted)).square().sum()
    mp_comm.all_reduce_(sq)
    norm = sq.sqrt()
    if max_norm > 0:
        grads.buffer.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm.item()
