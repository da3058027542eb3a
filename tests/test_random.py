"""RNG streams under TP, and activation checkpointing that replays them."""

import torch
import torch.nn.functional as F

from tests.dist_utils import run_distributed


def _dropout_patterns():
    from tpframe.parallel import initialize_parallel, seed_parallel_rng

    state = initialize_parallel(tp=2)
    tracker = seed_parallel_rng(1234)
    x = torch.ones(64, 64)
    replicated = F.dropout(x, p=0.5)
    with tracker.fork():
        split = F.dropout(x, p=0.5)
    replicated_after = F.dropout(x, p=0.5)
    comm = state.tp_comm
    gathered = lambda t: comm.all_gather(t.unsqueeze(0), dim=0)  # noqa: E731
    return {
        "replicated_same": bool(torch.equal(gathered(replicated)[0], gathered(replicated)[1])),
        "split_differs": not torch.equal(gathered(split)[0], gathered(split)[1]),
        # forking must not advance or disturb the default stream
        "default_stream_continues": bool(torch.equal(gathered(replicated_after)[0], gathered(replicated_after)[1])),
        "tp_rank": state.tp_rank,
        "dp_rank": state.dp_rank,
        "split": split,
    }


def test_dropout_is_identical_on_replicated_and_different_on_split_activations():
    results = run_distributed(_dropout_patterns, 4)
    for res in results:
        assert res["replicated_same"], "dropout on replicated activations must match across TP ranks"
        assert res["split_differs"], "dropout inside the TP stream must differ across TP ranks"
        assert res["default_stream_continues"]
    # Re-seeding reproduces: the same (tp_rank) draws the same mask in every run and DP replica.
    again = run_distributed(_dropout_patterns, 4)
    for a, b in zip(results, again):
        assert torch.equal(a["split"], b["split"])


def _tracker_errors():
    from tpframe.parallel import RNGStatesTracker

    tracker = RNGStatesTracker("cpu")
    tracker.add("a", 1)
    out = []
    for call in (lambda: tracker.add("a", 2), lambda: tracker.fork("missing").__enter__()):
        try:
            call()
        except (ValueError, KeyError) as e:
            out.append(str(e))
    return out


def test_tracker_rejects_duplicate_and_unknown_streams():
    messages = run_distributed(_tracker_errors, 1)[0]
    assert "already exists" in messages[0] and "never added" in messages[1]


def _checkpointed_block_grads(use_checkpoint: bool):
    from tpframe.layers import ColumnParallelLinear, RowParallelLinear
    from tpframe.parallel import initialize_parallel, recompute, seed_parallel_rng

    state = initialize_parallel(tp=torch.distributed.get_world_size())
    torch.manual_seed(0)
    fc1, fc2 = ColumnParallelLinear(16, 32), RowParallelLinear(32, 16)
    tracker = seed_parallel_rng(42)

    def block(h):
        h = fc1(h)
        with tracker.fork():
            h = F.dropout(F.gelu(h), p=0.3)  # TP-split activations: per-rank stream
        return F.dropout(fc2(h), p=0.3)  # replicated activations: default stream

    x = torch.randn(8, 2, 16, requires_grad=True)
    y = recompute(block, x) if use_checkpoint else block(x)
    y = y + F.dropout(torch.ones_like(y), p=0.3)  # the stream must continue as if no recompute happened
    y.square().sum().backward()
    with tracker.fork():
        next_tp = torch.rand(4)
    return {
        "y": y.detach(),
        "gx": x.grad,
        "g1": fc1.weight.grad,
        "g2": fc2.weight.grad,
        "next_default": torch.rand(4),
        "next_tp": next_tp,
        "rank": state.rank,
    }


def test_checkpoint_recompute_gives_identical_grads():
    for tp in (1, 2):
        plain = run_distributed(_checkpointed_block_grads, tp, False)
        ckpt = run_distributed(_checkpointed_block_grads, tp, True)
        for a, b in zip(plain, ckpt):
            for key in ("y", "gx", "g1", "g2", "next_default", "next_tp"):
                assert torch.equal(a[key], b[key]), f"{key} differs with activation checkpointing at tp={tp}"
