"""The KV-cache write kernel (tpframe/kernels/kv_write.py) on CPU, in Triton's interpreter, against torch's two
index_copy_: one and several tokens, several rows and heads, a head size that is not a power of two, slots in the
middle of the cache; and its shape checks. Needs Triton (skipped without it; the GPU generation tests run it inside
the decode graphs)."""

from __future__ import annotations

import pytest

from tests.test_symm_kernels_interpreter import _interpreter_unusable, run_interpreted

pytestmark = [
    pytest.mark.skipif(bool(_interpreter_unusable()), reason=_interpreter_unusable() or "-"),
    pytest.mark.slow,
]


def _check() -> None:
    """Run under TRITON_INTERPRET=1 (set before triton is imported): raises on a mismatch."""
    import torch

    from tpframe.kernels.kv_write import kv_write

    g = torch.Generator().manual_seed(0)
    for b, n, s, slots, d, first in ((1, 2, 1, 8, 16, 5), (3, 4, 2, 20, 12, 7), (2, 1, 4, 9, 8, 0)):
        k, v = (torch.randn(b, n, s, d, generator=g) for _ in range(2))
        cache_k, cache_v = (torch.randn(b, n, slots, d, generator=g) for _ in range(2))
        index = torch.arange(first, first + s)
        want_k, want_v = cache_k.clone().index_copy_(2, index, k), cache_v.clone().index_copy_(2, index, v)
        kv_write(k, v, cache_k, cache_v, index)
        assert torch.equal(cache_k, want_k) and torch.equal(cache_v, want_v), (b, n, s, slots, d)
    try:
        kv_write(k, v, cache_k[:, :, :, :-1], cache_v[:, :, :, :-1], index)
    except ValueError as e:
        assert "do not fit" in str(e)
    else:
        raise AssertionError("kv_write accepted a cache of the wrong head size")
    print("ok")


def test_kv_write_kernel_matches_index_copy_in_the_interpreter():
    run_interpreted("test_kv_write_interpreter")
