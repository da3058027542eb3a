"""The first step of every launch checks that weights replicated over TP get the same gradient on every TP rank.

A weight replicated over TP (`tag_param(p, tp_dim=None)`) stays one weight only if every TP rank updates it alike. When
its layer sees different activations on each TP rank (the rank's sequence slice under sequence parallelism, or
the rank's heads), each rank's gradient is partial, and the strategies sum it over TP only for weights tagged
`sequence_parallel`. A plug-in model that forgets the tag (a norm built without
`sequence_parallel=ctx.sequence_parallel`) would train on while its copies drift apart, and a checkpoint would
keep TP rank 0's copy: silent corruption. So on the launch's first step the trainer records what backward
computed for each untagged replicated weight on this rank (before any sync) and compares it over the TP group.

On a correct model those gradients are bit-identical: the layer's inputs and output gradients are the same on
every TP rank (they come out of TP collectives, which give every rank the same bits; tpframe's own kernels sum in
rank order). A partial gradient differs by far more than MAX_SPREAD, so the check cannot mistake one for the other.

    check = ReplicaGradCheck(model, tp_comm)   # hooks on, recording
    with check:
        forward_backward(...)
    check.verify()                             # ConfigError naming the weights (every rank of the world stops)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tpframe.comm import Communicator
from tpframe.errors import ConfigError
from tpframe.parallel.sharding import local_tensor

MAX_SPREAD = 1e-3  # largest |g_rank - g_rank0| / |g| tolerated for a replicated weight's gradient


def watched(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The trainable weights replicated over TP whose gradient no strategy sums over TP."""
    return [
        (n, p) for n, p in model.named_parameters() if p.requires_grad and p.tp_dim is None and not p.sequence_parallel
    ]


class ReplicaGradCheck:
    """Records, while entered, the gradient backward computes for each `watched` weight on this rank (summed over
    the micro-batches and uses); `verify` compares the records over `tp_comm` (every rank must call it)."""

    def __init__(self, model: nn.Module, tp_comm: Communicator, *, device: torch.device | str = "cpu"):
        self.params, self.comm, self.device = watched(model), tp_comm, torch.device(device)
        self.grads: dict[int, torch.Tensor] = {}
        self._hooks: list = []

    def _record(self, i: int, grad: torch.Tensor) -> None:
        g = local_tensor(grad).detach().float()
        self.grads[i] = self.grads[i] + g if i in self.grads else g.clone()

    def __enter__(self) -> ReplicaGradCheck:
        self._hooks = [p.register_hook(lambda g, i=i: self._record(i, g)) for i, (_, p) in enumerate(self.params)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _recorded(self, i: int, p: nn.Parameter) -> torch.Tensor:
        """What backward gave p on this rank: the hooks' sum, or (FSDP2, whose sharded params backward does not
        reach) its reduce-scattered shard, or zeros if it got no gradient."""
        if i in self.grads:
            return self.grads[i]
        if p.grad is not None:
            return local_tensor(p.grad).detach().float()
        return torch.zeros_like(local_tensor(p.detach()), dtype=torch.float32)

    def spreads(self) -> list[tuple[str, float]]:
        """(name, spread) for each watched weight: the largest |g_r - g_0| over TP ranks r, over the largest |g_r|
        (0 when no rank has a gradient). The same list on every TP rank."""
        if not self.params:
            return []
        local = [self._recorded(i, p).reshape(-1) for i, (_, p) in enumerate(self.params)]
        sizes = [t.numel() for t in local]
        everyone = self.comm.all_gather(torch.cat(local)[None], dim=0)  # [tp, n]
        out = []
        for (name, _), g in zip(self.params, everyone.split(sizes, dim=1)):
            scale = g.norm(dim=1).max().item()
            out.append((name, (g - g[0]).norm(dim=1).max().item() / scale if scale > 0 else 0.0))
        return out

    def verify(self) -> None:
        """Raise a ConfigError (exit code 2, before the first update) naming the weights whose TP copies got
        different gradients; every rank of the world calls it and raises the same line when any TP group found
        one (a pipeline stage or DP replica without the mistake would otherwise wait for peers that stopped)."""
        bad = [(n, s) for n, s in self.spreads() if not s <= MAX_SPREAD]
        self.grads.clear()
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world > 1:
            found = torch.tensor([float(len(bad))], device=self.device)
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
            if not found.item():
                return
            everyone: list = [None] * world  # the names every TP group found, so rank 0's line has them all
            dist.all_gather_object(everyone, bad)
            first: dict[str, float] = {}
            for name, spread in (item for found_here in everyone for item in found_here):
                first.setdefault(name, spread)
            bad = list(first.items())
        if bad:
            names = ", ".join(f"{n} ({s:.2g})" for n, s in bad[:4]) + (f" and {len(bad) - 4} more" * (len(bad) > 4))
            raise ConfigError(
                f"weights replicated over TP got different gradients on the TP ranks in step 1 (relative spread): "
                f"{names}. Their layers see rank-dependent activations (sequence parallelism, or per-rank heads), so "
                f"the gradient must be summed over TP: build them with sequence_parallel=ctx.sequence_parallel "
                f"(tpframe.layers norms) or tag_param(p, tp_dim=None, sequence_parallel=True); "
                f"train.check_replicas=false skips this check"
            )
