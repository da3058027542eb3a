"""The symm kernels on GPUs, with NCCL's result as the oracle: every op, dtype and available world size,
odd sizes (tails), 1,000 back-to-back calls, CUDA graph capture and the zero-copy input buffer.
Outputs are poisoned (NaN) before every run; inputs are random and must come back unmodified."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SIZES = (1, 7, 1023, 4097, (1 << 20) + 3, 3 << 20)
TOL = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 1e-5}
WORLDS = [pytest.param(w, marks=pytest.mark.gpu(count=w)) for w in (2, 4, 8)]


def _comm(backend="symm"):
    from tpframe.comm import Communicator

    comm = Communicator(backend=backend)
    assert comm.symm is not None, "symmetric memory did not set up"
    return comm


def _rand(numel, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(numel, device="cuda", generator=g, dtype=torch.float32).to(dtype)


def _nccl(comm, op, x):
    return getattr(comm.nccl, op)(x)


def _close(a, b, dtype):
    return bool(torch.allclose(a.float(), b.float(), rtol=TOL[dtype], atol=TOL[dtype] * 4))


def _every_kernel_matches_nccl():
    import torch.distributed as dist

    comm = _comm()
    k, rank, world = comm.symm.kernels, comm.rank, comm.size
    failures = []
    seed = 0
    for dtype in DTYPES:
        for numel in SIZES:
            seed += 1
            x = _rand(numel, dtype, seed * 100 + rank)
            before = x.clone()
            ref = _nccl(comm, "all_reduce", x)
            for algo in ("one_shot", "push", "two_shot"):
                out = torch.full_like(x, float("nan"))
                k.all_reduce(x, out, algo)
                if not _close(out, ref, dtype):
                    failures.append(
                        f"all_reduce {algo} {dtype} n={numel}: max err {(out.float() - ref.float()).abs().max()}"
                    )
                # every rank must hold the same bits (replicated tensors stay in sync)
                gathered = comm.nccl.all_gather(out.view(1, -1))
                if not all(torch.equal(gathered[0], g) for g in gathered):
                    failures.append(f"all_reduce {algo} {dtype} n={numel}: ranks disagree")
            out = torch.full((world * numel,), float("nan"), device="cuda", dtype=dtype)
            k.all_gather(x, out)
            if not torch.equal(out, _nccl(comm, "all_gather", x)):
                failures.append(f"all_gather {dtype} n={numel}")
            xs = _rand(numel * world, dtype, seed * 100 + 50 + rank)
            out = torch.full((numel,), float("nan"), device="cuda", dtype=dtype)
            k.reduce_scatter(xs, out)
            if not _close(out, _nccl(comm, "reduce_scatter", xs), dtype):
                failures.append(f"reduce_scatter {dtype} n={numel}")
            if not torch.equal(x, before):
                failures.append(f"input modified {dtype} n={numel}")
    # the Communicator path (dim 0 of a 2-D tensor, algorithm picked by size)
    x = _rand(6 * world * 4096, torch.bfloat16, 7 + rank).view(6 * world, 4096)
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        if not _close(getattr(comm, op)(x), _nccl(comm, op, x), torch.bfloat16):
            failures.append(f"Communicator.{op}")
    torch.cuda.synchronize()
    dist.barrier()
    return failures, _pad_sum(comm)


def _pad_sum(comm):
    """Sum of |slot| over this rank's signal pad: 0 once every barrier has been matched."""
    import torch.distributed as dist

    torch.cuda.synchronize()
    dist.barrier()
    h = comm.symm.handle
    pad = h.get_signal_pad(comm.rank, [comm.symm.kernels.max_programs * comm.size], torch.int32)
    return int(pad.abs().sum())


@pytest.mark.parametrize("world", WORLDS)
def test_every_symm_kernel_matches_nccl_for_every_dtype_and_odd_size(world):
    for failures, pads in run_distributed(_every_kernel_matches_nccl, world, backend="nccl", timeout=240):
        assert not failures, "\n".join(failures)
        assert pads == 0


def _thousand_calls():
    comm = _comm()
    rank = comm.rank
    small = _rand(4096, torch.bfloat16, 1 + rank)  # one-shot
    big = _rand(1 << 20, torch.bfloat16, 2 + rank)  # two-shot
    shard = _rand(3000, torch.float32, 3 + rank)
    k = comm.symm.kernels

    def calls():
        return [
            comm.all_reduce(small),
            comm.all_reduce(big),
            comm.all_gather(shard),
            comm.reduce_scatter(big),
            k.all_reduce(small, torch.empty_like(small), "push"),
        ]

    first = calls()
    drift = torch.zeros((), device="cuda")
    for i in range(1000):
        outs = calls()
        for o, f in zip(outs, first):
            drift = torch.maximum(drift, (o.float() - f.float()).abs().max())
        if i % 100 == 0:
            comm.barrier()
    ok = [
        _close(first[0], _nccl(comm, "all_reduce", small), torch.bfloat16),
        _close(first[1], _nccl(comm, "all_reduce", big), torch.bfloat16),
        torch.equal(first[2], _nccl(comm, "all_gather", shard)),
        _close(first[3], _nccl(comm, "reduce_scatter", big), torch.bfloat16),
        _close(first[4], first[0], torch.bfloat16),
    ]
    return float(drift), ok, _pad_sum(comm)


