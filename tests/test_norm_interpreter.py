"""The Triton LayerNorm / RMSNorm kernels (tpframe/kernels/norm.py) on CPU, in Triton's interpreter, against torch's
F.layer_norm / F.rms_norm: forward, and the input, weight and bias gradients, with rows fewer and more than the
backward's programs (each program then walks several rows). Needs Triton (skipped without it;
tests/test_perf_gpu.py covers the device)."""

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

    from tpframe.kernels import norm as kn

    torch.manual_seed(0)
    for programs in (kn.BWD_PROGRAMS, 3):  # one row per program, then a stride of rows per program
        kn.BWD_PROGRAMS = programs
        for shape, rms, bias in (
            ((5, 3, 24), False, True),
            ((7, 40), False, False),
            ((4, 2, 16), True, False),
            ((1, 1, 33), True, False),
        ):
            h = shape[-1]
            x = torch.randn(shape, requires_grad=True)
            w = (1 + 0.1 * torch.randn(h)).requires_grad_()
            b = (0.1 * torch.randn(h)).requires_grad_() if bias else None
            ref = F.rms_norm(x, (h,), w, 1e-5) if rms else F.layer_norm(x, (h,), w, b, 1e-5)
            dy = torch.randn_like(ref)
            inputs = [x, w] + ([b] if bias else [])
            want = torch.autograd.grad(ref, inputs, dy)
            got = kn._Norm.apply(x, w, b, 1e-5, rms)
            grads = torch.autograd.grad(got, inputs, dy)
            case = f"shape={shape} rms={rms} bias={bias} programs={programs}"
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"{case} y: {m}")
            for name, g, r in zip(("dx", "dw", "db"), grads, want):
                torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5, msg=lambda m: f"{case} {name}: {m}")
    try:
        kn.norm(x, w, w, 1e-5, rms=True)
    except ValueError:
        pass
    else:
        raise AssertionError("an RMSNorm bias must be refused")
    print("ok")


def test_norm_kernels_match_torch_forward_and_backward():
    run_interpreted("test_norm_interpreter")
