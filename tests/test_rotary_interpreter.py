"""The Triton split + rotary kernels (tpframe/kernels/rotary.py) on CPU, in Triton's interpreter, against the torch
path they replace: tables shared by the batch ([s, 1, 1, d], training) and one row per sequence ([s, b, 1, d],
generation's left-padded rows), forward and backward, also with Qwen3's query/key norms in the same pass. Needs
Triton (skipped without it; tests/test_perf_gpu.py covers the device)."""

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

    from tpframe.kernels.rotary import qkv_rotary
    from tpframe.layers.attention import RotaryEmbedding, split_heads
    from tpframe.layers.norm import RMSNorm

    torch.manual_seed(0)
    for s, b, nq, nkv, d, table in (
        (5, 3, 4, 2, 16, "shared"),
        (5, 3, 4, 2, 16, "per_row"),
        (1, 4, 2, 2, 8, "per_row"),
        (3, 1, 3, 1, 12, "per_row"),
        (4, 2, 2, 1, 8, "2d"),
    ):
        rope = RotaryEmbedding(d, 64)
        if table == "per_row":  # each row at its own positions, as a left-padded generation batch
            positions = torch.stack([torch.arange(s) + 7 * i for i in range(b)])
            cos, sin = rope.at(positions, torch.float32)
        else:
            cos, sin = rope(s, torch.float32)
        qkv = torch.randn(s, b, (nq + 2 * nkv) * d, requires_grad=True)
        ref = split_heads(qkv, nq, nkv, d, (cos, sin), fused=False)  # the torch path
        grads = [torch.randn_like(t) for t in ref]
        ref_grad = torch.autograd.grad(ref, qkv, grads)[0]
        tables = (cos.flatten(1), sin.flatten(1)) if table == "2d" else (cos, sin)
        x = qkv.detach().clone().requires_grad_()
        got = qkv_rotary(x, *tables, nq, nkv, d)
        got_grad = torch.autograd.grad(got, x, grads)[0]
        case = f"s={s} b={b} nq={nq} nkv={nkv} d={d} table={table}"
        # in seq-major [s, b, n, d] memory: SDPA's output comes back so, and attention's [s, b, h] is a view of it
        assert all(t.permute(2, 0, 1, 3).is_contiguous() for t in got), case
        for name, x, y in zip("qkv", got, ref):
            torch.testing.assert_close(x, y.contiguous(), rtol=1e-5, atol=1e-5, msg=lambda m: f"{case} {name}: {m}")
        torch.testing.assert_close(got_grad, ref_grad, rtol=1e-5, atol=1e-5, msg=lambda m: f"{case} grad: {m}")
        # token-major memory ([b, s, n, d], what varlen attention reads as [b*s, n, d]): the same values, and a
        # backward that reads gradients in either layout
        x = qkv.detach().clone().requires_grad_()
        tm = qkv_rotary(x, *tables, nq, nkv, d, token_major=True)
        for name, t, y in zip("qkv", tm, ref):
            assert t.transpose(1, 2).is_contiguous(), f"{case} {name}: not token-major"
            torch.testing.assert_close(t, y, rtol=1e-5, atol=1e-5, msg=lambda m: f"{case} token-major {name}: {m}")
        strided = [g.transpose(1, 2).contiguous().transpose(1, 2) for g in grads]
        tm_grad = torch.autograd.grad(tm, x, strided)[0]
        torch.testing.assert_close(
            tm_grad, ref_grad, rtol=1e-5, atol=1e-5, msg=lambda m: f"{case} token-major grad: {m}"
        )
    # with Qwen3's query and key RMSNorms in the same pass: outputs, and the gradients of qkv and of both weights
    for s, b, nq, nkv, d, table in ((5, 3, 4, 2, 16, "shared"), (3, 2, 3, 1, 12, "per_row")):
        rope = RotaryEmbedding(d, 64)
        cos, sin = (
            rope.at(torch.stack([torch.arange(s) + 3 * i for i in range(b)]), torch.float32)
            if table == "per_row"
            else rope(s, torch.float32)
        )
        norms = [RMSNorm(d, 1e-5) for _ in "qk"]
        with torch.no_grad():
            for n in norms:
                n.weight.normal_(1.0, 0.5)
        qkv = torch.randn(s, b, (nq + 2 * nkv) * d, requires_grad=True) * 3
        ref = split_heads(qkv, nq, nkv, d, (cos, sin), fused=False, qk_norm=norms)
        grads = [torch.randn_like(t) for t in ref]
        inputs = [qkv, *(n.weight for n in norms)]
        ref_grads = torch.autograd.grad(ref, inputs, grads)
        for token_major in (False, True):
            got = qkv_rotary(
                qkv, cos, sin, nq, nkv, d, token_major=token_major, norm=(norms[0].weight, norms[1].weight, 1e-5)
            )
            got_grads = torch.autograd.grad(got, inputs, grads)
            case = f"qk_norm s={s} b={b} nq={nq} nkv={nkv} d={d} table={table} token_major={token_major}"
            for name, x, y in zip("qkv", got, ref):
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5, msg=lambda m: f"{case} {name}: {m}")
            for name, x, y in zip(("qkv", "q_norm.weight", "k_norm.weight"), got_grads, ref_grads):
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5, msg=lambda m: f"{case} grad {name}: {m}")
    bad = torch.randn(2, 2, 3, 1, 8)  # a table that is neither shared nor per row
    try:
        qkv_rotary(torch.randn(2, 2, 4 * 8), bad, bad, 2, 1, 8)
    except ValueError:
        pass
    else:
        raise AssertionError("a mismatched table must be refused")
    print("ok")


def test_rotary_kernels_match_the_torch_path_for_shared_and_per_row_tables():
    run_interpreted("test_rotary_interpreter")
