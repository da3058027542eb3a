"""The decode-attention kernels (tpframe/kernels/decode_attention.py) on CPU, in Triton's interpreter, against SDPA
with the same additive mask: one and several cache splits (the merge kernel), grouped-query heads (their own
kernel: groups of 2, 3, 4 and 32 query heads per kv head), rows whose first
slots are all masked (left padding longer than a split), one and two query tokens. Needs Triton (skipped without
it; tests/test_perf_gpu.py covers the device)."""

from __future__ import annotations

import pytest

from tests.test_symm_kernels_interpreter import _interpreter_unusable, run_interpreted

pytestmark = [
    pytest.mark.skipif(bool(_interpreter_unusable()), reason=_interpreter_unusable() or "-"),
    pytest.mark.slow,
]


def cache_case(b: int, nq: int, nkv: int, s: int, slots: int, d: int, *, dtype, device="cpu", seed: int = 0):
    """q, k, v and a generation-style mask: row i's real tokens start at slot 37 * i (left padding), the s query
    tokens sit at the last written slots."""
    import torch

    from tpframe.inference.kv_cache import KVCache

    g = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(shape, generator=g).to(device=device, dtype=dtype)
        for shape in ((b, nq, s, d), (b, nkv, slots, d), (b, nkv, slots, d))
    )
    cache = KVCache(["0"], batch=b, kv_heads=nkv, head_dim=d, max_len=slots, dtype=dtype, device=device)
    cache.reset(torch.tensor([min(37 * i, slots - s - 1) for i in range(b)], device=device))
    cache.advance(slots - s)
    cache.begin(s)
    return q, k, v, cache.mask


def _check() -> None:
    """Run under TRITON_INTERPRET=1 (set before triton is imported): raises on a mismatch."""
    import torch
    import torch.nn.functional as F

    from tpframe.kernels import decode_attention as da

    cases = (
        (1, 2, 2, 1, 16, 16),
        (1, 4, 4, 1, 48, 16),
        (3, 4, 2, 1, 200, 16),
        (2, 2, 1, 2, 130, 8),
        (2, 3, 3, 1, 64, 12),
        (2, 8, 2, 1, 100, 16),
        (1, 6, 2, 2, 40, 16),
        (1, 32, 1, 1, 20, 16),
    )
    planned = da.PROGRAMS, da.GROUP_PROGRAMS
    for programs in (planned, (1, 1)):  # the planned splits (one tile each, merged), then one split looping over tiles
        da.PROGRAMS, da.GROUP_PROGRAMS = programs
        for b, nq, nkv, s, slots, d in cases:
            q, k, v, mask = cache_case(b, nq, nkv, s, slots, d, dtype=torch.float32)
            ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=nkv != nq)
            splits = da.launch_plan(b, nq, nkv, s, slots)[2]
            got = da.decode_attention(q, k, v, mask)
            torch.testing.assert_close(
                got,
                ref,
                rtol=1e-5,
                atol=1e-5,
                msg=lambda m: f"b={b} nq={nq} nkv={nkv} s={s} L={slots} splits={splits}: {m}",
            )
    da.PROGRAMS, da.GROUP_PROGRAMS = planned
    assert da.plan_splits(2, 16) == (1, 16) and da.plan_splits(1, 48) == (3, 16) and da.plan_splits(16, 256) == (16, 16)
    assert da.plan_splits(2048, 4096) == (1, 4096) and da.plan_splits(1, 1 << 20)[0] == da.MAX_SPLITS
    try:
        da.decode_attention(q, k, v, mask[:, :, :, :-1])
    except ValueError:
        pass
    else:
        raise AssertionError("a mask of the wrong length must be refused")
    print("ok")


def test_decode_attention_matches_sdpa_with_the_cache_mask():
    run_interpreted("test_decode_attention_interpreter")
