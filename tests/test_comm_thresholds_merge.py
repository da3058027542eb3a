"""benchmarks/comm.py's thresholds: ranges and kernel bounds halfway between measured sizes, a run over fewer sizes
replacing only what it measured; and the packaged table sends decode-sized bf16 all-reduces to the Lamport kernel
(measured on 2x H200)."""

import sys

import pytest
import torch

from tests.training_utils import REPO

KIB = 1024


def _comm_benchmark():
    sys.path.insert(0, f"{REPO}/benchmarks")
    import comm

    return comm


def test_a_partial_run_replaces_only_the_sizes_it_measured():
    comm = _comm_benchmark()
    old = [[370727, "push"], [741455, "one_shot"], [94906265, "push"], [None, "two_shot"]]
    assert comm.splice_algos([[None, "lamport"]], old, 1 << 20) == [
        [1 << 20, "lamport"],
        [94906265, "push"],
        [None, "two_shot"],
    ]
    assert comm.splice_algos([[50000, "lamport"], [None, "push"]], old, 1 << 20) == [
        [50000, "lamport"],
        [94906265, "push"],
        [None, "two_shot"],
    ]
    assert comm.splice_ranges([[0, None]], [[0, 94906265]], 1 << 20) == [[0, 94906265]]
    assert comm.splice_ranges([[0, 5000]], [[0, 94906265]], 1 << 20) == [[0, 5000], [(1 << 20) + 1, 94906265]]
    assert comm.splice_ranges([], [[0, None]], 1 << 20) == [[(1 << 20) + 1, None]]


def test_ranges_from_winners_end_halfway_between_measurements():
    comm = _comm_benchmark()
    sizes = [4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB]
    assert comm.ranges_from_winners(sizes, [True, True, False, False]) == [[0, 32 * KIB]]
    assert comm.ranges_from_winners(sizes, [False, True, True, True]) == [[8 * KIB, None]]
    assert comm.ranges_from_winners(sizes, [True, False, True, False]) == [[0, 8 * KIB], [32 * KIB, 128 * KIB]]
    assert comm.ranges_from_winners(sizes, [False] * 4) == []
    with pytest.raises(ValueError, match="ascending"):
        comm.ranges_from_winners([2, 1], [True, True])


def test_algos_from_winners_merge_runs_and_split_halfway():
    comm = _comm_benchmark()
    sizes = [4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB]
    assert comm.algos_from_winners(sizes, ["one_shot", "one_shot", "push", "two_shot"]) == [
        [32 * KIB, "one_shot"],
        [128 * KIB, "push"],
        [None, "two_shot"],
    ]
    assert comm.algos_from_winners(sizes, ["push"] * 4) == [[None, "push"]]
    with pytest.raises(ValueError, match="ascending"):
        comm.algos_from_winners([4, 4], ["push", "push"])


def test_packaged_table_picks_lamport_for_decode_sized_bf16_all_reduces():
    from tpframe.comm import select

    select.clear_cache()
    for nbytes in (4 * KIB, 64 * KIB, 1 << 20):
        assert select.all_reduce_algorithm(nbytes, torch.bfloat16, 2) == "lamport"
    assert select.all_reduce_algorithm((1 << 20) + 1, torch.bfloat16, 2) == "push"
    assert select.all_reduce_algorithm(4 * KIB, torch.float16, 2) == "push"  # not measured with Lamport: unchanged
