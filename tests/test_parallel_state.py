"""Group layout, rank order and the errors of initialize_parallel."""

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import DistributedFailure, run_distributed
from tpframe.parallel import coords_of, rank_layout

LAYOUTS = [(1, 1, 1), (2, 1, 1), (2, 2, 1), (4, 2, 1), (8, 1, 1), (2, 1, 2), (1, 2, 2), (2, 2, 2), (1, 1, 4)]


@pytest.mark.parametrize("tp,pp,cp", LAYOUTS)
def test_rank_layout_follows_tp_fastest_then_cp_then_dp_then_pp(tp, pp, cp):
    from tpframe.parallel.state import cp_of

    world = 8
    dp = world // (tp * pp * cp)
    layout = rank_layout(world, tp, pp, cp=cp)
    for rank in range(world):
        t, d, p = coords_of(rank, world, tp, pp, cp=cp)
        c = cp_of(rank, tp, cp)
        at = lambda t, c, d, p: t + tp * (c + cp * (d + dp * p))  # noqa: E731
        assert rank == at(t, c, d, p)
        groups = {kind: [g for g in layout[kind] if rank in g] for kind in ("tp", "cp", "dp", "dp_cp", "pp", "mp")}
        assert groups["tp"] == [[at(i, c, d, p) for i in range(tp)]]
        assert groups["cp"] == [[at(t, i, d, p) for i in range(cp)]]
        assert groups["dp"] == [[at(t, c, i, p) for i in range(dp)]]
        assert groups["dp_cp"] == [[at(t, j, i, p) for i in range(dp) for j in range(cp)]]  # rank in it: d*cp + c
        assert groups["pp"] == [[at(t, c, d, i) for i in range(pp)]]
        assert groups["mp"] == [[at(j, c, d, i) for i in range(pp) for j in range(tp)]]
    for kind in ("tp", "cp", "dp", "dp_cp", "pp"):
        flat = sorted(r for g in layout[kind] for r in g)
        assert flat == list(range(world)), f"{kind} groups must partition the world"
    assert [len(g) for g in layout["tp"]] == [tp] * (world // tp)
    # TP ranks are adjacent: a TP group is a contiguous block of ranks (one NVLink node).
    assert all(g == list(range(g[0], g[0] + tp)) for g in layout["tp"])


def test_rank_layout_rejects_world_not_divisible():
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by tp\*pp = 4\*1"):
        rank_layout(6, 4, 1)
    with pytest.raises(ValueError, match="tp must be a positive integer"):
        rank_layout(8, 0, 1)


def _groups_of_every_layout():
    from tpframe.parallel import destroy_parallel, initialize_parallel

    seen = {}
    for tp, pp, cp in LAYOUTS:
        state = initialize_parallel(tp=tp, pp=pp, cp=cp)
        seen[(tp, pp, cp)] = {
            "tp": dist.get_process_group_ranks(state.tp_group),
            "cp": dist.get_process_group_ranks(state.cp_group),
            "dp_cp": dist.get_process_group_ranks(state.dp_cp_group),
            "dp_cp_comm": (state.dp_cp_comm.size, state.dp_cp_comm.rank, state.dp_cp_rank),
            "dp": dist.get_process_group_ranks(state.dp_group),
            "pp": dist.get_process_group_ranks(state.pp_group),
            "mp": dist.get_process_group_ranks(state.mp_group),
            "embedding": dist.get_process_group_ranks(state.embedding_group) if state.embedding_group else None,
            "coords": (state.tp_rank, state.dp_rank, state.pp_rank),
            "sizes": (state.tp, state.dp, state.pp),
            "tp_ranks": state.tp_ranks,
            "tp_comm": (state.tp_comm.size, state.tp_comm.rank),
            "mesh": tuple(state.mesh.shape),
        }
        # A real collective on each group: the TP group sums to the sum of its members.
        total = state.tp_comm.all_reduce(torch.tensor([float(dist.get_rank())]))
        seen[(tp, pp, cp)]["tp_sum"] = total.item()
        destroy_parallel()
    return seen


def test_process_groups_match_layout_at_world_8():
    per_rank = run_distributed(_groups_of_every_layout, 8, timeout=240)
    for tp, pp, cp in LAYOUTS:
        layout = rank_layout(8, tp, pp, cp=cp)
        dp = 8 // (tp * pp * cp)
        for rank, seen in enumerate(per_rank):
            got = seen[(tp, pp, cp)]
            t, d, p = coords_of(rank, 8, tp, pp, cp=cp)
            c = (rank // tp) % cp
            for kind in ("tp", "cp", "dp", "dp_cp", "pp", "mp"):
                (expected,) = [g for g in layout[kind] if rank in g]
                assert got[kind] == expected, (tp, pp, cp, rank, kind)
            assert got["dp_cp_comm"] == (dp * cp, d * cp + c, d * cp + c)
            (pp_group,) = [g for g in layout["pp"] if rank in g]
            on_ends = pp > 1 and rank in (pp_group[0], pp_group[-1])  # no size-1 groups at pp=1
            assert got["embedding"] == (sorted({pp_group[0], pp_group[-1]}) if on_ends else None)
            assert got["mesh"] == (pp, dp, cp, tp)
            assert got["coords"] == (t, d, p) and got["sizes"] == (tp, dp, pp)
            assert got["tp_ranks"] == got["tp"] and got["tp_ranks"][0] == rank - t
            assert got["tp_comm"] == (tp, t)
            assert got["tp_sum"] == sum(rank - t + i for i in range(tp))


def _init_errors():
    from tpframe.parallel import destroy_parallel, get_parallel_state, initialize_parallel

    errors = {}
    try:
        initialize_parallel(tp=4)
    except ValueError as e:
        errors["indivisible"] = str(e)
    try:
        get_parallel_state()
    except RuntimeError as e:
        errors["not_initialized"] = str(e)
    initialize_parallel(tp=2)
    try:
        initialize_parallel(tp=2)
    except RuntimeError as e:
        errors["double"] = str(e)
    destroy_parallel()
    return errors


def test_initialize_errors_are_clear():
    errors = run_distributed(_init_errors, 2)[0]
    assert "world size 2 is not divisible by tp*pp = 4*1" in errors["indivisible"]
    assert "initialize_parallel() first" in errors["not_initialized"]
    assert "already called" in errors["double"]


def test_initialize_without_torchrun_environment_is_a_clear_error(monkeypatch):
    from tpframe.parallel import initialize_parallel

    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        initialize_parallel(tp=1)


def _initializes_world_itself():
    # The helper already built a world; tear it down so initialize_parallel builds its own from env.
    import os

    dist.destroy_process_group()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["TEST_PORT"])
    from tpframe.parallel import destroy_parallel, initialize_parallel

    state = initialize_parallel(tp=2)
    ok = state.owns_world and dist.is_initialized()
    state.tp_comm.all_reduce(torch.ones(4))
    mesh = state.mesh
    destroy_parallel()
    # Nothing may keep a destroyed group alive to interpreter shutdown, where freeing it can abort the process.
    released = (
        (mesh._pg_registry == {} if hasattr(mesh, "_pg_registry") else True)
        and all(getattr(state, name) is None for name in ("mesh", "tp_group", "dp_group", "pp_group", "mp_group"))
        and all(comm.group is None for comm in (state.tp_comm, state.dp_comm, state.mp_comm, state.pp_comm))
    )
    return ok and released and not dist.is_initialized()


def test_initialize_builds_world_from_torchrun_env():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert run_distributed(_initializes_world_itself, 2, env={"TEST_PORT": str(port)}) == [True, True]


def test_failure_reports_rank_and_traceback():
    with pytest.raises(DistributedFailure, match=r"failed on rank 1:(.|\n)*ZeroDivisionError"):
        run_distributed(_fails_on_rank_1, 2, timeout=60)


def test_hang_times_out():
    with pytest.raises(TimeoutError, match="did not finish"):
        run_distributed(_hangs_on_rank_0, 2, timeout=3)


def _fails_on_rank_1():
    if dist.get_rank() == 1:
        raise ZeroDivisionError("division by zero")
    dist.barrier()


def _hangs_on_rank_0():
    import time

    if dist.get_rank() == 0:
        dist.barrier()  # rank 1 never joins
    else:
        time.sleep(600)
