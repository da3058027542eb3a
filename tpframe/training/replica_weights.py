"""Every `train.compare_replicas_every` steps: are the copies of each weight still the same on every rank?

Data parallelism keeps one copy of every weight per DP (and CP) rank, tensor parallelism one copy of each
replicated weight (norms, row-parallel biases) per TP rank, expert parallelism one copy of each expert per
expert replica, pipeline parallelism one copy of a tied embedding on its first and on its last stage. The strategies keep them equal only as long as every rank computes the same update bit for bit.
A flipped bit in one GPU's memory, a kernel that is not deterministic across ranks, or a rank that skipped an
update makes the copies drift apart, and training goes on silently: the gradients are then averaged over
different models, and a checkpoint keeps one rank's copy. Megatron-Core's
`--check-weight-hash-across-dp-replicas-interval` checks the same.

The check hashes each weight's bytes on its own device (two int64 sums: of the bytes, and of the bytes weighted by
their position, modulo the prime 2^61 - 1, so a changed, swapped or moved byte changes the hash), gathers the hashes
over each group that holds copies, and compares them with the group's first rank's. Any difference anywhere stops
every rank together with `ReplicasDiverged` (exit code 3), naming the weights and the ranks whose copies differ; the
checkpoints saved before remain (train.py names the last healthy one).

    check = ReplicaWeightCheck(model, parallel, every=100)
    if check.due(step): check.verify(step)          # after the optimizer step

Test hook: TPFRAME_FAULT_FLIP=<step>:<rank> flips one bit of one weight on that global rank just before that
step's check (the last bit of the first element of the first weight the check compares there).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from tpframe.errors import ConfigError
from tpframe.training.health import TrainingAborted

FAULT_FLIP_ENV = "TPFRAME_FAULT_FLIP"
_PRIME = (1 << 61) - 1
_CHUNK = 1 << 24  # bytes hashed per pass: position-weighted sums stay below 2^48 before the modulo


class ReplicasDiverged(TrainingAborted):
    """Copies of a weight that should be identical differ across ranks."""


def weight_hash(t: torch.Tensor) -> torch.Tensor:
    """[2] int64 on t's device: the sum of t's bytes and their position-weighted sum, each modulo 2^61 - 1."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8)
    out = torch.zeros(2, dtype=torch.int64, device=t.device)
    for start in range(0, data.numel(), _CHUNK):
        x = data[start : start + _CHUNK].to(torch.int64)
        weights = torch.arange(start, start + x.numel(), dtype=torch.int64, device=t.device) % 65521 + 1
        out[0] = (out[0] + x.sum()) % _PRIME
        out[1] = (out[1] + (x * weights).sum()) % _PRIME
    return out


def parse_flip_spec(spec: str | None) -> tuple[int, int] | None:
    """(step, rank) from TPFRAME_FAULT_FLIP, or None; ConfigError if malformed."""
    if not spec:
        return None
    parts = spec.split(":")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ConfigError(f"{FAULT_FLIP_ENV}={spec!r}: expected <step>:<rank>, e.g. 3:1")
    return int(parts[0]), int(parts[1])


class ReplicaWeightCheck:
    """Compares each weight over the groups that hold copies of it (module docstring).

    Groups: DP x CP for every weight (experts: their expert-data-parallel group instead), TP for the weights
    TP replicates (no `tp_dim`), the first and last pipeline stage for the tied embedding both hold. Weights FSDP
    shards have no copies to compare (config.py refuses fsdp)."""

    def __init__(self, model: nn.Module, parallel, *, every: int):
        self.every, self.parallel = every, parallel
        named = list(model.named_parameters())  # frozen ones too (an MoE layer's expert bias): copies all the same
        expert = lambda p: parallel.ep > 1 and getattr(p, "expert", False)  # noqa: E731
        self.groups = []  # (what, group, its global ranks, [(name, param)])
        dense = [(n, p) for n, p in named if not expert(p)]
        if parallel.dp_cp > 1 and dense:
            self.groups.append(("data-parallel", parallel.dp_cp_group, self._ranks(parallel.dp_cp_group), dense))
        experts = [(n, p) for n, p in named if expert(p)]
        if experts and parallel.edp > 1:
            self.groups.append(("expert-data-parallel", parallel.edp_group, self._ranks(parallel.edp_group), experts))
        replicated = [(n, p) for n, p in named if getattr(p, "tp_dim", None) is None]
        if parallel.tp > 1 and replicated:
            self.groups.append(("tensor-parallel", parallel.tp_group, self._ranks(parallel.tp_group), replicated))
        tied = [(n, p) for n, p in named if getattr(p, "pipeline_tied", False)]  # one order on both stages
        if tied and parallel.embedding_group is not None:
            self.groups.append(("first/last pipeline stage", parallel.embedding_group,
                                self._ranks(parallel.embedding_group), tied))
        self.fault = parse_flip_spec(os.environ.get(FAULT_FLIP_ENV))
        self.checks = 0

    @staticmethod
    def _ranks(group) -> list[int]:
        return dist.get_process_group_ranks(group) if group is not None else [dist.get_rank()]

    @property
    def compares(self) -> str:
        """What the check compares at this layout, for the start-up lines."""
        if not self.groups:
            return "nothing at this layout (every weight has one copy)"
        return ", ".join(f"{len(params)} weights over {what} ({len(ranks)} copies)"
                         for what, _, ranks, params in self.groups)

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    @torch.no_grad()
    def verify(self, step: int) -> None:
        """Hash, gather, compare; raise ReplicasDiverged on every rank if any group differs anywhere."""
        self._inject(step)
        device = self.parallel.device
        hashes: dict[int, torch.Tensor] = {}  # id(param) -> its hash, computed once for every group
        found: list[str] = []
        for what, group, ranks, params in self.groups:
            mine = torch.stack([hashes.setdefault(id(p), weight_hash(p)) for _, p in params])  # [n, 2]
            every = [torch.empty_like(mine) for _ in ranks]
            dist.all_gather(every, mine, group=group)
            first = every[0]
            for r, theirs in zip(ranks[1:], every[1:]):
                differ = (theirs != first).any(dim=1).nonzero().flatten().tolist()
                if differ:
                    names = [params[i][0] for i in differ]
                    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
                    found.append(f"{what} rank {r}'s copy of {shown} differs from rank {ranks[0]}'s")
        self.checks += 1
        flag = torch.tensor([1.0 if found else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank stops together, or none
        if flag.item() == 0:
            return
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, found)
        lines = list(dict.fromkeys(line for seen in everyone for line in seen))  # each group's finding once
        raise ReplicasDiverged(
            f"step {step}: copies of the weights are no longer identical: " + "; ".join(lines[:4])
            + (f" (and {len(lines) - 4} more)" if len(lines) > 4 else "")
            + ". A bit flip on one GPU or a rank that computed a different update; check that device's health "
            "(nvidia-smi -q -d ECC) before resuming")

    def _inject(self, step: int) -> None:
        if self.fault is None or self.fault != (step, dist.get_rank()) or not self.groups:
            return
        p = self.groups[0][3][0][1]
        flat = p.detach().reshape(-1)
        bits = flat[:1].view(torch.int16 if p.element_size() == 2 else torch.int32 if p.element_size() == 4
                             else torch.uint8)
        bits ^= 1  # in place: the last bit of the first element
