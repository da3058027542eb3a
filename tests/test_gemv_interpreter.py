"""The one-row linear kernel (tpframe/kernels/gemv.py) on CPU, in Triton's interpreter, against F.linear: sizes that
are not multiples of its blocks (a masked tail of rows and of K), K over one block (the loop), with and without a
bias, weight rows with a stride wider than K, a non-contiguous input row, the MLP activations it can apply (SwiGLU,
GELU, ReLU), and its input checks. Needs Triton
(skipped without it; tests/test_perf_gpu.py covers the device and the dispatch inside CUDA-graph capture)."""

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
    import torch.nn.functional as F

    from tpframe.kernels import gemv

    g = torch.Generator().manual_seed(0)
    for n, k, bias in ((5, 7, False), (33, 1500, True), (8, 2048, False), (3, 1024, True)):
        wide = torch.randn(n, k + 3, generator=g)
        for w in (wide[:, :k].contiguous(), wide[:, :k]):  # rows k apart, and k + 3 apart
            b = torch.randn(n, generator=g) if bias else None
            for x in (
                torch.randn(1, 1, k, generator=g),
                torch.randn(k, generator=g),
                torch.randn(k, 2, generator=g).t()[:1],
            ):  # the last: one row with stride 2
                got = gemv.row_linear(x, w, b)
                want = F.linear(x, w, b)
                assert got.shape == want.shape, (got.shape, want.shape)
                torch.testing.assert_close(
                    got, want, rtol=1e-5, atol=1e-4, msg=lambda m: f"n={n} k={k} bias={bias}: {m}"
                )
    for n, k, bias in ((6, 40, True), (34, 1100, False)):  # the MLP activations applied in the kernel
        w, x = torch.randn(n, k, generator=g), torch.randn(1, k, generator=g)
        b = torch.randn(n, generator=g) if bias else None
        h = F.linear(x, w, b)
        gate, up = h.chunk(2, dim=-1)
        for activation, want in (
            ("swiglu", F.silu(gate) * up),
            ("gelu", F.gelu(h, approximate="tanh")),
            ("relu", F.relu(h)),
        ):
            got = gemv.row_linear(x, w, b, activation=activation)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4, msg=lambda m: f"{activation} n={n} k={k}: {m}")
    for bad in ((torch.randn(1, 7), torch.randn(5, 7), "swiglu"), (torch.randn(1, 7), torch.randn(4, 7), "tanh")):
        try:
            gemv.row_linear(bad[0], bad[1], activation=bad[2])
        except ValueError:
            pass
        else:
            raise AssertionError(f"row_linear accepted activation {bad[2]} on {tuple(bad[1].shape)}")
    try:
        gemv.row_linear(torch.randn(2, 7), torch.randn(5, 7))
    except ValueError as e:
        assert "one row" in str(e)
    else:
        raise AssertionError("row_linear accepted two rows")
    assert not gemv.takes(torch.randn(1, 7), torch.randn(5, 7)), "CPU tensors never take the kernel"
    print("ok")


def test_row_linear_kernel_matches_f_linear_in_the_interpreter():
    run_interpreted("test_gemv_interpreter")
