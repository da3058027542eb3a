"""Column/row-parallel linear against a dense single-process nn.functional.linear."""

import pytest
import torch
import torch.nn.functional as F

from tests.dist_utils import run_distributed
from tests.reference import assert_close, leaf, sequence_parallel_grads, tol_for
from tpframe.optim.grad_buffer import allreduce_sequence_parallel_grads

S, B, H_IN, H_OUT = 8, 3, 16, 24
DTYPES = (torch.float32, torch.bfloat16)


def _dense_reference(dtype, seed=1234):
    torch.manual_seed(seed)
    w, bias, x, g = torch.randn(H_OUT, H_IN), torch.randn(H_OUT), torch.randn(S, B, H_IN), torch.randn(S, B, H_OUT)
    wr, br, xr = (leaf(t, dtype) for t in (w, bias, x))
    y = F.linear(xr, wr, br)
    y.backward(g.to(dtype))
    return dict(w=w, b=bias, x=x, g=g, y=y.detach(), gw=wr.grad, gb=br.grad, gx=xr.grad)


def _column_matches_dense():
    from tpframe.layers import ColumnParallelLinear
    from tpframe.parallel import initialize_parallel

    comm = initialize_parallel(tp=torch.distributed.get_world_size()).tp_comm
    tp, r = comm.size, comm.rank
    for dtype in DTYPES:
        for sp in (False, True):
            for gather in (False, True):
                case = f"column dtype={dtype} sp={sp} gather_output={gather} tp={tp}"
                ref = _dense_reference(dtype)
                layer = ColumnParallelLinear(H_IN, H_OUT, gather_output=gather, sequence_parallel=sp, dtype=dtype)
                assert layer.weight.shape == (H_OUT // tp, H_IN) and layer.weight.tp_dim == 0
                with torch.no_grad():
                    layer.weight.copy_(ref["w"].chunk(tp, 0)[r])
                    layer.bias.copy_(ref["b"].chunk(tp, 0)[r])
                x = leaf(ref["x"].chunk(tp, 0)[r] if sp else ref["x"], dtype)
                y = layer(x)
                y_ref = ref["y"] if gather else ref["y"].chunk(tp, -1)[r]
                g = ref["g"] if gather else ref["g"].chunk(tp, -1)[r]
                y.backward(g.to(dtype))
                tol = tol_for(dtype)
                assert_close(y, y_ref, tol, f"{case}: output")
                assert_close(x.grad, ref["gx"].chunk(tp, 0)[r] if sp else ref["gx"], tol, f"{case}: input grad")
                assert_close(layer.weight.grad, ref["gw"].chunk(tp, 0)[r], tol, f"{case}: weight grad")
                assert_close(layer.bias.grad, ref["gb"].chunk(tp, 0)[r], tol, f"{case}: bias grad")


def _row_matches_dense():
    from tpframe.layers import RowParallelLinear
    from tpframe.parallel import initialize_parallel

    comm = initialize_parallel(tp=torch.distributed.get_world_size()).tp_comm
    tp, r = comm.size, comm.rank
    for dtype in DTYPES:
        for sp, input_is_parallel in ((False, True), (False, False), (True, True)):
            case = f"row dtype={dtype} sp={sp} input_is_parallel={input_is_parallel} tp={tp}"
            ref = _dense_reference(dtype)
            layer = RowParallelLinear(
                H_IN, H_OUT, input_is_parallel=input_is_parallel, sequence_parallel=sp, dtype=dtype
            )
            assert layer.weight.shape == (H_OUT, H_IN // tp) and layer.weight.tp_dim == 1
            assert layer.bias.tp_dim is None and layer.bias.sequence_parallel == sp
            with torch.no_grad():
                layer.weight.copy_(ref["w"].chunk(tp, 1)[r])
                layer.bias.copy_(ref["b"])
            x = leaf(ref["x"].chunk(tp, -1)[r] if input_is_parallel else ref["x"], dtype)
            y = layer(x)
            y.backward((ref["g"].chunk(tp, 0)[r] if sp else ref["g"]).to(dtype))
            allreduce_sequence_parallel_grads(sequence_parallel_grads(layer.parameters()), comm)
            tol = tol_for(dtype)
            assert_close(y, ref["y"].chunk(tp, 0)[r] if sp else ref["y"], tol, f"{case}: output")
            assert_close(
                x.grad, ref["gx"].chunk(tp, -1)[r] if input_is_parallel else ref["gx"], tol, f"{case}: input grad"
            )
            assert_close(layer.weight.grad, ref["gw"].chunk(tp, 1)[r], tol, f"{case}: weight grad")
            assert_close(layer.bias.grad, ref["gb"], tol, f"{case}: bias grad")


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_parallel_linear_matches_dense(tp):
    run_distributed(_column_matches_dense, tp)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_row_parallel_linear_matches_dense(tp):
    run_distributed(_row_matches_dense, tp)


def _gathered_init(seed):
    from tpframe.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from tpframe.parallel import initialize_parallel

    comm = initialize_parallel(tp=torch.distributed.get_world_size()).tp_comm
    torch.manual_seed(seed)
    col = ColumnParallelLinear(12, 20)
    row = RowParallelLinear(20, 12)
    emb = VocabParallelEmbedding(30, 8, pad_to_multiple_of=4)
    return {
        "column": comm.all_gather(col.weight.detach(), dim=0),
        "row": comm.all_gather(row.weight.detach(), dim=1),
        "embedding": comm.all_gather(emb.weight.detach(), dim=0)[:30],
    }


def test_initialization_gives_the_same_full_weights_at_any_tp():
    full = run_distributed(_gathered_init, 1, 7)[0]
    torch.manual_seed(7)
    expected = [torch.empty(20, 12).normal_(0, 0.02), torch.empty(12, 20).normal_(0, 0.02)]
    assert torch.equal(full["column"], expected[0]) and torch.equal(full["row"], expected[1])
    for tp in (2, 4):
        for rank_result in run_distributed(_gathered_init, tp, 7):
            for name in full:
                assert torch.equal(rank_result[name], full[name]), f"{name} at tp={tp} differs from tp=1"


def _bad_inputs():
    from tpframe.layers import ColumnParallelLinear, RowParallelLinear
    from tpframe.parallel import initialize_parallel

    initialize_parallel(tp=torch.distributed.get_world_size())
    messages = {}
    for name, build in {
        "column_out": lambda: ColumnParallelLinear(16, 30),
        "row_in": lambda: RowParallelLinear(30, 16),
        "row_sp_without_parallel_input": lambda: RowParallelLinear(
            16, 16, input_is_parallel=False, sequence_parallel=True
        ),
        "column_input_shape": lambda: ColumnParallelLinear(16, 32)(torch.randn(4, 2, 15)),
        "row_input_shape": lambda: RowParallelLinear(32, 16)(torch.randn(4, 2, 32)),
        "sp_sequence_not_divisible": lambda: RowParallelLinear(32, 16, sequence_parallel=True)(torch.randn(6, 2, 8)),
    }.items():
        try:
            build()
        except ValueError as e:
            messages[name] = str(e)
    return messages


def test_bad_shapes_raise_clear_value_errors():
    messages = run_distributed(_bad_inputs, 4)[0]
    assert "out_features = 30 is not divisible by the tensor-parallel size 4" in messages["column_out"]
    assert "in_features = 30 is not divisible by the tensor-parallel size 4" in messages["row_in"]
    assert "input_is_parallel=True" in messages["row_sp_without_parallel_input"]
    assert "last dim 15, expected in_features = 16" in messages["column_input_shape"]
    assert "last dim 32, expected in_features/tp = 8" in messages["row_input_shape"]
    assert "(6, 2, 16) divisible by the group size 4" in messages["sp_sequence_not_divisible"]


def test_layers_decide_what_they_run_from_the_layer_mode_when_built():
    """Async TP only in sequence-parallel layers; the fused kernels off in linear, norm and attention layers alike;
    every parameter carries every tag, with its default where the layer set none."""
    from types import SimpleNamespace

    from tpframe.layers import ColumnParallelLinear, RowParallelLinear, build_norm
    from tpframe.layers.attention import ParallelAttention
    from tpframe.layers.mode import LayerMode
    from tpframe.layers.utils import PARAM_ATTRIBUTES, tag_param

    comm = SimpleNamespace(size=1, rank=0, device=torch.device("cpu"))
    mode = LayerMode(fused_kernels=False, async_tp=True)
    assert mode.async_tp == "copy_engine" and LayerMode().fused_kernels and LayerMode().async_tp is None
    sp, plain = (ColumnParallelLinear(16, 32, sequence_parallel=s, comm=comm, mode=mode) for s in (True, False))
    row = RowParallelLinear(32, 16, sequence_parallel=True, comm=comm, mode=mode)
    assert (sp.async_tp, row.async_tp, plain.async_tp) == ("copy_engine", "copy_engine", None)
    norm = build_norm("rmsnorm", 16, mode=mode)
    attn = ParallelAttention(16, 2, qk_norm=True, comm=comm, mode=mode)
    assert not (sp.fused_decode or norm.fused or attn.fused or attn.fused_decode or attn.q_norm.fused)
    for p in (*sp.parameters(), *row.parameters(), *norm.parameters(), *attn.parameters()):
        assert all(hasattr(p, name) for name in PARAM_ATTRIBUTES)
    assert attn.qkv.weight.fused_parts == (("q", 16), ("k", 16), ("v", 16)) and not row.weight.expert
    assert tag_param(row.weight, expert=True).expert and row.weight.tp_dim == 1  # a later tag keeps the others
    with pytest.raises(TypeError, match="first tags name tp_dim"):
        tag_param(torch.nn.Parameter(torch.zeros(2)), sequence_parallel=True)
    with pytest.raises(TypeError, match="unknown tags"):
        tag_param(row.weight, tp=0)
