"""Deferred weight gradients, for zero-bubble pipeline schedules: a linear layer's backward computes
the input (and bias) gradient now (B) and queues its weight gradient dW = dY^T X for later (W).

    store = WeightGradStore()
    with store.capturing():                  # linears run forward inside record that they may defer
        loss = model(x); loss.backward()     # B: input and bias gradients only
        store.seal(key)                      # the weight gradients that backward queued belong to `key`
        ...
        store.flush(key)                     # W: each dW, accumulated into .grad as autograd would

Outside `capturing()` (every schedule but the zero-bubble ones) `linear` is exactly F.linear. The
store is the one module-level switch: a backward may run on autograd's device thread, and activation
recompute re-runs forwards inside a backward, so the switch cannot be thread-local or per call.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

_ACTIVE: WeightGradStore | None = None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; inside `WeightGradStore.capturing()` its weight gradient is deferred to the store."""
    deferred = deferral(weight)
    if deferred is None:
        return F.linear(x, weight, bias)
    # The weight enters detached (no autograd edge: its hooks must not fire with a missing gradient);
    # the parameter itself rides along for the deferred accumulation.
    return _DeferredWeightLinear.apply(x, weight.detach(), bias, deferred)


def deferral(weight: torch.Tensor) -> _Deferred | None:
    """Where `weight`'s gradient goes when a zero-bubble schedule defers it (inside `capturing()`, with autograd
    on and the weight trained), else None. A GEMM's backward hands it `defer(compute)`; the W step calls compute()."""
    store = _ACTIVE
    if store is None or not weight.requires_grad or not torch.is_grad_enabled():
        return None
    return _Deferred(store, weight)


def _weight_grad(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    return dy.reshape(-1, dy.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))


class _Deferred:
    """Where a deferred weight gradient goes: the store, and the parameter it belongs to."""

    def __init__(self, store: WeightGradStore, param: torch.Tensor):
        self.store, self.param = store, param

    def defer(self, compute) -> None:
        """Queue `compute()` (-> the weight gradient) for the store's flush."""
        self.store.pending.append((self.param, compute))


class _DeferredWeightLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, deferred):
        ctx.save_for_backward(x, weight)
        ctx.deferred = deferred
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.needs_input_grad[2] else None
        ctx.deferred.defer(functools.partial(_weight_grad, x, grad_out))
        return grad_x, None, grad_bias, None


class WeightGradStore:
    """Weight gradients queued by backward passes, kept per key (e.g. (chunk, micro-batch)) until flushed."""

    def __init__(self):
        self.pending: list[tuple[torch.Tensor, Callable]] = []  # (param, computes its gradient) since the last seal
        self.sealed: dict[object, list] = {}

    @contextlib.contextmanager
    def capturing(self):
        global _ACTIVE
        previous, _ACTIVE = _ACTIVE, self
        try:
            yield self
        finally:
            _ACTIVE = previous

    def seal(self, key) -> None:
        """The weight gradients queued since the last seal belong to `key`."""
        if key in self.sealed:
            raise KeyError(f"weight gradients of {key!r} are already queued")
        self.sealed[key], self.pending = self.pending, []

    @torch.no_grad()
    def flush(self, key) -> None:
        """Compute `key`'s weight gradients and accumulate them through autograd (into .grad, with the
        parameters' post-accumulate hooks, e.g. the fp32 gradient buffer), one accumulation per parameter."""
        total: dict[int, list] = {}
        for param, compute in self.sealed.pop(key):
            dw = compute()
            if id(param) in total:
                total[id(param)][1] += dw
            else:
                total[id(param)] = [param, dw]
        if total:
            with torch.enable_grad():
                aliases = [p.view_as(p) for p, _ in total.values()]
            torch.autograd.backward(aliases, [dw for _, dw in total.values()])

    def __len__(self) -> int:
        return len(self.pending) + len(self.sealed)
