"""Pipeline schedules as orders: the list of actions each pipeline rank runs, in order, for one step.

    order = schedule_order("1f1b", pp=4, rank=1, num_micro_batches=8)   # [F0 F1 F2 B0 F3 B1 ... B7]

An action is F (forward), B (backward; with a zero-bubble schedule only the input gradient) or W (the
weight gradient a split B deferred) of one micro-batch on one local model chunk. Virtual stage
`chunk * pp + rank` of `pp * virtual_stages` holds chunk `chunk` of the model (Megatron's interleaving).
Orders are pure functions of (schedule, pp, rank, virtual stages, micro-batches): every rank computes
its own, and `simulate` runs all of them together to check them (deadlock freedom, first-in first-out
links) and to compute their bubble under given action costs.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("1f1b", "afab", "interleaved_1f1b", "zb_h1")


@dataclass(frozen=True)
class Action:
    kind: str  # "F", "B" or "W"
    chunk: int  # local model chunk (virtual stage chunk * pp + rank)
    mb: int  # micro-batch

    def __repr__(self) -> str:
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


def splits_backward(schedule: str) -> bool:
    """Whether the schedule runs weight gradients (W) apart from input gradients (B)."""
    return schedule == "zb_h1"


def schedule_order(
    schedule: str, *, pp: int, rank: int, num_micro_batches: int, virtual_stages: int = 1
) -> list[Action]:
    """The actions pipeline rank `rank` runs for one step, in order."""
    m = num_micro_batches
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
    if (virtual_stages > 1) != (schedule == "interleaved_1f1b"):
        raise ValueError(f"pipeline schedule {schedule!r} does not run with {virtual_stages} virtual stages per rank")
    if schedule == "afab":
        return [Action("F", 0, i) for i in range(m)] + [Action("B", 0, i) for i in range(m)]
    if schedule == "1f1b":
        return _one_f_one_b(pp, rank, m)
    if schedule == "zb_h1":
        return _zb_h1(pp, rank, m)
    return _interleaved(pp, rank, m, virtual_stages)


def _one_f_one_b(pp: int, rank: int, m: int) -> list[Action]:
    """Warm-up forwards (pp - rank - 1), then one forward one backward, then the remaining backwards:
    at most pp - rank micro-batches hold activations on a rank."""
    warmup = min(pp - rank - 1, m)
    order = [Action("F", 0, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Action("F", 0, warmup + i), Action("B", 0, i)]
    return order + [Action("B", 0, i) for i in range(m - warmup, m)]


def _zb_h1(pp: int, rank: int, m: int) -> list[Action]:
    """ZB-H1 (Qi et al., 2024, "Zero Bubble Pipeline Parallelism"): 1F1B with each backward split into
    B (input gradient, on the critical path) and W (weight gradient, whenever convenient). Rank r keeps
    up to r weight gradients pending, so the W's fill the cool-down bubble of 1F1B at the same peak
    activation memory; the bubble shrinks from (pp-1)(F+B+W) to (pp-1)(F+B-W)."""
    warmup = min(pp - rank - 1, m)
    order, done_b, done_w = [Action("F", 0, i) for i in range(warmup)], 0, 0

    def backward():
        nonlocal done_b, done_w
        order.append(Action("B", 0, done_b))
        done_b += 1
        if done_b - done_w > rank:  # more than `rank` weight gradients waiting: run the oldest now
            order.append(Action("W", 0, done_w))
            done_w += 1

    for i in range(m - warmup):
        order.append(Action("F", 0, warmup + i))
        backward()
    while done_b < m:
        backward()
    return order + [Action("W", 0, i) for i in range(done_w, m)]


def _interleaved(pp: int, rank: int, m: int, v: int) -> list[Action]:
    """Interleaved 1F1B (Narayanan et al., 2021): v chunks per rank, micro-batches in groups of pp;
    the k-th forward runs chunk (k // pp) % v, backwards run the chunks in reverse."""
    if m % pp:
        raise ValueError(f"interleaved 1F1B needs the micro-batches per step ({m}) to be a multiple of pp={pp}")
    total = m * v
    warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, total)

    def mb(k: int) -> int:
        return (k // (pp * v)) * pp + k % pp

    def fwd(k: int) -> Action:
        return Action("F", (k // pp) % v, mb(k))

    def bwd(k: int) -> Action:
        return Action("B", v - 1 - (k // pp) % v, mb(k))

    order = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [fwd(warmup + k), bwd(k)]
    return order + [bwd(k) for k in range(total - warmup, total)]


def peak_in_flight(schedule: str, *, pp: int, num_micro_batches: int, virtual_stages: int = 1) -> int:
    """The most forwards (micro-batch, chunk) whose backward has not run that any rank holds at once: the
    activations it keeps, in chunks of model.layers / (pp * virtual_stages) layers (1F1B: pp, AFAB: all)."""
    peak = 0
    for rank in range(pp):
        held = 0
        for a in schedule_order(
            schedule, pp=pp, rank=rank, num_micro_batches=num_micro_batches, virtual_stages=virtual_stages
        ):
            held += {"F": 1, "B": -1}.get(a.kind, 0)
            peak = max(peak, held)
    return peak


# -- checking and costing orders ----------------------------------------------------------------


@dataclass
class Simulation:
    makespan: float
    busy: list[float]  # per rank
    links: dict  # (kind, from rank, to rank) -> messages in send order; recv order checked equal

    @property
    def bubble(self) -> float:
        """Mean idle fraction of the ranks over the makespan."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)


def simulate(
    orders: list[list[Action]], *, virtual_stages: int = 1, cost: dict[str, float] | None = None
) -> Simulation:
    """Run every rank's order against the others with action costs `cost` (default F=B=W=1, and a
    B that is not split costs B+W) and zero-latency links. Raises ValueError on a deadlock, or when a
    link would deliver messages in an order its receiver does not consume them (first in, first out:
    what NCCL point-to-point needs)."""
    cost = {"F": 1.0, "B": 1.0, "W": 1.0, **(cost or {})}
    pp, v = len(orders), virtual_stages
    stages = pp * v
    split = any(a.kind == "W" for order in orders for a in order)
    b_cost = cost["B"] if split else cost["B"] + cost["W"]
    done: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, mb) -> finish time
    clock, pos, busy = [0.0] * pp, [0] * pp, [0.0] * pp
    sent: dict = {}
    received: dict = {}
    while any(pos[r] < len(orders[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                a = orders[r][pos[r]]
                s = a.chunk * pp + r
                dep = _dependency(a, s, stages)
                if dep is not None and dep not in done:
                    break
                start = max(clock[r], done[dep] if dep is not None else 0.0)
                duration = {"F": cost["F"], "B": b_cost, "W": cost["W"]}[a.kind]
                clock[r] = start + duration
                busy[r] += duration
                done[(a.kind, s, a.mb)] = clock[r]
                if a.kind == "F" and s < stages - 1:
                    sent.setdefault(("act", r, (r + 1) % pp), []).append((s, a.mb))
                if a.kind == "F" and s > 0:
                    received.setdefault(("act", (r - 1) % pp, r), []).append((s - 1, a.mb))
                if a.kind == "B" and s > 0:
                    sent.setdefault(("grad", r, (r - 1) % pp), []).append((s, a.mb))
                if a.kind == "B" and s < stages - 1:
                    received.setdefault(("grad", (r + 1) % pp, r), []).append((s + 1, a.mb))
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: orders[r][pos[r]] for r in range(pp) if pos[r] < len(orders[r])}
            raise ValueError(f"pipeline order deadlocks: ranks wait at {stuck}")
    _check_complete(orders, done, sent, received, stages=stages, split=split)
    return Simulation(max(clock), busy, sent)


def _dependency(a: Action, s: int, stages: int) -> tuple[str, int, int] | None:
    """What must finish before action `a` at virtual stage `s` starts: (kind, virtual stage, micro-batch), or None."""
    if a.kind == "F":
        return ("F", s - 1, a.mb) if s > 0 else None
    if a.kind == "B":
        return ("B", s + 1, a.mb) if s < stages - 1 else ("F", s, a.mb)
    return ("B", s, a.mb)


def _check_complete(
    orders: list[list[Action]], done: dict, sent: dict, received: dict, *, stages: int, split: bool
) -> None:
    """Raise unless every link's receiver takes its messages in the order they were sent and every stage ran F and B
    (and W, when split) of every micro-batch."""
    for link, messages in sent.items():
        if received.get(link) != messages:
            raise ValueError(f"link {link} sends {messages} but its receiver takes {received.get(link)}")
    for kind in ("F", "B") + (("W",) if split else ()):
        missing = [
            (s, i)
            for s in range(stages)
            for i in range(max(a.mb for o in orders for a in o) + 1)
            if (kind, s, i) not in done
        ]
        if missing:
            raise ValueError(f"pipeline order never runs {kind} of (stage, micro-batch) {missing[:4]}")


def theoretical_bubble(schedule: str, pp: int, num_micro_batches: int, virtual_stages: int = 1) -> float:
    """Idle fraction with equal-cost F, B and W and free communication: (p-1)/(m+p-1) for 1F1B and
    all-forward-all-backward, (p-1)/(v*m+p-1) interleaved, (p-1)/(3m+p-1) for ZB-H1."""
    p, m, v = pp, num_micro_batches, virtual_stages
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    if schedule == "zb_h1":
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (m + p - 1)
