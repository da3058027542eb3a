"""The copy-engine sync's reduction kernel (tpframe/kernels/scaled_sum.py) on CPU, in Triton's interpreter, against
its plain-torch twin: one and several pulled slices, sizes around the block, scales 1 and 1/dp; and its checks.
Needs Triton (skipped without it; tests/test_copy_engine_gpu.py runs it on GPUs)."""

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

    from tpframe.kernels.scaled_sum import scaled_sum_, scaled_sum_torch_

    g = torch.Generator().manual_seed(0)
    for m, n, scale in ((1, 37, 0.5), (3, 4096, 0.25), (1, 4097, 1.0), (7, 5000, 0.125)):
        own, pulled = torch.randn(n, generator=g), torch.randn(m, n, generator=g)
        want = scaled_sum_torch_(own.clone(), pulled, scale)
        got = own.clone()
        scaled_sum_(got, pulled, scale)
        assert torch.equal(got, want), (m, n, scale, (got - want).abs().max())
    try:
        scaled_sum_(torch.zeros(8), torch.zeros(1, 8, dtype=torch.float64), 1.0)
    except ValueError as e:
        assert "need contiguous fp32" in str(e)
    else:
        raise AssertionError("scaled_sum_ accepted float64 slices")
    print("ok")


def test_scaled_sum_kernel_matches_torch_in_the_interpreter():
    run_interpreted("test_scaled_sum_interpreter")
