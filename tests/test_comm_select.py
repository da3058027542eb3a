"""`auto`'s choice between symm and nccl: threshold lookup, boundaries, unmeasured cases, overrides,
and the NCCL fallback (with exactly one warning) when symmetric memory cannot be set up."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from tests.dist_utils import run_distributed
from tpframe.comm import select

KIB, MIB = 1 << 10, 1 << 20

TABLE = {
    "symm_ranges": {
        "all_reduce": {
            "2": {
                "bfloat16": {"eager": [[0, 4 * MIB]], "graph": [[0, 1 * MIB]]},
                "float32": {"eager": [[0, 2 * MIB], [32 * MIB, None]]},
            },
            "4": {"bfloat16": {"eager": [[0, 2 * MIB]]}},
        },
        "all_gather": {"2": {"bfloat16": {"eager": [[64 * KIB, 512 * KIB]]}}},
    },
    "all_reduce_algos": {
        "all_reduce": {"2": {"bfloat16": {"graph": [[64 * KIB, "one_shot"], [512 * KIB, "push"], [None, "two_shot"]]}}}
    },
}


def test_choose_follows_measured_range_boundaries_inclusively():
    bf16 = torch.bfloat16
    assert select.choose("all_reduce", 0, bf16, 2, table=TABLE) == "symm"
    assert select.choose("all_reduce", 4 * MIB, bf16, 2, table=TABLE) == "symm"
    assert select.choose("all_reduce", 4 * MIB + 1, bf16, 2, table=TABLE) == "nccl"
    assert select.choose("all_gather", 64 * KIB - 1, bf16, 2, table=TABLE) == "nccl"
    assert select.choose("all_gather", 64 * KIB, bf16, 2, table=TABLE) == "symm"
    assert select.choose("all_gather", 512 * KIB + 1, bf16, 2, table=TABLE) == "nccl"


def test_choose_keys_on_dtype_and_open_ended_ranges():
    f32 = torch.float32
    assert select.choose("all_reduce", 2 * MIB, f32, 2, table=TABLE) == "symm"
    assert select.choose("all_reduce", 8 * MIB, f32, 2, table=TABLE) == "nccl"
    assert select.choose("all_reduce", 1 << 30, f32, 2, table=TABLE) == "symm"  # [32 MiB, None)


def test_graph_mode_has_its_own_thresholds_and_falls_back_to_eager():
    bf16 = torch.bfloat16
    assert select.choose("all_reduce", 2 * MIB, bf16, 2, graph=False, table=TABLE) == "symm"
    assert select.choose("all_reduce", 2 * MIB, bf16, 2, graph=True, table=TABLE) == "nccl"
    # float32 has no graph entry: the eager one applies
    assert select.choose("all_reduce", 1 * MIB, torch.float32, 2, graph=True, table=TABLE) == "symm"


def test_unmeasured_world_size_scales_the_nearest_smaller_measurement():
    bf16 = torch.bfloat16
    # world 8 was not measured: world 4's 2 MiB limit scaled by 4/8 -> 1 MiB
    assert select.choose("all_reduce", 1 * MIB, bf16, 8, table=TABLE) == "symm"
    assert select.choose("all_reduce", 1 * MIB + 1, bf16, 8, table=TABLE) == "nccl"
    # world 3 uses world 2's 4 MiB scaled by 2/3
    assert select.choose("all_reduce", 2 * MIB, bf16, 3, table=TABLE) == "symm"
    assert select.choose("all_reduce", 3 * MIB, bf16, 3, table=TABLE) == "nccl"
    # below every measured world size: the smallest measured one, unscaled
    only4 = {"symm_ranges": {"all_reduce": {"4": {"bfloat16": {"eager": [[0, 2 * MIB]]}}}}}
    assert select.choose("all_reduce", 2 * MIB, bf16, 2, table=only4) == "symm"


def test_unmeasured_dtype_borrows_same_element_size_or_uses_nccl():
    assert select.choose("all_reduce", 4 * MIB, torch.float16, 2, table=TABLE) == "symm"  # bf16's ranges
    assert select.choose("all_reduce", 1, torch.float64, 2, table=TABLE) == "nccl"
    assert select.choose("all_reduce", 1, torch.int32, 2, table=TABLE) == "nccl"
    assert select.choose("reduce_scatter", 1, torch.bfloat16, 2, table=TABLE) == "nccl"  # op not measured
    assert select.choose("all_reduce", 1, torch.bfloat16, 1, table=TABLE) == "nccl"  # nothing to reduce
    assert select.choose("all_reduce", 1, torch.bfloat16, 2, table={}) == "nccl"  # no table at all


def test_choose_rejects_bad_arguments_by_name():
    with pytest.raises(ValueError, match="'broadcast'"):
        select.choose("broadcast", 1, torch.float32, 2, table=TABLE)
    with pytest.raises(ValueError, match="-5"):
        select.choose("all_reduce", -5, torch.float32, 2, table=TABLE)


def test_all_reduce_algorithm_follows_the_measured_bounds():
    bf16 = torch.bfloat16
    assert select.all_reduce_algorithm(64 * KIB, bf16, 2, table=TABLE) == "one_shot"
    assert select.all_reduce_algorithm(64 * KIB + 1, bf16, 2, table=TABLE) == "push"
    assert select.all_reduce_algorithm(512 * KIB, bf16, 2, table=TABLE) == "push"
    assert select.all_reduce_algorithm(512 * KIB + 1, bf16, 2, table=TABLE) == "two_shot"
    assert select.all_reduce_algorithm(256 * KIB, bf16, 4, table=TABLE) == "push"  # bounds scaled by 2/4
    assert select.all_reduce_algorithm(257 * KIB, bf16, 4, table=TABLE) == "two_shot"
    assert select.all_reduce_algorithm(1 << 30, torch.float16, 2, table=TABLE) == "two_shot"  # borrows bf16


def test_all_reduce_algorithm_defaults_without_a_measurement():
    default = select.DEFAULT_ALGOS[0][0]
    assert select.all_reduce_algorithm(default, torch.float32, 2, table={}) == "one_shot"
    assert select.all_reduce_algorithm(default + 1, torch.float32, 2, table={}) == "two_shot"
    assert select.all_reduce_algorithm(default // 4 + 1, torch.float32, 8, table={}) == "two_shot"


def test_message_bytes_is_the_largest_tensor_of_the_collective():
    x = torch.empty(10, 3, dtype=torch.bfloat16)
    assert select.message_bytes("all_reduce", x, 4) == 60
    assert select.message_bytes("reduce_scatter", x, 4) == 60
    assert select.message_bytes("all_gather", x, 4) == 240


def test_thresholds_file_from_env_var_is_used(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"symm_ranges": {"all_reduce": {"2": {"float32": {"eager": [[0, 100]]}}}}}))
    monkeypatch.setenv(select.THRESHOLDS_ENV, str(path))
    select.clear_cache()
    try:
        assert select.choose("all_reduce", 100, torch.float32, 2) == "symm"
        assert select.choose("all_reduce", 101, torch.float32, 2) == "nccl"
        monkeypatch.setenv(select.THRESHOLDS_ENV, str(tmp_path / "missing.json"))
        select.clear_cache()
        with pytest.raises(ValueError, match="missing.json"):
            select.choose("all_reduce", 1, torch.float32, 2)
    finally:
        monkeypatch.delenv(select.THRESHOLDS_ENV)
        select.clear_cache()


def test_packaged_thresholds_are_well_formed():
    table = select.load_thresholds(select.DEFAULT_PATH) if select.DEFAULT_PATH.exists() else {}
    for op, by_world in table.get("symm_ranges", {}).items():
        assert op in select.OPS
        for world, by_dtype in by_world.items():
            assert int(world) >= 2
            for dtype, by_mode in by_dtype.items():
                assert dtype in ("bfloat16", "float16", "float32") and set(by_mode) <= set(select.MODES)
                for ranges in by_mode.values():
                    for lo, hi in ranges:
                        assert lo >= 0 and (hi is None or hi >= lo)
                    starts = [lo for lo, _ in ranges]
                    assert starts == sorted(starts)
    for by_dtype in table.get("all_reduce_algos", {}).get("all_reduce", {}).values():
        for by_mode in by_dtype.values():
            for bounds in by_mode.values():
                assert bounds[-1][0] is None and all(a in select.ALL_REDUCE_ALGORITHMS for _, a in bounds)
                uppers = [u for u, _ in bounds[:-1]]
                assert uppers == sorted(uppers)


# -- backend resolution and the fallback path (gloo, 2 ranks) -------------------------------------------


def _backend_overrides_and_fallback():
    import os

    import torch.distributed as dist

    from tpframe.comm import ENV_VAR, Communicator
    from tpframe.comm.communicator import _try_symm

    rank, size = dist.get_rank(), dist.get_world_size()
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(rank))
    everyone = [torch.randn(6, 5, generator=torch.Generator().manual_seed(r)) for r in range(size)]
    report = {}

    # symm asked for on CPU: one warning, nccl (gloo) used, results right
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comm = Communicator(backend="symm")
        ar, ag, rs = comm.all_reduce(x), comm.all_gather(x), comm.reduce_scatter(torch.cat([x, x]))
    report["symm_warnings"] = [str(w.message) for w in caught]
    report["symm_active"] = comm.symm is not None
    report["symm_results_ok"] = (
        torch.allclose(ar, sum(everyone), atol=1e-6)
        and torch.equal(ag, torch.cat(everyone))
        and torch.allclose(rs, sum(torch.cat([e, e]) for e in everyone)[rank * 6 : (rank + 1) * 6], atol=1e-6)
    )

    # auto on CPU: quietly nccl
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        auto = Communicator(backend="auto")
    report["auto_warnings"] = len(caught)
    report["auto_backend"] = auto.backend_for("all_reduce", x).name

    # the env var overrides the constructor (the comm.backend config): no symm attempt, no warning
    os.environ[ENV_VAR] = "nccl"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        forced = Communicator(backend="symm")
    report["env_requested"], report["env_warnings"] = forced.requested, len(caught)
    os.environ[ENV_VAR] = "fast"
    try:
        Communicator(backend="nccl")
        report["bad_env_error"] = None
    except ValueError as exc:
        report["bad_env_error"] = str(exc)
    del os.environ[ENV_VAR]

    # a symm set-up that fails on a CUDA device (no triton/GPU here): one warning, None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _try_symm(dist.group.WORLD, size, torch.device("cuda", 0), requested="auto")
    report["setup_failure"] = (got, [str(w.message) for w in caught])
    return report


def test_symm_on_cpu_warns_once_and_falls_back_to_nccl_with_correct_results():
    for report in run_distributed(_backend_overrides_and_fallback, world_size=2):
        assert len(report["symm_warnings"]) == 1 and "falling back to nccl" in report["symm_warnings"][0]
        assert not report["symm_active"] and report["symm_results_ok"]
        assert report["auto_warnings"] == 0 and report["auto_backend"] == "nccl"
        assert report["env_requested"] == "nccl" and report["env_warnings"] == 0
        assert "TPFRAME_COMM_BACKEND" in report["bad_env_error"] and "'fast'" in report["bad_env_error"]
        got, caught = report["setup_failure"]
        assert got is None and len(caught) == 1 and "falling back to nccl" in caught[0]
