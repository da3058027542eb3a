"""Activation recompute (activation checkpointing): keep a block's input, recompute the rest in backward.

torch's non-reentrant checkpoint replays the CPU and CUDA default RNG states; `recompute` replays the
tracker's TP streams too, so every dropout mask matches the first pass and gradients are bit-identical.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint

from tpframe.errors import ConfigError, yaml_shown
from tpframe.parallel.rng import RNGStatesTracker
from tpframe.parallel.state import get_parallel_state, is_initialized


def recompute(fn: Callable[..., Any], *args, tracker: RNGStatesTracker | None = None, preserve_rng: bool = True):
    """Run `fn(*args)` without keeping its activations; recompute them in backward.

    torch's non-reentrant checkpoint replays the CPU and CUDA default RNG states; the context
    below replays the tracker's streams too, so every dropout mask matches the first pass.
    `tracker` defaults to the parallel state's. `preserve_rng=False` (a block that draws no random
    numbers: no dropout) saves and restores no RNG state, which also lets a CUDA graph capture it
    (setting a generator's state is a host operation a graph cannot replay).
    """
    if not preserve_rng:
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
    if tracker is None:
        tracker = get_parallel_state().rng_tracker if is_initialized() else None
    if tracker is None:
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True)
    saved: dict[str, dict] = {}

    @contextlib.contextmanager
    def forward_context():
        saved["streams"] = tracker.get_states()
        yield

    @contextlib.contextmanager
    def recompute_context():
        current = tracker.get_states()
        tracker.set_states(saved["streams"])
        try:
            yield
        finally:
            tracker.set_states(current)

    return torch.utils.checkpoint.checkpoint(
        fn,
        *args,
        use_reentrant=False,
        preserve_rng_state=True,
        context_fn=lambda: (forward_context(), recompute_context()),
    )


# -- selective recompute ------------------------------------------------------------------------------
#
# `parallel.activation_checkpointing: selective` keeps every GEMM and attention output and recomputes only
# the cheap ops whose outputs the next GEMM would otherwise keep for its weight gradient: each norm (with
# its entry into the TP region: the sequence all-gather under SP) and the MLP's activation function. That
# drops 6 of a GPT block's ~16 saved [s, b, h] tensors (GELU, ffn 4h) for a few percent more time eager,
# about none compiled (README: activation recompute; plus, under SP, one more all-gather per norm in backward). Eager
# blocks use `RecomputedOutput` (Megatron-Core's CheckpointWithoutOutput); compiled blocks use torch's selective
# checkpointing with `sac_policy`, which Inductor's partitioner honours.


class RecomputedOutput:
    """Run `fn(*args)` now, keep only its inputs, free its output once consumed, rebuild it in backward.

        norm_out = RecomputedOutput(lambda t: enter(norm(t)), x)
        y = consumer(norm_out.output)        # the consumer saves norm_out.output for its backward
        norm_out.discard(after=y)            # frees the storage; refilled when y's gradient arrives

    The output's storage is resized to 0 (the tensor and whatever saved it keep their metadata) and,
    when the gradient of `after` is computed (before the consumer's backward runs), `fn` runs again
    and its result moves into the same storage object (its memory handed over; copied where the
    layout differs or the recompute graph keeps its own output, as ReLU's does). `fn` must draw no
    random numbers; the gradient flows to `args` and to `fn`'s parameters through the recomputed graph.
    """

    def __init__(self, fn: Callable[..., torch.Tensor], *args: torch.Tensor):
        self.fn, self.nbytes, self.ctx = fn, 0, None
        self.output = _RecomputedOutputFunction.apply(self, *args)

    def discard(self, *, after: torch.Tensor) -> None:
        storage = self.output.untyped_storage()
        self.nbytes = storage.nbytes()
        storage.resize_(0)
        after.register_hook(self._recompute)

    def _recompute(self, grad: torch.Tensor) -> None:
        if self.ctx is None:
            raise RuntimeError(
                "selective recompute runs one backward per forward; a second backward through the "
                "same graph (retain_graph=True) is not supported: use activation_checkpointing=full"
            )
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in self.ctx.saved_tensors]
        saved: set[int] = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.add(t.untyped_storage().data_ptr())
            return t

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = self.fn(*inputs)
        storage, fresh = self.output.untyped_storage(), out.untyped_storage()
        if (
            fresh.nbytes() == self.nbytes
            and out.stride() == self.output.stride()
            and out.storage_offset() == self.output.storage_offset()
            and fresh.data_ptr() not in saved
            and hasattr(storage, "_swap_data_ptr_")
        ):
            # no copy: the recomputed memory becomes the output's (the recompute graph does not read its output)
            storage._swap_data_ptr_(fresh)
        else:
            storage.resize_(self.nbytes)
            with torch.no_grad():
                self.output.data.copy_(out)  # .data: no version bump, the consumer's saved copy stays valid
        self.ctx.inputs, self.ctx.recomputed = inputs, out
        self.fn = self.ctx = self.output = None  # one backward per forward


class _RecomputedOutputFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, holder: RecomputedOutput, *args):
        with torch.no_grad():
            out = holder.fn(*args)
        ctx.save_for_backward(*args)
        holder.ctx = ctx
        return out

    @staticmethod
    def backward(ctx, grad):
        out, inputs = getattr(ctx, "recomputed", None), getattr(ctx, "inputs", None)
        if out is None:
            raise RuntimeError(
                "RecomputedOutput: backward reached an output that was never recomputed "
                "(discard(after=...) must name a tensor the backward passes through)"
            )
        torch.autograd.backward(out, grad)
        ctx.recomputed = ctx.inputs = None
        return (None, *(t.grad if t.requires_grad else None for t in inputs))


def sac_policy(ctx, op, *args, **kwargs):
    """torch selective checkpointing inside compiled blocks: keep GEMM, attention, rotary and reduction
    outputs; recompute the rest (norms, activation functions, the SP all-gather before a GEMM)."""
    from torch.utils.checkpoint import CheckpointPolicy

    if op in _saved_ops() or torch.Tag.nondeterministic_seeded in getattr(op, "tags", ()):  # dropout masks too
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


@functools.cache
def _saved_ops() -> frozenset:
    aten = torch.ops.aten
    names = [
        "mm",
        "addmm",
        "bmm",
        "_scaled_mm",
        "_scaled_mm_v2",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    ]
    ops = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    tp = getattr(torch.ops, "tpframe", None)
    names = ("all_reduce", "reduce_scatter", "qkv_rotary")
    ops.update(getattr(tp, n).default for n in names if hasattr(tp, n))
    return frozenset(ops)


def _sac_contexts():
    return torch.utils.checkpoint.create_selective_checkpoint_contexts(sac_policy)


class _NoInPlaceNotice(logging.Filter):
    """torch warns that a compiled region under a selective-checkpoint context_fn must hold no in-place ops. Ours
    hold none (under torch.compile the collectives are functional custom ops), so the notice only adds noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint" not in str(record.msg)


logging.getLogger("torch._higher_order_ops.wrap").addFilter(_NoInPlaceNotice())


def selective_checkpoint(fn: Callable[..., Any], *args):
    """`fn(*args)` under torch's selective checkpointing with `sac_policy` (for traced, compiled code;
    dynamo needs the context function at module level)."""
    return torch.utils.checkpoint.checkpoint(
        fn, *args, use_reentrant=False, preserve_rng_state=False, context_fn=_sac_contexts
    )


def check_recompute(cfg) -> None:
    """parallel.activation_checkpointing and parallel.recompute_layers (`cfg`: the run's Config)."""
    p = cfg.parallel
    if p.recompute_layers is not None:
        if p.recompute != "full":
            raise ConfigError(
                f"parallel.recompute_layers={p.recompute_layers} picks which blocks recompute whole; it "
                f"needs parallel.activation_checkpointing=full (got {yaml_shown(p.activation_checkpointing)})"
            )
        if not 1 <= p.recompute_layers <= cfg.model.layers:
            raise ConfigError(
                f"parallel.recompute_layers={p.recompute_layers} must be in 1..model.layers="
                f"{cfg.model.layers} (null: every block)"
            )
    if p.recompute == "selective" and p.async_tp not in (False, "auto"):  # "auto" stays off here
        raise ConfigError(
            "parallel.activation_checkpointing=selective re-gathers the norm outputs itself, which "
            "parallel.async_tp would overlap with the GEMM; turn one off"
        )
