"""The barrier-free (Lamport) all-reduce on GPUs, NCCL as the oracle: every dtype and tail size (inputs
holding -0.0), 10,000 back-to-back calls of changing size and dtype, and 1,000 replays of a CUDA graph
through the Communicator. Outputs are poisoned (NaN) first; replicas must hold identical bits."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TOL = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 1e-5}
WORLDS = [pytest.param(w, marks=pytest.mark.gpu(count=w)) for w in (2, 4, 8)]
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _lamport():
    from tpframe.comm import Communicator

    comm = Communicator(backend="symm")
    assert comm.symm is not None and comm.symm.lamport is not None, "symmetric memory / Lamport did not set up"
    return comm, comm.symm.lamport


def _rand(numel, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(numel, device="cuda", generator=g, dtype=torch.float32).to(dtype)
    x[::7] = -0.0  # the sentinel's 16-bit half: must arrive as zero
    return x


def _close(a, b, dtype):
    return bool(torch.allclose(a.float(), b.float(), rtol=TOL[dtype], atol=TOL[dtype] * 4))


def _same_on_every_rank(comm, out):
    gathered = comm.nccl.all_gather(out.view(torch.uint8).view(1, -1))
    return all(torch.equal(gathered[0], g) for g in gathered)


def _every_dtype_and_tail():
    comm, lamport = _lamport()
    failures, seed = [], 0
    for dtype in DTYPES:
        top = lamport.seg_bytes // dtype.itemsize
        for numel in (1, 2, 7, 1023, 4097, 65536 + 3, top - 1, top):
            seed += 1
            x = _rand(numel, dtype, seed * 10 + comm.rank)
            before = x.clone()
            out = torch.full_like(x, float("nan"))
            lamport.all_reduce(x, out)
            ref = comm.nccl.all_reduce(x)
            if torch.isnan(out).any() or not _close(out, ref, dtype):
                failures.append(f"{dtype} n={numel}: max err {(out.float() - ref.float()).abs().max()}")
            if not _same_on_every_rank(comm, out):
                failures.append(f"{dtype} n={numel}: ranks disagree")
            if not torch.equal(x.view(torch.uint8), before.view(torch.uint8)):
                failures.append(f"{dtype} n={numel}: input modified")
    return failures


@pytest.mark.parametrize("world", WORLDS)
def test_lamport_all_reduce_matches_nccl_for_every_dtype_and_tail_size(world):
    for failures in run_distributed(_every_dtype_and_tail, world, backend="nccl", env=ENV, timeout=240):
        assert not failures, "\n".join(failures)


def _ten_thousand_calls():
    comm, lamport = _lamport()
    shapes = [
        (4096, torch.bfloat16),
        (777, torch.float32),
        (16384, torch.bfloat16),
        (3, torch.float16),
        (65536, torch.bfloat16),
    ]
    inputs = [_rand(n, d, 100 + i * 10 + comm.rank) for i, (n, d) in enumerate(shapes)]
    first = [lamport.all_reduce(x, torch.empty_like(x)) for x in inputs]
    ok = [_close(f, comm.nccl.all_reduce(x), x.dtype) for f, x in zip(first, inputs)]
    calls0 = int(lamport.state[0])
    drift = torch.zeros((), device="cuda")
    for i in range(10_000):
        x = inputs[i % len(inputs)]
        out = lamport.all_reduce(x, torch.empty_like(x))
        drift = torch.maximum(drift, (out.float() - first[i % len(inputs)].float()).abs().max())
    torch.cuda.synchronize()
    return float(drift), ok, int(lamport.state[0]) - calls0, int(lamport.state[1])


@pytest.mark.parametrize("world", WORLDS)
def test_lamport_survives_ten_thousand_back_to_back_calls(world):
    for drift, ok, calls, arrivals in run_distributed(_ten_thousand_calls, world, backend="nccl", env=ENV, timeout=240):
        assert drift == 0.0 and all(ok), (drift, ok)
        assert calls == 10_000 and arrivals == 0, (calls, arrivals)


def _graph_thousand_replays():
    from tpframe.comm import Communicator

    comm = Communicator(backend="symm")
    lamport = comm.symm.lamport
    comm.symm._algos.clear()
    comm.symm._pick_algorithm = lambda numel, dtype: "lamport"  # force it: this test is about Lamport in graphs
    static = [
        torch.zeros(n, device="cuda", dtype=d)
        for n, d in ((2048, torch.bfloat16), (8192, torch.bfloat16), (1000, torch.float32))
    ]

    def step():
        return [comm.all_reduce(t) for t in static]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up: plans and compilation outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    calls0 = int(lamport.state[0])
    failures = []
    for replay in range(1000):
        for i, t in enumerate(static):
            t.copy_(_rand(t.numel(), t.dtype, 1000 * replay + 10 * i + comm.rank))
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        for i, (o, t) in enumerate(zip(outs, static)):
            if not _close(o, comm.nccl.all_reduce(t), t.dtype):
                failures.append(f"replay {replay} tensor {i}")
    torch.cuda.synchronize()
    return failures[:10], int(lamport.state[0]) - calls0


@pytest.mark.parametrize("world", WORLDS)
def test_lamport_replays_correctly_a_thousand_times_from_a_cuda_graph(world):
    for failures, calls in run_distributed(_graph_thousand_replays, world, backend="nccl", env=ENV, timeout=240):
        assert not failures, failures
        assert calls == 3000, f"the graph ran {calls} Lamport all-reduces, expected 3 per replay"
