"""Each communication mapping's forward and backward, checked against its definition."""

import pytest
import torch

from tests.dist_utils import run_distributed


def _mappings_follow_their_definitions():
    from tests.reference import scatter_to_sp  # the tests' own helper (no layer needs it)
    from tpframe import layers as L
    from tpframe.parallel import initialize_parallel

    comm = initialize_parallel(tp=torch.distributed.get_world_size()).tp_comm
    tp, r = comm.size, comm.rank
    torch.manual_seed(0)
    per_rank = torch.randn(tp, 4 * tp, 2, 3 * tp)  # every rank's input, known to all
    grads = torch.randn(tp, 4 * tp, 2, 3 * tp)
    mine, total = per_rank[r], per_rank.sum(0)

    def run(fn, x, g):
        x = x.clone().requires_grad_()
        y = fn(x)
        y.backward(g)
        return y.detach(), x.grad

    def check(name, got, expected):
        assert torch.allclose(got, expected, rtol=1e-6, atol=1e-6), f"{name} at tp={tp}"

    y, gx = run(lambda x: L.copy_to_tp(x, comm), mine, grads[r])
    check("copy_to_tp fwd", y, mine), check("copy_to_tp bwd", gx, grads.sum(0))
    y, gx = run(lambda x: L.reduce_from_tp(x, comm), mine, grads[0])
    check("reduce_from_tp fwd", y, total), check("reduce_from_tp bwd", gx, grads[0])
    y, gx = run(lambda x: L.scatter_to_tp(x, comm), per_rank[0], grads[r].chunk(tp, -1)[r])
    check("scatter_to_tp fwd", y, per_rank[0].chunk(tp, -1)[r])
    check("scatter_to_tp bwd", gx, torch.cat([grads[i].chunk(tp, -1)[i] for i in range(tp)], -1))
    y, gx = run(lambda x: L.gather_from_tp(x, comm), mine[..., :3], grads[0][..., : 3 * tp])
    check("gather_from_tp fwd", y, torch.cat([per_rank[i][..., :3] for i in range(tp)], -1))
    check("gather_from_tp bwd", gx, grads[0][..., : 3 * tp].chunk(tp, -1)[r])
    y, gx = run(lambda x: scatter_to_sp(x, comm), per_rank[0], grads[r][:4])
    check("scatter_to_sp fwd", y, per_rank[0].chunk(tp, 0)[r])
    check("scatter_to_sp bwd", gx, torch.cat([grads[i][:4] for i in range(tp)], 0))
    y, gx = run(lambda x: L.gather_from_sp(x, comm), mine[:4], grads[r])
    check("gather_from_sp fwd", y, torch.cat([per_rank[i][:4] for i in range(tp)], 0))
    check("gather_from_sp bwd (reduce-scatter)", gx, grads.sum(0).chunk(tp, 0)[r])
    y, gx = run(lambda x: L.gather_from_sp(x, comm, reduce_grad=False), mine[:4], grads[0])
    check("gather_from_sp bwd (slice)", gx, grads[0].chunk(tp, 0)[r])
    y, gx = run(lambda x: L.reduce_scatter_to_sp(x, comm), mine, grads[r][:4])
    check("reduce_scatter_to_sp fwd", y, total.chunk(tp, 0)[r])
    check("reduce_scatter_to_sp bwd", gx, torch.cat([grads[i][:4] for i in range(tp)], 0))
    # The input of a reduction is never modified (autograd may have saved it).
    x = mine.clone()
    comm.all_reduce(x)
    check("all_reduce leaves its input alone", x, mine)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_mappings_follow_their_definitions(tp):
    run_distributed(_mappings_follow_their_definitions, tp)
