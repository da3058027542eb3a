"""benchmarks/comm.py's threshold merging: a run over fewer sizes replaces only what it measured; and the packaged
table sends decode-sized bf16 all-reduces to the Lamport kernel (measured on 2x H200)."""

import sys

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


def test_packaged_table_picks_lamport_for_decode_sized_bf16_all_reduces():
    from tpframe.comm import select

    select.clear_cache()
    for nbytes in (4 * KIB, 64 * KIB, 1 << 20):
        assert select.all_reduce_algorithm(nbytes, torch.bfloat16, 2) == "lamport"
    assert select.all_reduce_algorithm((1 << 20) + 1, torch.bfloat16, 2) == "push"
    assert select.all_reduce_algorithm(4 * KIB, torch.float16, 2) == "push"  # not measured with Lamport: unchanged
