"""Async TP on CPU (gloo), against the plain sequence-parallel path it replaces (tpframe/layers/async_tp.py).

- "ring": the ring all-gather + GEMM and GEMM + ring reduce-scatter equal all-gather / reduce-scatter around one
  GEMM (float64, TP 2 and 4); column + row layers give the plain layers' output and gradients (float32); each
  transfer starts before a GEMM and is waited for after it (the order that lets the GEMM hide it), and the column
  layer's backward starts its input gradient's reduce-scatter between its two GEMMs; train.py with
  parallel.async_tp=ring trains like the plain path.
- The GEMMs beside a collective in flight leave `comm.overlap_sm_margin` SMs (cuBLASLt's SM count target, set
  around them and restored after): checked by recording the setting at each GEMM of a backward and a ring.
- "copy_engine" without copy engines falls back to the plain path, bit for bit (its GPU test:
  tests/test_async_tp_ce_gpu.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.reference import assert_close
from tests.test_perf_paths import GPT_CFG, B, S


class _LoggedPending:
    """A `Pending` whose wait is logged in `events` (as `label`)."""

    def __init__(self, pending, events, label="wait"):
        self.pending, self.events, self.label, self.work = pending, events, label, pending.work

    def wait(self):
        self.events.append(self.label)
        return self.pending.wait()


def _fc_pair(comm, mode=None):
    """A column and a row layer, sequence-parallel, built with async TP `mode`: the same weights for every mode."""
    from tpframe.layers import ColumnParallelLinear, RowParallelLinear
    from tpframe.layers.mode import LayerMode

    torch.manual_seed(0)
    kw = dict(sequence_parallel=True, comm=comm, mode=LayerMode(async_tp=mode))
    fc1, fc2 = ColumnParallelLinear(16, 32, **kw), RowParallelLinear(32, 16, **kw)
    with torch.no_grad():
        fc1.bias.normal_(), fc2.bias.normal_()
    return fc1, fc2


def _run_pair(comm, x0, grad, mode):
    fc1, fc2 = _fc_pair(comm, mode)
    x = x0.clone().requires_grad_()
    y = fc2(torch.tanh(fc1(x)))
    y.backward(grad)
    return [y, x.grad] + [p.grad for p in (*fc1.parameters(), *fc2.parameters())]


def _ring_matches_plain():
    from tpframe.layers.async_tp import ring_all_gather_matmul, ring_matmul_reduce_scatter
    from tpframe.layers.mappings import scatter_to_sp
    from tpframe.parallel import initialize_parallel

    comm = initialize_parallel(tp=torch.distributed.get_world_size()).tp_comm
    n, r = comm.size, comm.rank
    g = torch.Generator().manual_seed(0)
    f64 = dict(dtype=torch.float64, generator=g)
    x_full, b, bias = torch.randn(2 * n, 3, 16, **f64), torch.randn(16, 12, **f64), torch.randn(12, **f64)
    full, y = ring_all_gather_matmul(x_full.chunk(n)[r], b, comm, bias)
    assert torch.equal(full, x_full), "the ring all-gather must return every rank's block in rank order"
    assert_close(y, x_full @ b + bias, 1e-12, "ring all-gather + GEMM", atol=1e-12)
    _, y = ring_all_gather_matmul(x_full.chunk(n)[r], b, comm)
    assert_close(y, x_full @ b, 1e-12, "ring all-gather + GEMM, no bias", atol=1e-12)
    xs = torch.randn(n, 2 * n, 3, 16, **f64)  # every rank's input; rank r multiplies xs[r]
    y = ring_matmul_reduce_scatter(xs[r], b, comm)
    assert_close(y, (xs @ b).sum(0).chunk(n)[r], 1e-12, "GEMM + ring reduce-scatter", atol=1e-12)

    x_in, grad_in = torch.randn(4 * n, 3, 16, generator=g), torch.randn(4 * n, 3, 16, generator=g)
    x0, grad = scatter_to_sp(x_in, comm), scatter_to_sp(grad_in, comm)
    plain, ring = (_run_pair(comm, x0, grad, mode) for mode in (None, "ring"))
    for what, a, b_ in zip(("y", "grad x", "grad fc1.w", "grad fc1.b", "grad fc2.w", "grad fc2.b"), ring, plain):
        assert_close(a, b_, 1e-5, f"ring async TP vs plain at tp={n}: {what}", atol=1e-6)
    return True


def test_ring_async_tp_equals_the_plain_sp_path_at_tp2_and_tp4():
    run_distributed(_ring_matches_plain, 2)
    run_distributed(_ring_matches_plain, 4)


def _compiled_ring_matches_plain():
    """The fc pair compiled whole (fullgraph, AOTAutograd's eager backend: forward and backward graphs traced)
    with the ring as tpframe's custom ops, against the eager plain SP path; every ring transfer counted."""
    from tpframe.layers.mappings import scatter_to_sp
    from tpframe.parallel import initialize_parallel

    comm = initialize_parallel(tp=torch.distributed.get_world_size()).tp_comm
    n = comm.size
    g = torch.Generator().manual_seed(1)
    x_in, grad_in = torch.randn(4 * n, 3, 16, generator=g), torch.randn(4 * n, 3, 16, generator=g)
    x0, grad = scatter_to_sp(x_in, comm), scatter_to_sp(grad_in, comm)
    plain = _run_pair(comm, x0, grad, None)
    transfers = []
    original = comm.exchange_async
    comm.exchange_async = lambda *a, **k: (transfers.append(1), original(*a, **k))[1]
    torch._dynamo.reset()
    fc1, fc2 = _fc_pair(comm, "ring")
    compiled = torch.compile(lambda x: fc2(torch.tanh(fc1(x))), backend="aot_eager", fullgraph=True)
    x = x0.clone().requires_grad_()
    y = compiled(x)
    y.backward(grad)
    ring = [y, x.grad] + [p.grad for p in (*fc1.parameters(), *fc2.parameters())]
    for what, a, b_ in zip(("y", "grad x", "grad fc1.w", "grad fc1.b", "grad fc2.w", "grad fc2.b"), ring, plain):
        assert_close(a, b_, 1e-5, f"compiled ring vs eager plain at tp={n}: {what}", atol=1e-6)
    # forward: the column ring's all-gather and the row ring's reduce-scatter; backward: the row layer's dY
    # all-gather and the column layer's dX reduce-scatter, each n - 1 transfers
    assert len(transfers) == 4 * (n - 1), f"tp={n}: {len(transfers)} ring transfers, expected {4 * (n - 1)}"
    return True


def test_compiled_blocks_run_the_ring_as_custom_ops_and_equal_the_plain_path():
    run_distributed(_compiled_ring_matches_plain, 2, timeout=300)
    run_distributed(_compiled_ring_matches_plain, 4, timeout=300)


def _ring_order():
    """The events of each ring: transfer starts ("start"), their waits, and the GEMMs ("mm")."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tpframe.layers.mappings import scatter_to_sp
    from tpframe.parallel import initialize_parallel

    comm = initialize_parallel(tp=torch.distributed.get_world_size()).tp_comm
    events: list = []
    original = comm.exchange_async

    def logged(*args, **kwargs):
        events.append("start")
        return _LoggedPending(original(*args, **kwargs), events)

    comm.exchange_async = logged
    original_rs = comm.reduce_scatter_async

    def logged_rs(*args, **kwargs):
        events.append("rs start")
        return _LoggedPending(original_rs(*args, **kwargs), events, "rs wait")

    comm.reduce_scatter_async = logged_rs

    class GemmLog(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (
                torch.ops.aten.mm.default,
                torch.ops.aten.addmm.default,
                torch.ops.aten.mm.out,
                torch.ops.aten.addmm.out,
            ):
                events.append("mm")
            return func(*args, **(kwargs or {}))

    fc1, fc2 = _fc_pair(comm, "ring")
    x = scatter_to_sp(torch.randn(4 * comm.size, 3, 16), comm).requires_grad_()
    out = {}
    with GemmLog():
        h = fc1(x)
        out["column forward (all-gather)"], events[:] = list(events), []
        y = fc2(torch.tanh(h))
        out["row forward (reduce-scatter)"], events[:] = list(events), []
        y.backward(torch.ones_like(y))
        out["backward"] = list(events)
    return comm.size, out


def _check_hidden(events: list, what: str, transfers: int) -> None:
    assert events.count("start") == transfers and events.count("wait") == transfers, (what, events)
    since = None
    for e in events:
        if e == "start":
            assert since is None, f"{what}: two transfers in flight at once: {events}"
            since = 0
        elif e == "mm" and since is not None:
            since += 1
        elif e == "wait":
            assert since, f"{what}: a transfer was waited for with no GEMM launched beside it: {events}"
            since = None


def test_each_ring_transfer_starts_before_a_gemm_and_is_waited_for_after_it():
    for n, out in (run_distributed(_ring_order, n)[0] for n in (2, 4)):
        _check_hidden(out["column forward (all-gather)"], f"tp={n} column forward", n - 1)
        _check_hidden(out["row forward (reduce-scatter)"], f"tp={n} row forward", n - 1)
        # backward: the row layer's ring all-gather of dy, then the column layer's dX GEMM, its reduce-scatter
        # started, the dW GEMM beside it, and the wait
        _check_hidden(out["backward"], f"tp={n} backward", n - 1)
        assert out["backward"][-4:] == ["mm", "rs start", "mm", "rs wait"], (n, out["backward"])
        assert out["column forward (all-gather)"][:2] == ["start", "mm"], "the own block's GEMM must not wait"


def _train_ring(tmp):
    from tests.training_utils import train_in_process

    common = ["parallel.tp=2", "parallel.sequence_parallel=true", "train.steps=3"]
    return {
        mode: [
            r["loss"] for r in train_in_process([*common, f"parallel.async_tp={mode}", f"train.run_dir={tmp}/{mode}"])
        ]
        for mode in ("false", "ring")
    }


def test_train_with_ring_async_tp_trains_like_the_plain_path_at_tp2(tmp_path):
    losses = run_distributed(_train_ring, 2, str(tmp_path), timeout=300)[0]
    assert len(losses["ring"]) == 3
    for step, (a, b) in enumerate(zip(losses["ring"], losses["false"]), 1):
        assert math.isclose(a, b, rel_tol=1e-5), f"step {step}: async_tp=ring loss {a!r} vs plain {b!r}"


def _gpu_modes_fall_back_on_cpu():
    from tpframe.layers.linear import ColumnParallelLinear, async_tp_available
    from tpframe.layers.mode import LayerMode
    from tpframe.models import BuildContext, build_model
    from tpframe.parallel import initialize_parallel, seed_parallel_rng

    state = initialize_parallel(tp=torch.distributed.get_world_size())
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, GPT_CFG.vocab_size, (B, S), generator=g)
    out = []
    for mode in (None, "copy_engine"):
        tracker = seed_parallel_rng(0)
        ctx = BuildContext(
            state.tp_comm, sequence_parallel=True, rng_tracker=tracker, seed=3, mode=LayerMode(async_tp=mode)
        )
        model = build_model(GPT_CFG, ctx)
        linears = [m for m in model.modules() if isinstance(m, ColumnParallelLinear)]
        assert all(m.async_tp == mode for m in linears)
        loss = model(ids, ids)
        loss.mean().backward()
        out.append((loss.detach(), [p.grad for p in model.parameters()]))
    assert not async_tp_available(state.tp_comm, torch.zeros(1), "copy_engine"), "CPU has no copy engines"
    assert state.tp_comm.peer_exchange() is None
    assert async_tp_available(state.tp_comm, torch.zeros(1), "ring"), "the ring runs wherever the group does"
    for other in out[1:]:
        assert torch.equal(out[0][0], other[0])
        assert all(torch.equal(a, b) for a, b in zip(out[0][1], other[1]))
    return True


def test_gpu_async_tp_modes_fall_back_to_the_plain_path_on_cpu():
    """copy_engine without copy engines: the plain path, bit for bit."""
    run_distributed(_gpu_modes_fall_back_on_cpu, 2)


class _FakeBlas:
    """Stands in for torch._C's BLAS settings in tpframe.comm.margin (a CPU build cannot select cuBLASLt)."""

    _BlasBackend = torch._C._BlasBackend

    def __init__(self):
        self.backend, self.carveout = torch._C._BlasBackend.Cublas, None

    def _get_blas_preferred_backend(self):
        return self.backend

    def _set_blas_preferred_backend(self, backend):
        self.backend = backend

    def _get_sm_carveout_experimental(self):
        return self.carveout

    def _set_sm_carveout_experimental(self, sms):
        self.carveout = sms


def test_gemm_sm_margin_sets_and_restores_the_cublaslt_carveout(monkeypatch):
    from tpframe.comm import margin

    blas = _FakeBlas()
    monkeypatch.setattr(margin, "_C", blas)
    cuda = torch.device("cuda")  # only the settings are touched: no CUDA work runs
    with margin.gemm_sm_margin(16, cuda):
        assert (blas.carveout, blas.backend) == (16, torch._C._BlasBackend.Cublaslt)
    assert (blas.carveout, blas.backend) == (None, torch._C._BlasBackend.Cublas)
    for sms, device in ((0, cuda), (16, torch.device("cpu"))):
        with margin.gemm_sm_margin(sms, device):
            assert blas.carveout is None and blas.backend == torch._C._BlasBackend.Cublas


def _margins_seen():
    """The SM carveout in force at each GEMM of a column layer's backward (plain and ring) and of the rings."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tpframe.comm import margin
    from tpframe.layers.mappings import scatter_to_sp
    from tpframe.parallel import initialize_parallel

    comm = initialize_parallel(tp=torch.distributed.get_world_size(), overlap_sm_margin=12).tp_comm
    pairs = {mode: _fc_pair(comm, mode) for mode in (None, "ring")}
    x = scatter_to_sp(torch.randn(4 * comm.size, 3, 16), comm).requires_grad_()
    comm.device = torch.device("cuda")  # a setting only: the GEMMs run on CPU
    margin._C = blas = _FakeBlas()
    seen: list = []

    class GemmLog(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
                seen.append(blas.carveout)
            return func(*args, **(kwargs or {}))

    out = {}
    for name, mode in (("plain", None), ("ring", "ring")):
        fc1, fc2 = pairs[mode]
        y = fc1(x)
        seen.clear()
        with GemmLog():
            y.backward(torch.ones_like(y))
        out[f"{name}: column backward"] = list(seen)
        if mode:
            seen.clear()
            with GemmLog():
                fc2(torch.tanh(fc1(x)))
            out["ring: forward"] = list(seen)
    return out


def test_gemms_beside_a_collective_leave_the_sm_margin():
    out = run_distributed(_margins_seen, 2)[0]
    # backward: dX's GEMM, then (collective started) dW's GEMM beside it
    assert out["plain: column backward"] == [None, None], out
    assert out["ring: column backward"] == [None, 12], out
    # tp=2 forward: column ring (own block beside the transfer, then the received block), row ring (the peer's
    # block first, then the own block beside the transfer of the peer's partial sum)
    assert out["ring: forward"] == [12, None, None, 12], out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
@pytest.mark.parametrize("mode", ["copy_engine"])
def test_gpu_async_tp_modes_are_one_line_and_exit_2_without_cuda(mode, capsys, tmp_path, monkeypatch):
    from tests.training_utils import REPO, torchrun_env

    monkeypatch.syspath_prepend(REPO)
    import train

    for key, value in torchrun_env(2).items():  # as torchrun sets it for the tp=2 config
        monkeypatch.setenv(key, value)
    code = train.main(
        [
            "--config",
            f"{REPO}/configs/tiny_cpu.yaml",
            f"train.run_dir={tmp_path}/run",
            "parallel.sequence_parallel=true",
            f"parallel.async_tp={mode}",
        ]
    )
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1, lines
    assert f"parallel.async_tp={mode} moves data between GPUs and no CUDA device is visible" in lines[0], lines
    assert not (tmp_path / "run").exists()