@pytest.mark.parametrize("world", WORLDS)
def test_thousand_back_to_back_calls_neither_hang_nor_drift(world):
    for drift, ok, pads in run_distributed(_thousand_calls, world, backend="nccl", timeout=240):
        assert drift == 0.0 and all(ok) and pads == 0, (drift, ok, pads)


def _graph_replays():
    comm = _comm()
    rank, world = comm.rank, comm.size
    shapes = {"ar_small": (2048,), "ar_big": (3 << 19,), "ag": (777,), "rs": (world * 5000,)}
    static = {name: torch.zeros(s, device="cuda", dtype=torch.bfloat16) for name, s in shapes.items()}

    def step():
        return [
            comm.all_reduce(static["ar_small"]),
            comm.all_reduce(static["ar_big"]),
            comm.all_gather(static["ag"]),
            comm.reduce_scatter(static["rs"]),
        ]

    for t in static.values():
        t.copy_(torch.randn_like(t))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up: compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    failures = []
    for replay in range(5):
        for i, t in enumerate(static.values()):
            t.copy_(_rand(t.numel(), torch.bfloat16, 1000 * replay + 10 * i + rank).view(t.shape))
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        refs = [
            _nccl(comm, "all_reduce", static["ar_small"]),
            _nccl(comm, "all_reduce", static["ar_big"]),
            _nccl(comm, "all_gather", static["ag"]),
            _nccl(comm, "reduce_scatter", static["rs"]),
        ]
        for name, o, r in zip(("ar_small", "ar_big", "ag", "rs"), outs, refs):
            if not _close(o, r, torch.bfloat16):
                failures.append(f"replay {replay} {name}")
    return failures, _pad_sum(comm)


@pytest.mark.parametrize("world", WORLDS)
def test_symm_collectives_replay_correctly_from_a_cuda_graph(world):
    for failures, pads in run_distributed(_graph_replays, world, backend="nccl", timeout=240):
        assert not failures and pads == 0, (failures, pads)


def _zero_copy_and_auto():
    comm = _comm("auto")
    rank = comm.rank
    failures = []
    for numel in (5, 4096, 1 << 20):
        x = _rand(numel, torch.float16, numel + rank)
        buf = comm.input_buffer((numel,), torch.float16)
        if buf.data_ptr() != comm.symm.buffer.data_ptr():
            failures.append("input_buffer is not the symmetric buffer")
        buf.copy_(x)
        for algo in ("one_shot", "push", "two_shot"):
            buf.copy_(x)
            out = torch.full_like(x, float("nan"))
            comm.symm.kernels.all_reduce(buf, out, algo)
            if not _close(out, _nccl(comm, "all_reduce", x), torch.float16):
                failures.append(f"zero-copy {algo} n={numel}")
        buf = comm.input_buffer((numel,), torch.float16)
        buf.copy_(x)
        if not torch.equal(comm.all_gather(buf), _nccl(comm, "all_gather", x)):
            failures.append(f"zero-copy all_gather n={numel}")
        if not _close(comm.all_reduce(x), _nccl(comm, "all_reduce", x), torch.float16):
            failures.append(f"auto all_reduce n={numel}")
    for numel in (4096, (1 << 20) + 1):  # an input 2 bytes past 16-byte alignment: the element-wise path
        xu = _rand(numel + 1, torch.bfloat16, 77 + rank)[1:]
        if not _close(comm.symm.all_reduce(xu), _nccl(comm, "all_reduce", xu), torch.bfloat16):
            failures.append(f"unaligned all_reduce n={numel}")
        if not torch.equal(comm.symm.all_gather(xu), _nccl(comm, "all_gather", xu)):
            failures.append(f"unaligned all_gather n={numel}")
    for _ in range(100):
        comm.barrier()
    return failures, _pad_sum(comm)


@pytest.mark.parametrize("world", WORLDS)
def test_zero_copy_input_buffer_and_auto_match_nccl(world):
    for failures, pads in run_distributed(_zero_copy_and_auto, world, backend="nccl", timeout=240):
        assert not failures and pads == 0, (failures, pads)
