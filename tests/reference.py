"""Comparison helpers for parallel-vs-reference tests."""

from __future__ import annotations

import torch

FP32_TOL = 1e-5
BF16_TOL = 2e-2  # bf16 keeps 8 bits of mantissa; partial sums are rounded before the reduce


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.detach().double(), ref.detach().double()
    if got.shape != ref.shape:
        raise AssertionError(f"shape {tuple(got.shape)} != reference {tuple(ref.shape)}")
    if not torch.isfinite(got).all():
        raise AssertionError("non-finite values")
    denom = ref.norm().item()
    return (got - ref).norm().item() / (denom if denom > 0 else 1.0)


def assert_close(got: torch.Tensor, ref: torch.Tensor, tol: float, what: str, atol: float = 0.0) -> None:
    """‖got - ref‖ <= tol * ‖ref‖ + atol (atol for tensors that are zero in exact arithmetic)."""
    err = rel_err(got, ref)
    if not err <= tol:
        abs_err = (got.detach().double() - ref.detach().double()).norm().item()
        if abs_err <= tol * ref.detach().double().norm().item() + atol:
            return
        raise AssertionError(f"{what}: relative error {err:.3e} > {tol:.1e} (absolute {abs_err:.3e})")


def tol_for(dtype: torch.dtype) -> float:
    return FP32_TOL if dtype == torch.float32 else BF16_TOL


def leaf(t: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A fresh leaf copy of `t` in `dtype` that records its gradient."""
    return t.detach().clone().to(dtype).requires_grad_()


def loss_and_full_tensors(model, ids: torch.Tensor, labels: torch.Tensor, comm):
    """A TP model's per-token loss on (ids, labels), after its backward of the mean, with its full logical weights and
    gradients (sequence-parallel gradients summed over TP first): what a plain single-process model is checked by."""
    from tpframe.optim.grad_buffer import allreduce_sequence_parallel_grads, sequence_parallel_grads
    from tpframe.parallel.sharding import gather_full_tensors

    loss = model(ids, labels)
    loss.mean().backward()
    allreduce_sequence_parallel_grads(sequence_parallel_grads(model.parameters()), comm)
    return loss, gather_full_tensors(model, comm), gather_full_tensors(model, comm, source="grad")
