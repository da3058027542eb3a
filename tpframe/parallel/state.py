"""The one parallel state: TP, CP, DP and PP process groups carved out of the world.

Rank order is TP fastest, then CP (context parallelism: the sequence split), then DP, then PP:

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

so the ranks of a TP group are adjacent and sit inside one NVLink node, and a CP group next to them
(Megatron-Core's order). Parameters are replicated over DP and CP alike, so gradients are reduced over
their product, the `dp_cp` group; batches are split over DP only (the CP ranks of a replica share its
sequences and take different tokens of them: tpframe/layers/context.py).

Expert parallelism (MoE models, `ep`) splits the experts over `ep` consecutive ranks of the dp_cp
group (ranks holding different data, so the all-to-all that moves tokens to their experts carries
real work both ways); an expert's weights are then replicated over the other dp*cp/ep ranks, the
`edp` group its gradients are reduced over.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tpframe.comm import Communicator
from tpframe.config import check_at_least
from tpframe.errors import ConfigError

_STATE: ParallelState | None = None


def check_layout(p, world_size: int) -> int:
    """The `parallel:` sizes (`p`, the run's ParallelConfig) against the world, as ConfigErrors; the DP size."""
    check_at_least("parallel", p, ("tp", "pp"))
    check_at_least("parallel", p, ("cp",), note=" (1: no context parallelism)")
    check_at_least("parallel", p, ("ep",), note=" (1: every rank holds every expert)")
    if world_size % (p.tp * p.cp * p.pp):
        what, names = (f"{p.tp}*{p.cp}*{p.pp}", "tp/cp/pp") if p.cp > 1 else (f"{p.tp}*{p.pp}", "tp/pp")
        raise ConfigError(
            f"world size {world_size} is not divisible by parallel.{names.replace('/', '*parallel.')} = {what}; "
            f"launch a multiple of {p.tp * p.cp * p.pp} processes (python -m tpframe.launch --nproc-per-node N) or "
            f"change parallel.{names}"
        )
    return world_size // (p.tp * p.cp * p.pp)


def rank_layout(world_size: int, tp: int = 1, pp: int = 1, *, cp: int = 1, ep: int = 1) -> dict[str, list[list[int]]]:
    """The global ranks of every group, by kind: 'tp', 'cp', 'dp', 'dp_cp' (the gradient replicas),
    'pp', 'mp' (tp x pp: one model replica), 'embedding', and for expert parallelism 'ep' (the ranks
    that split the experts) and 'edp' (an expert's replicas).

    Pure arithmetic, no communication: the single source of truth for the rank order.
    """
    for name, value in (("tp", tp), ("cp", cp), ("pp", pp), ("world size", world_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if world_size % (tp * cp * pp):
        names, sizes = ("tp*cp*pp", f"{tp}*{cp}*{pp}") if cp > 1 else ("tp*pp", f"{tp}*{pp}")
        raise ValueError(
            f"world size {world_size} is not divisible by {names} = {sizes} = {tp * cp * pp}; launch a multiple of "
            f"{tp * cp * pp} processes or change parallel.{names.replace('*', ' / parallel.')}"
        )
    dp = world_size // (tp * cp * pp)
    if not isinstance(ep, int) or ep < 1 or (dp * cp) % ep:
        raise ValueError(
            f"the expert-parallel size must divide dp*cp = {dp}*{cp} = {dp * cp} (the ranks holding "
            f"different data), got ep={ep!r}; change parallel.ep or the number of processes"
        )

    def rank(t: int, c: int, d: int, p: int) -> int:
        return t + tp * (c + cp * (d + dp * p))

    grid = [(t, c, d, p) for p in range(pp) for d in range(dp) for c in range(cp) for t in range(tp)]

    def groups(key, member) -> list[list[int]]:
        """One group per value of `key` (the coordinates a group shares), its members in `member` order."""
        out: dict[tuple, list[tuple]] = {}
        for x in grid:
            out.setdefault(key(*x), []).append(x)
        return [[rank(*x) for x in sorted(xs, key=lambda x: member(*x))] for xs in out.values()]

    pp_groups = groups(lambda t, c, d, p: (t, c, d), lambda t, c, d, p: p)
    return {
        "tp": groups(lambda t, c, d, p: (c, d, p), lambda t, c, d, p: t),
        "cp": groups(lambda t, c, d, p: (t, d, p), lambda t, c, d, p: c),
        "dp": groups(lambda t, c, d, p: (t, c, p), lambda t, c, d, p: d),
        "dp_cp": groups(lambda t, c, d, p: (t, p), lambda t, c, d, p: (d, c)),
        "pp": pp_groups,
        "mp": groups(lambda t, c, d, p: (c, d), lambda t, c, d, p: (p, t)),
        "embedding": [sorted({g[0], g[-1]}) for g in pp_groups],
        "ep": groups(lambda t, c, d, p: (t, p, (d * cp + c) // ep), lambda t, c, d, p: (d, c)),
        "edp": groups(lambda t, c, d, p: (t, p, (d * cp + c) % ep), lambda t, c, d, p: (d, c)),
    }


def coords_of(rank: int, world_size: int, tp: int = 1, pp: int = 1, *, cp: int = 1) -> tuple[int, int, int]:
    """(tp_rank, dp_rank, pp_rank) of a global rank (`cp_of` gives its CP rank)."""
    dp = world_size // (tp * cp * pp)
    return rank % tp, (rank // (tp * cp)) % dp, rank // (tp * cp * dp)


def cp_of(rank: int, tp: int = 1, cp: int = 1) -> int:
    """The CP rank of a global rank."""
    return (rank // tp) % cp


@dataclass
class ParallelState:
    """Sizes, ranks, groups and communicators of this process. Built by `initialize_parallel`;
    `destroy_parallel` closes the communicators and, when it destroys the world too, sets the mesh and
    group fields to None."""

    world_size: int
    rank: int
    tp: int
    dp: int
    pp: int
    tp_rank: int
    dp_rank: int
    pp_rank: int
    device: torch.device
    mesh: DeviceMesh  # (pp, dp, cp, tp), same rank order: mesh["tp"], mesh["cp"], ...
    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    mp_group: dist.ProcessGroup  # tp x pp: one model replica, for global grad norms
    embedding_group: dist.ProcessGroup | None  # first and last stage (pp > 1); None elsewhere
    tp_comm: Communicator
    dp_comm: Communicator
    mp_comm: Communicator
    pp_comm: Communicator  # the pipeline: the loss from the last stage to every rank
    embedding_comm: Communicator | None  # tied-embedding gradients between first and last stage; None elsewhere
    pp_ranks: list[int]
    tp_ranks: list[int]
    dp_ranks: list[int]
    # Context parallelism (tpframe/layers/context.py). With cp == 1 the cp group is this rank alone and
    # the dp_cp fields are the dp ones.
    cp: int = 1
    cp_rank: int = 0
    cp_group: dist.ProcessGroup | None = None  # this rank alone when cp == 1
    cp_comm: Communicator | None = None  # None when cp == 1
    cp_ranks: list[int] = field(default_factory=list)
    dp_cp_group: dist.ProcessGroup | None = None  # the ranks holding the same parameters: gradients reduce here
    dp_cp_comm: Communicator | None = None
    dp_cp_mesh: DeviceMesh | None = None  # 1-D: FSDP2 shards over it
    # Expert parallelism (tpframe/layers/moe.py). With ep == 1 there is no EP group and the edp fields
    # are the dp_cp ones.
    ep: int = 1
    ep_rank: int = 0
    ep_comm: Communicator | None = None  # the all-to-all of tokens to their experts; None when ep == 1
    ep_ranks: list[int] = field(default_factory=list)
    edp_group: dist.ProcessGroup | None = None  # an expert's replicas: its gradients reduce here
    edp_comm: Communicator | None = None
    owns_world: bool = False
    rng_tracker: object | None = None  # an RNGStatesTracker, set by tpframe.parallel.rng.seed_parallel_rng
    _groups: list = field(default_factory=list, repr=False)

    @property
    def dp_cp(self) -> int:
        """Gradient replicas: dp * cp."""
        return self.dp * self.cp

    @property
    def dp_cp_rank(self) -> int:
        return self.dp_rank * self.cp + self.cp_rank

    @property
    def edp(self) -> int:
        """Replicas of each expert: dp * cp / ep."""
        return self.dp_cp // self.ep


def _init_world_from_env(backend: str, timeout: timedelta | None) -> None:
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            "torch.distributed is not initialized and the torchrun environment is missing "
            f"({', '.join(missing)}): launch with `torchrun --nproc-per-node N ...` or call "
            "torch.distributed.init_process_group() before initialize_parallel()"
        )
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, **({"timeout": timeout} if timeout else {}))


def initialize_parallel(
    tp: int = 1,
    pp: int = 1,
    comm_backend: str = "auto",
    timeout_s: float | None = None,
    *,
    cp: int = 1,
    ep: int = 1,
) -> ParallelState:
    """Build every process group from the world and return the one `ParallelState`.

    `cp`: ranks each sequence is split over; `ep`: ranks of dp x cp the MoE experts are split over. A world not up yet
    is started from torchrun's env (nccl with CUDA, else gloo). `comm_backend`: the TP communicator's (auto/nccl/symm).
    `timeout_s` bounds every collective of every group built here (and of the world, if built here).
    """
    global _STATE
    if _STATE is not None:
        raise RuntimeError("initialize_parallel() was already called; call destroy_parallel() first")
    timeout = timedelta(seconds=timeout_s) if timeout_s else None
    owns_world = not dist.is_initialized()
    if owns_world:
        _init_world_from_env("nccl" if torch.cuda.is_available() else "gloo", timeout)
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = rank_layout(world, tp, pp, cp=cp, ep=ep)  # ValueError: a world tp*cp*pp does not divide, a bad ep
    dp = world // (tp * cp * pp)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    mesh, groups, created = _build_groups(layout, rank, device, timeout, sizes=(pp, dp, cp, tp), ep=ep)
    nccl = lambda kind: None if groups[kind] is None else Communicator(groups[kind], backend="nccl", device=device)  # noqa: E731
    mine = {kind: next(ranks for ranks in layout[kind] if rank in ranks) for kind in ("tp", "dp", "pp", "cp", "ep")}
    tp_rank, dp_rank, pp_rank = coords_of(rank, world, tp, pp, cp=cp)
    dp_comm = nccl("dp")
    state = ParallelState(
        **dict(world_size=world, rank=rank, tp=tp, dp=dp, pp=pp, tp_rank=tp_rank, dp_rank=dp_rank, pp_rank=pp_rank),
        **{f"{kind}_group": groups[kind] for kind in ("tp", "dp", "pp", "mp", "embedding", "cp", "dp_cp", "edp")},
        **{f"{kind}_ranks": ranks for kind, ranks in mine.items()},
        device=device,
        mesh=mesh,
        tp_comm=Communicator(groups["tp"], backend=comm_backend, device=device),
        dp_comm=dp_comm,
        mp_comm=nccl("mp"),
        pp_comm=nccl("pp"),
        embedding_comm=nccl("embedding"),
        cp=cp,
        cp_rank=cp_of(rank, tp, cp),
        # the all-gather of keys and values: NCCL's (the symm kernels are tuned for TP's sizes)
        cp_comm=nccl("cp") if cp > 1 else None,
        dp_cp_comm=nccl("dp_cp") if cp > 1 else dp_comm,
        dp_cp_mesh=groups["dp_cp_mesh"],
        ep=ep,
        ep_rank=(dp_rank * cp + cp_of(rank, tp, cp)) % ep,
        ep_comm=nccl("ep") if ep > 1 else None,
        owns_world=owns_world,
        _groups=created,
    )
    state.edp_comm = nccl("edp") if ep > 1 else state.dp_cp_comm
    _STATE = state
    return state


def _build_groups(layout, rank: int, device, timeout, *, sizes: tuple[int, int, int, int], ep: int):
    """(the (pp, dp, cp, tp) DeviceMesh, this rank's group of each kind, every group built here to destroy later).

    The mesh builds the tp, cp, dp and pp groups (every rank takes part in building every group); torch's rank order
    for it, the last dim fastest, is ours: rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))."""
    pp, dp, cp, tp = sizes
    mesh = init_device_mesh(device.type, sizes, mesh_dim_names=("pp", "dp", "cp", "tp"))
    groups = {kind: mesh.get_group(kind) for kind in ("tp", "dp", "pp", "cp")}
    groups.update(dp_cp=groups["dp"], dp_cp_mesh=mesh["dp"], mp=groups["tp"], embedding=None, ep=None)
    if cp > 1:  # the gradient replicas: dp x cp, flattened in the mesh (rank in it: dp_rank * cp + cp_rank)
        groups["dp_cp_mesh"] = mesh["dp", "cp"]._flatten("dp_cp")
        groups["dp_cp"] = groups["dp_cp_mesh"].get_group()
    groups["edp"] = groups["dp_cp"]
    meshed = {groups[k] for k in ("tp", "dp", "pp", "cp", "dp_cp")} - {dist.group.WORLD, None}
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    for group in meshed if timeout is not None and set_timeout is not None else ():  # the mesh used torch's default
        set_timeout(timeout, group)
    created = list(meshed)
    # experts split over ep ranks of dp x cp, replicated over the rest; a model replica spans the pipeline, and tied
    # embeddings link its first and last stage
    for kind in (("ep", "edp") if ep > 1 else ()) + (("mp", "embedding") if pp > 1 else ()):
        for ranks in layout[kind]:  # every rank builds every group, in the same order
            group = dist.new_group(ranks, timeout=timeout)
            created.append(group)
            groups[kind] = group if rank in ranks else groups[kind]
    return mesh, groups, created


def get_parallel_state() -> ParallelState:
    """The state built by `initialize_parallel`; a clear error if there is none."""
    if _STATE is None:
        raise RuntimeError(
            "tpframe parallel state is not initialized: call tpframe.parallel.initialize_parallel() first"
        )
    return _STATE


def default_tp_comm() -> Communicator:
    """The parallel state's TP communicator: what a layer uses when it is not given `comm=`."""
    return get_parallel_state().tp_comm


def is_initialized() -> bool:
    return _STATE is not None


def destroy_parallel() -> None:
    """Tear down the groups (and the world, if `initialize_parallel` created it)."""
    global _STATE
    state, _STATE = _STATE, None
    if state is None or not dist.is_initialized():
        return
    comms = (
        state.tp_comm,
        state.dp_comm,
        state.mp_comm,
        state.pp_comm,
        state.embedding_comm,
        state.cp_comm,
        state.dp_cp_comm if state.dp_cp_comm is not state.dp_comm else None,
        state.ep_comm,
        state.edp_comm if state.ep > 1 else None,
    )
    for comm in comms:
        if comm is not None:  # frees symmetric memory where a communicator set it up
            comm.close(release_group=state.owns_world)
    for group in state._groups:
        dist.destroy_process_group(group)
    if not state.owns_world:  # the caller's world lives on, and with it the mesh's groups
        return
    dist.destroy_process_group()
    # Drop every reference to the destroyed groups. A ProcessGroup still referenced when the
    # interpreter shuts down (the caller keeps `state`, a module keeps the mesh) is freed during
    # shutdown, which now and then aborts the process ("terminate called without an active exception").
    registry = getattr(state.mesh, "_pg_registry", None)
    if isinstance(registry, dict):
        registry.clear()
    state.mesh = state.tp_group = state.dp_group = state.pp_group = state.mp_group = state.embedding_group = None
    state.cp_group = state.dp_cp_group = state.dp_cp_mesh = state.edp_group = None
    state._groups = []
