"""Every `train.compare_replicas_every` steps: are the copies of each weight still the same on every rank?

Data parallelism keeps one copy of every weight per DP (and CP) rank, tensor parallelism one copy of each
replicated weight (norms, row-parallel biases) per TP rank, expert parallelism one copy of each expert per
expert replica, pipeline parallelism one copy of a tied embedding on its first and on its last stage. The strategies
keep them equal only as long as every rank computes the same update bit for bit. A flipped bit in one GPU's memory, a
kernel that is not deterministic across ranks, or a rank that skipped an update makes the copies drift apart, and
training goes on silently: the gradients are then averaged over different models, and a checkpoint keeps one rank's
copy. Megatron-Core's `--check-weight-hash-across-dp-replicas-interval` checks the same.

The check hashes each weight's bytes on its own device (two sums of its 16-bit words: plain, and weighted by their
position, modulo the prime 2^61 - 1, so a changed, swapped or moved word changes the hash), gathers the hashes
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
_CHUNK = 1 << 24  # 16-bit words hashed per pass: a pass's position-weighted sum stays below 2^55
_WEIGHTS: dict = {}  # device -> int32 position weights 1..32749 of one pass (products fit int32)


def _pass_sums(t: torch.Tensor) -> torch.Tensor:
    """[passes, 2] int64 on t's device: per pass over t's bytes (as 16-bit words), their sum and their
    position-weighted sum. int32 arithmetic (words < 2^16, weights < 2^15), sums accumulated in int64 by torch."""
    data = t.detach().contiguous().reshape(-1)
    words = data.view(torch.int16) if data.numel() * data.element_size() % 2 == 0 else data.view(torch.uint8)
    weights = _WEIGHTS.get(t.device)
    if weights is None:
        weights = _WEIGHTS[t.device] = torch.arange(_CHUNK, dtype=torch.int32, device=t.device) % 32749 + 1
    out = []
    for start in range(0, words.numel(), _CHUNK):
        x = words[start : start + _CHUNK].to(torch.int32)
        if words.dtype == torch.int16:
            x.bitwise_and_(0xFFFF)  # the word's bits as an unsigned number
        total = x.sum()
        out.append(torch.stack([total, x.mul_(weights[: x.numel()]).sum()]))
    return torch.stack(out) if out else torch.zeros(0, 2, dtype=torch.int64, device=t.device)


def weight_hashes(tensors: list[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """[n, 2] int64 (on `device`, default the first tensor's): per tensor, the sum of its bytes (as 16-bit words)
    and their position-weighted sum (each pass weighted by its index), modulo 2^61 - 1. The passes' sums are
    combined on the host in exact integers, after one device-to-host copy for all the tensors."""
    sums = [_pass_sums(t) for t in tensors]
    flat = torch.cat(sums).tolist() if sums else []
    out, i = [], 0
    for s in sums:
        h1 = h2 = 0
        for j in range(s.shape[0]):
            h1 = (h1 + flat[i + j][0]) % _PRIME
            h2 = (h2 + flat[i + j][1] * (j + 1)) % _PRIME
        out.append((h1, h2))
        i += s.shape[0]
    return torch.tensor(out, dtype=torch.int64, device=device or (tensors[0].device if tensors else None))


def weight_hash(t: torch.Tensor) -> torch.Tensor:
    """[2] int64 on t's device: `weight_hashes` of one tensor."""
    return weight_hashes([t])[0]


class ReplicasDiverged(TrainingAborted):
    """Copies of a weight that should be identical differ across ranks."""


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
        expert = lambda p: parallel.ep > 1 and p.expert  # noqa: E731
        self.groups = []  # (what, group, its global ranks, [(name, param)])
        dense = [(n, p) for n, p in named if not expert(p)]
        if parallel.dp_cp > 1 and dense:
            self.groups.append(("data-parallel", parallel.dp_cp_group, self._ranks(parallel.dp_cp_group), dense))
        experts = [(n, p) for n, p in named if expert(p)]
        if experts and parallel.edp > 1:
            self.groups.append(("expert-data-parallel", parallel.edp_group, self._ranks(parallel.edp_group), experts))
        replicated = [(n, p) for n, p in named if p.tp_dim is None]
        if parallel.tp > 1 and replicated:
            self.groups.append(("tensor-parallel", parallel.tp_group, self._ranks(parallel.tp_group), replicated))
        tied = [(n, p) for n, p in named if p.pipeline_tied]  # one order on both stages
        if tied and parallel.embedding_group is not None:
            self.groups.append(
                ("first/last pipeline stage", parallel.embedding_group, self._ranks(parallel.embedding_group), tied)
            )
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
        return ", ".join(
            f"{len(params)} weights over {what} ({len(ranks)} copies)" for what, _, ranks, params in self.groups
        )

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    @torch.no_grad()
    def verify(self, step: int) -> None:
        """Hash, gather, compare; raise ReplicasDiverged on every rank if any group differs anywhere."""
        self._inject(step)
        device = self.parallel.device
        unique = list({id(p): p for _, _, _, params in self.groups for _, p in params}.values())
        hashes = dict(zip(map(id, unique), weight_hashes(unique, device)))  # each weight once, one host read
        found: list[str] = []
        for what, group, ranks, params in self.groups:
            mine = torch.stack([hashes[id(p)] for _, p in params])  # [n, 2]
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
            f"step {step}: copies of the weights are no longer identical: "
            + "; ".join(lines[:4])
            + (f" (and {len(lines) - 4} more)" if len(lines) > 4 else "")
            + ". A bit flip on one GPU or a rank that computed a different update; check that device's health "
            "(nvidia-smi -q -d ECC) before resuming"
        )

    def _inject(self, step: int) -> None:
        if self.fault is None or self.fault != (step, dist.get_rank()) or not self.groups:
            return
        p = self.groups[0][3][0][1]
        flat = p.detach().reshape(-1)
        bits = flat[:1].view(
            torch.int16 if p.element_size() == 2 else torch.int32 if p.element_size() == 4 else torch.uint8
        )
        bits ^= 1  # in place: the last bit of the first element
