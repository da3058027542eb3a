"""The one parallel state: TP, DP and PP process groups carved out of the world.

Rank order is TP fastest, then DP, then PP:

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

so the ranks of a TP group are adjacent and sit inside one NVLink node.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tpframe.comm import Communicator

_STATE: ParallelState | None = None


def rank_layout(world_size: int, tp: int = 1, pp: int = 1) -> dict[str, list[list[int]]]:
    """The global ranks of every group, by kind: 'tp', 'dp', 'pp', 'mp' (tp x pp) and 'embedding'.

    Pure arithmetic, no communication: the single source of truth for the rank order.
    """
    for name, value in (("tp", tp), ("pp", pp), ("world size", world_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if world_size % (tp * pp):
        raise ValueError(
            f"world size {world_size} is not divisible by tp*pp = {tp}*{pp} = {tp * pp}; "
            f"launch a multiple of {tp * pp} processes or change parallel.tp / parallel.pp"
        )
    dp = world_size // (tp * pp)

    def rank(t: int, d: int, p: int) -> int:
        return t + tp * (d + dp * p)

    pp_groups = [[rank(t, d, p) for p in range(pp)] for d in range(dp) for t in range(tp)]
    return {
        "tp": [[rank(t, d, p) for t in range(tp)] for p in range(pp) for d in range(dp)],
        "dp": [[rank(t, d, p) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pp": pp_groups,
        "mp": [[rank(t, d, p) for p in range(pp) for t in range(tp)] for d in range(dp)],
        "embedding": [sorted({g[0], g[-1]}) for g in pp_groups],
    }


def coords_of(rank: int, world_size: int, tp: int = 1, pp: int = 1) -> tuple[int, int, int]:
    """(tp_rank, dp_rank, pp_rank) of a global rank."""
    dp = world_size // (tp * pp)
    return rank % tp, (rank // tp) % dp, rank // (tp * dp)


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
    mesh: DeviceMesh  # (pp, dp, tp), same rank order: mesh["dp"] for FSDP2, mesh["tp"], ...
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
    owns_world: bool = False
    rng_tracker: object | None = None  # an RNGStatesTracker, set by tpframe.parallel.rng.seed_parallel_rng
    _groups: list = field(default_factory=list, repr=False)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def tp_src_rank(self) -> int:
        """Global rank of TP rank 0 in this rank's TP group (the source for TP broadcasts)."""
        return self.tp_ranks[0]


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
    tp: int = 1, pp: int = 1, backend: str | None = None, comm_backend: str = "auto", timeout_s: float | None = None
) -> ParallelState:
    """Build every process group from the world and return the one `ParallelState`.

    `backend` is the torch.distributed backend used if the world is not up yet (default: nccl
    with CUDA, else gloo). `comm_backend` picks the TP communicator backend (auto/nccl/symm).
    `timeout_s` bounds every collective of every group built here (and of the world, if built here).
    """
    global _STATE
    if _STATE is not None:
        raise RuntimeError("initialize_parallel() was already called; call destroy_parallel() first")
    timeout = timedelta(seconds=timeout_s) if timeout_s else None
    owns_world = False
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        _init_world_from_env(backend, timeout)
        owns_world = True
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = rank_layout(world, tp, pp)  # raises ValueError for a world tp*pp does not divide
    dp = world // (tp * pp)
    tp_rank, dp_rank, pp_rank = coords_of(rank, world, tp, pp)

    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")

    # The mesh builds the tp, dp and pp groups (every rank takes part in building every group);
    # torch's rank order for it, the last dim fastest, is ours: rank = tp_rank + tp * (dp_rank + dp * pp_rank).
    mesh = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    tp_group, dp_group, pp_group = mesh.get_group("tp"), mesh.get_group("dp"), mesh.get_group("pp")
    created = []
    mp_group, embedding_group = tp_group, None
    if pp > 1:  # one model replica spans the pipeline; tied embeddings link the first and last stage
        for kind in ("mp", "embedding"):
            for ranks in layout[kind]:
                group = dist.new_group(ranks, timeout=timeout)
                created.append(group)
                if rank in ranks:
                    mp_group, embedding_group = (group, embedding_group) if kind == "mp" else (mp_group, group)
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if timeout is not None and set_timeout is not None:  # the mesh builds its groups with torch's default timeout
        for group in {tp_group, dp_group, pp_group} - {dist.group.WORLD}:
            set_timeout(timeout, group)
    find = lambda kind: next(g for g in layout[kind] if rank in g)  # noqa: E731
    state = ParallelState(
        world_size=world,
        rank=rank,
        tp=tp,
        dp=dp,
        pp=pp,
        tp_rank=tp_rank,
        dp_rank=dp_rank,
        pp_rank=pp_rank,
        device=device,
        mesh=mesh,
        tp_group=tp_group,
        dp_group=dp_group,
        pp_group=pp_group,
        mp_group=mp_group,
        embedding_group=embedding_group,
        tp_comm=Communicator(tp_group, backend=comm_backend, device=device),
        dp_comm=Communicator(dp_group, backend="nccl", device=device),
        mp_comm=Communicator(mp_group, backend="nccl", device=device),
        pp_comm=Communicator(pp_group, backend="nccl", device=device),
        embedding_comm=Communicator(embedding_group, backend="nccl", device=device) if embedding_group else None,
        tp_ranks=find("tp"),
        dp_ranks=find("dp"),
        pp_ranks=find("pp"),
        owns_world=owns_world,
        _groups=created + [g for g in {tp_group, dp_group, pp_group} if g is not dist.group.WORLD],
    )
    _STATE = state
    return state


def get_parallel_state() -> ParallelState:
    """The state built by `initialize_parallel`; a clear error if there is none."""
    if _STATE is None:
        raise RuntimeError("tpframe parallel state is not initialized: call tpframe.parallel.initialize_parallel() first")
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
    comms = (state.tp_comm, state.dp_comm, state.mp_comm, state.pp_comm, state.embedding_comm)
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
    state._groups = []
