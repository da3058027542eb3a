"""Which rank is slow: each rank's forward+backward time, compared over the ranks that do the same work.

A data-parallel step runs at its slowest rank's pace: the other replicas wait for its gradient buckets, so their
`grad_sync_ms` grows while their `fwd_bwd_ms` does not. At every log step each rank's mean forward+backward time per
step (the phase timers' `fwd_bwd`: the GPU's timeline on CUDA, the host clock on CPU) is all-gathered. The ranks of
one pipeline stage do the same work, so each is compared with its stage's median. The record gets `fwd_bwd_max_ms`
and `slowest_rank`, and a rank above `logging.straggler_ratio` times its stage's median is named in one log line
(Megatron-Core's `--log-straggler`; not at a launch's first logged step, whose time is each rank's warm-up). TP ranks
wait for each other inside every layer, so a slow GPU slows its whole TP group alike: the line then names one rank of
that group.

    report = StragglerReport(pp_rank=state.pp_rank, world=state.world_size, ratio=1.1, device=state.device)
    metrics, line = report(fwd_bwd_ms)          # every rank, at the same steps
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist


class StragglerReport:
    def __init__(self, *, pp_rank: int, world: int, ratio: float, device: torch.device):
        self.pp_rank, self.world, self.ratio, self.device = pp_rank, world, ratio, device

    def __call__(self, fwd_bwd_ms: float) -> tuple[dict[str, float], str | None]:
        """(metrics for the record, a log line naming the straggler or None); a collective over the world."""
        mine = torch.tensor([float(self.pp_rank), fwd_bwd_ms], dtype=torch.float64, device=self.device)
        every = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine)
        rows = torch.stack(every).cpu().tolist()
        stages: dict[int, list[tuple[float, int]]] = {}
        for rank, (stage, ms) in enumerate(rows):
            stages.setdefault(int(stage), []).append((ms, rank))
        worst = None  # (ratio, rank, ms, median, ranks compared)
        for members in stages.values():
            median = statistics.median(ms for ms, _ in members)
            ms, rank = max(members)
            ratio = ms / median if median > 0 else 1.0
            if worst is None or ratio > worst[0]:
                worst = (ratio, rank, ms, median, len(members))
        slowest_ms, slowest = max((ms, rank) for rank, (_, ms) in enumerate(rows))
        metrics = {"fwd_bwd_max_ms": slowest_ms, "slowest_rank": int(slowest)}
        ratio, rank, ms, median, n = worst
        if not self.ratio or ratio <= self.ratio or n < 2:
            return metrics, None
        among = "its pipeline stage's" if len(stages) > 1 else "the"
        return metrics, (
            f"straggler: rank {rank} spent {ms:.1f} ms per step in forward+backward, {ratio:.3f}x the "
            f"median {median:.1f} ms of {among} {n} ranks; the others wait for it "
            f"(logging.straggler_ratio={self.ratio:g})"
        )
