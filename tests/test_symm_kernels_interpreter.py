"""The symm kernels' logic on CPU: Triton's interpreter, one process per rank, shared CPU memory as the
"symmetric" buffers and signal pads. Checks tiling, tails, chunking, every world size (2, 4, 8) and
that the signal pads return to zero. Needs Triton (skipped without it; the GPU tests cover the device).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re

import pytest
import torch


def _interpreter_unusable() -> str:
    """Why Triton's interpreter cannot run here ('' if it can). Triton is not imported here: TRITON_INTERPRET
    must be set (in the rank processes) before triton is first imported."""
    if importlib.util.find_spec("triton") is None:
        return "the Triton interpreter tests need triton installed"
    import numpy as np

    version = tuple(int(v) for v in re.findall(r"\d+", importlib.metadata.version("triton"))[:2])
    if version >= (3, 9):  # 3.9's interpreter runs on numpy 2.3+ (checked with 2.4)
        return ""
    try:
        int(np.array([1]))  # Triton 3.6's interpreter converts 1-element arrays with int(); numpy >= 2.3 refuses
    except TypeError:
        found = f"Triton {'.'.join(map(str, version))}'s interpreter needs numpy < 2.3 (found {np.__version__})"
        return found + "; triton>=3.9 has no such limit"
    return ""


def run_interpreted(module: str) -> None:
    """`tests.<module>._check()` in a fresh process under TRITON_INTERPRET=1 (set before triton is imported);
    asserts it printed "ok"."""
    import subprocess
    import sys

    from tests.training_utils import REPO

    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", f"from tests.{module} import _check; _check()"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-4000:]


pytestmark = [
    pytest.mark.skipif(bool(_interpreter_unusable()), reason=_interpreter_unusable() or "-"),
    pytest.mark.slow,
]

BUF_BYTES = 1 << 20
PAD_SLOTS = 64


def _rank_data(seed: int, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(numel, generator=g, dtype=torch.float32).to(dtype)


def _worker(rank, world, bufs, pads, cases, results):
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        from tpframe.comm.symm.ops import SymmKernels

        dev = torch.device("cpu")
        table = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
        pad_table = torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64)
        k = SymmKernels(table, pad_table, bufs[rank].data_ptr(), BUF_BYTES, rank, world, 3, dev)
        errors = []
        for seed, (op, numel, dtype, *zero_copy) in enumerate(cases):
            if op == "all_gather":
                x = _rank_data(seed, rank, numel, dtype)
                out = torch.full((world * numel,), float("nan"), dtype=dtype)
                k.all_gather(x, out)
                ref = torch.cat([_rank_data(seed, r, numel, dtype) for r in range(world)])
                exact = True
            elif op == "reduce_scatter":
                x = _rank_data(seed, rank, numel * world, dtype)
                out = torch.full((numel,), float("nan"), dtype=dtype)
                k.reduce_scatter(x, out)
                full = sum(_rank_data(seed, r, numel * world, dtype).double() for r in range(world))
                ref, exact = full[rank * numel : (rank + 1) * numel], False
            else:
                x = _rank_data(seed, rank, numel, dtype)
                if zero_copy:  # the caller wrote its input into the symmetric buffer: no staging copy
                    x = bufs[rank][: numel * dtype.itemsize].view(dtype).copy_(x)
                before = x.clone()
                out = torch.full((numel,), float("nan"), dtype=dtype)
                k.all_reduce(x, out, op)
                ref, exact = sum(_rank_data(seed, r, numel, dtype).double() for r in range(world)), False
                if not zero_copy and not torch.equal(x, before):
                    errors.append(f"{op} n={numel} {dtype}: input modified")
            bad = torch.isnan(out).sum().item()
            if exact:
                ok = bad == 0 and torch.equal(out, ref)
            else:
                tol = 1e-5 if dtype == torch.float32 else 2e-2
                ok = bad == 0 and torch.allclose(out.double(), ref, rtol=tol, atol=tol * world)
            if not ok:
                errors.append(
                    f"{op} n={numel} {dtype}: {bad} unwritten, max err {(out.double() - ref).abs().max():.3g}"
                )
        k.barrier()
        results.put((rank, errors))
    except BaseException:  # noqa: BLE001 - the parent reports it
        import traceback

        results.put((rank, [traceback.format_exc()]))


def _run(world: int, cases):
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    bufs = [torch.zeros(BUF_BYTES, dtype=torch.uint8).share_memory_() for _ in range(world)]
    pads = [torch.zeros(PAD_SLOTS * world, dtype=torch.int32).share_memory_() for _ in range(world)]
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(r, world, bufs, pads, cases, results), daemon=True) for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        out = dict(results.get(timeout=600) for _ in range(world))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [f"rank {r}: {e}" for r in sorted(out) for e in out[r]]
    assert not errors, "\n".join(errors)
    for r, pad in enumerate(pads):
        assert int(pad.abs().sum()) == 0, (
            f"rank {r}'s signal pad did not return to zero: {pad.nonzero().flatten().tolist()}"
        )


CASES = [
    ("one_shot", 1, torch.float32),
    ("one_shot", 7, torch.bfloat16),
    ("one_shot", 4097, torch.float16),
    ("one_shot", 3 * 4096 + 5, torch.bfloat16),
    ("one_shot", 2048 * 7, torch.float32),
    ("push", 1, torch.float32),
    ("push", 1023, torch.bfloat16),
    ("push", 4096 * 3 + 7, torch.float16),
    ("two_shot", 1, torch.bfloat16),
    ("two_shot", 1023, torch.float32),
    ("two_shot", 4097, torch.bfloat16),
    ("two_shot", 8 * 4096 + 3, torch.float16),
    ("two_shot", 16 * 4096, torch.bfloat16),
    ("one_shot", 4099, torch.bfloat16, "zero-copy"),
    ("push", 4099, torch.float32, "zero-copy"),
    ("two_shot", 3 * 4096 + 1, torch.bfloat16, "zero-copy"),
    ("all_gather", 1, torch.bfloat16),
    ("all_gather", 1023, torch.float32),
    ("all_gather", 4096 * 5, torch.float16),
    ("reduce_scatter", 1, torch.float32),
    ("reduce_scatter", 1023, torch.bfloat16),
    ("reduce_scatter", 4096 * 4 + 8, torch.bfloat16),
]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_symm_kernels_match_reference_in_interpreter(world):
    cases = CASES if world < 8 else [c for c in CASES if c[1] < 20000]
    _run(world, cases)
