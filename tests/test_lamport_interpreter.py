"""The Lamport (barrier-free) all-reduce's protocol on CPU: Triton's interpreter, one process per rank, shared
CPU memory as the symmetric buffers. A run of calls that changes size and dtype between calls (so every slot
is cleared after uses of other extents and dtypes), inputs holding -0.0 and the fp32 sentinel pattern, and
every world size. Needs Triton (skipped without it; tests/test_lamport_gpu.py covers the device)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.test_symm_kernels_interpreter import _interpreter_unusable

pytestmark = [
    pytest.mark.skipif(bool(_interpreter_unusable()), reason=_interpreter_unusable() or "-"),
    pytest.mark.slow,
]

SEG = 32 << 10  # bytes per segment: messages up to 32 KiB
CALLS = [
    (7, torch.bfloat16),
    (4097, torch.float32),
    (1, torch.float16),
    (3000, torch.bfloat16),
    (2048, torch.float32),
    (5, torch.bfloat16),
    (8192, torch.float16),
    (33, torch.float32),
    (1, torch.bfloat16),
    (4096, torch.float32),
]


def _data(seed: int, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(numel, generator=g).to(dtype)
    x[::5] = -0.0  # the 16-bit sentinel must travel as zero
    if dtype == torch.float32 and numel > 3:
        x.view(torch.int32)[3] = -2147450880  # the fp32 sentinel pattern (a -4.6e-41 denormal)
    return x


def _worker(rank, world, bufs, states, results):
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        from tpframe.comm.symm.lamport import LamportAllReduce

        table = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
        lamport = LamportAllReduce(table, states[rank], rank, world, SEG, 3, torch.device("cpu"))
        errors, outs = [], []
        for seed, (numel, dtype) in enumerate(CALLS):
            x = _data(seed, rank, numel, dtype)
            before = x.clone()
            out = torch.full((numel,), float("nan"), dtype=dtype)
            lamport.all_reduce(x, out)
            ref = sum(_data(seed, r, numel, dtype).double() for r in range(world))
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            if torch.isnan(out).any() or not torch.allclose(out.double(), ref, rtol=tol, atol=tol * world):
                errors.append(f"n={numel} {dtype}: max err {(out.double() - ref).abs().max():.3g}")
            if not torch.equal(x.view(torch.uint8), before.view(torch.uint8)):
                errors.append(f"n={numel} {dtype}: input modified")
            outs.append(out.view(torch.uint8).numpy().tobytes())  # plain bytes: the queue outlives no tensor
        results.put((rank, errors, outs, states[rank].tolist()))
    except BaseException:  # noqa: BLE001 - the parent reports it
        import traceback

        results.put((rank, [traceback.format_exc()], [], []))


@pytest.mark.parametrize("world", [2, 4])  # 8 works too (51 s on 2 cores)
def test_lamport_all_reduce_matches_reference_in_interpreter(world):
    import torch.multiprocessing as tmp

    from tpframe.comm.symm.lamport import SENTINEL_WORD, LamportAllReduce

    ctx = tmp.get_context("spawn")
    words = LamportAllReduce.buffer_bytes(world, SEG) // 4
    bufs = [torch.full((words,), SENTINEL_WORD, dtype=torch.int32).share_memory_() for _ in range(world)]
    states = [torch.zeros(8, dtype=torch.int32).share_memory_() for _ in range(world)]
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, bufs, states, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        out = {r: (e, o, s) for r, e, o, s in (results.get(timeout=600) for _ in range(world))}
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [f"rank {r}: {e}" for r in sorted(out) for e in out[r][0]]
    assert not errors, "\n".join(errors)
    for r in range(1, world):  # replicas must hold the same bits
        assert out[0][1] == out[r][1], f"rank {r}'s sums differ from rank 0's"
    for r in range(world):
        call, arrivals = out[r][2][:2]
        assert (call, arrivals) == (len(CALLS), 0), (r, out[r][2])
