"""The optimizer step's fast paths: lazy gradient zeroing, clipping folded into fused AdamW, against the plain way."""

from __future__ import annotations

import math

import pytest
import torch

from tests.dist_utils import run_distributed
from tpframe.layers.utils import tag_param
from tpframe.optim.grad_buffer import GradBuffer
from tpframe.optim.strategy import clip_factor


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lazy_zero_copies_the_first_gradient_adds_the_rest_and_zeroes_params_without_one(dtype):
    torch.manual_seed(0)
    a, b, c = (tag_param(torch.nn.Parameter(torch.randn(*s, dtype=dtype)), tp_dim=None) for s in ((5, 3), (7,), (4,)))
    grads = GradBuffer([a, b, c], None, dp_size=1, bucket_bytes=16)  # several buckets
    assert len(grads.buckets) > 1
    xs = [torch.randn(5, 3, dtype=dtype) for _ in range(3)]

    def backward(x, with_b=True):
        loss = (a * x).sum() + (c * c).sum() * 0.5 + ((b * b).sum() if with_b else 0.0)
        loss.backward()

    grads.zero()
    backward(xs[0])
    grads.finish_sync()
    assert torch.equal(b.main_grad, (2 * b.detach()).float())
    # next step: two micro-batches, b gets no gradient at all
    grads.zero()
    backward(xs[1], with_b=False)
    grads.start_sync()
    backward(xs[2], with_b=False)
    grads.finish_sync()
    expected_a = xs[1].float() + xs[2].float()  # each micro-batch's bf16 grad accumulates in fp32
    torch.testing.assert_close(a.main_grad, expected_a, rtol=0, atol=0)
    torch.testing.assert_close(c.main_grad, 2 * c.detach().float(), rtol=0, atol=0)
    assert torch.count_nonzero(b.main_grad) == 0, "a param without a gradient this step reads zero, not last step's"
    padding = torch.ones(grads.numel, dtype=torch.bool)
    for p in (a, b, c):
        padding[grads.offsets[p] : grads.offsets[p] + p.numel()] = False
    assert torch.count_nonzero(grads.buffer[padding]) == 0, "bucket padding stays zero"


def test_clip_factor():
    assert clip_factor(0.5, 1.0) == 1.0
    assert clip_factor(4.0, 1.0) == pytest.approx(0.25, rel=1e-6)
    assert clip_factor(4.0, 0.0) == 1.0, "max_norm 0 disables clipping"
    assert clip_factor(math.nan, 1.0) == 1.0 and clip_factor(math.inf, 1.0) == 1.0, "a non-finite step is skipped"


def _ddp_steps(fused: bool, dtype: str, max_norm: float, steps: int = 3):
    """Masters, moments and the clipped gradients after `steps` ddp steps of a tiny GPT, with torch's fused AdamW
    (clipping folded into its kernel through grad_scale) or the foreach one (clipping in place)."""
    from tpframe.models import BuildContext, build_model
    from tpframe.models.config import ModelConfig
    from tpframe.optim import OptimConfig, build_strategy
    from tpframe.parallel import initialize_parallel, seed_parallel_rng

    state = initialize_parallel(tp=1)
    seed_parallel_rng(0)
    dt = getattr(torch, dtype)
    model = build_model(
        ModelConfig(hidden=32, layers=2, heads=4, vocab_size=128, max_seq_len=16), BuildContext(state.tp_comm, dtype=dt)
    )
    cfg = OptimConfig(lr=1e-2, grad_clip=max_norm)
    strategy = build_strategy("ddp", model, cfg, state, compute_dtype=dt)
    old = strategy.optimizer  # the same groups, with the AdamW implementation asked for
    groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in old.param_groups]
    strategy.optimizer = torch.optim.AdamW(
        groups,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=fused or None,
        foreach=None if fused else True,
    )
    gen = torch.Generator().manual_seed(1)
    norms = []
    for _ in range(steps):
        strategy.zero_grad()
        tokens = torch.randint(0, 128, (2, 17), generator=gen).to(state.device)
        model(tokens[:, :-1], tokens[:, 1:]).mean().backward()
        strategy.finish_grad_sync()
        norms.append(strategy.clip_grad_norm(max_norm))
        clipped = strategy.grads.buffer.clone() if not fused else None
        strategy.step(cfg.lr)
        if fused:
            clipped = strategy.grads.buffer.clone()  # the fused kernel stores the scaled gradient back
        assert getattr(strategy.optimizer, "grad_scale", None) is None, "the clip factor is consumed by the step"
    state_ = strategy.optimizer.state
    moments = [state_[m]["exp_avg_sq"].cpu() for m in strategy.masters]
    return (
        [m.detach().cpu() for m in strategy.masters],
        moments,
        clipped.cpu(),
        norms,
        [p.detach().cpu() for p in model.parameters()],
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_clipping_folded_into_fused_adamw_equals_the_in_place_clip(dtype):
    _compare_fused_and_foreach(dtype, "gloo")


@pytest.mark.gpu(count=1)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_clipping_folded_into_fused_adamw_equals_the_in_place_clip_on_cuda(dtype):
    _compare_fused_and_foreach(dtype, "nccl")


def _compare_fused_and_foreach(dtype: str, backend: str) -> None:
    # One step: the two differ by the rounding of g * c against g / (1 / c), and AdamW amplifies last-bit
    # differences in gradients that nearly cancel (later steps' gradients depend on the updated weights).
    # AdamW's update is invariant to the gradient's scale, so the masters alone cannot show the clip: the
    # second moments (scaled by c^2) and the clipped gradients can.
    plain = run_distributed(_ddp_steps, 1, False, dtype, 0.05, 1, backend=backend)[0]
    fused = run_distributed(_ddp_steps, 1, True, dtype, 0.05, 1, backend=backend)[0]
    masters_p, moments_p, clipped_p, norms_p, params_p = plain
    masters_f, moments_f, clipped_f, norms_f, params_f = fused
    assert all(n > 0.05 for n in norms_p), "the test must clip every step"
    tol = dict(rtol=1e-5, atol=1e-8)  # masters ~0.02, AdamW moves them by ~lr = 1e-2 per step
    assert norms_f == pytest.approx(norms_p, rel=1e-5)
    for x, y in zip(masters_f, masters_p):
        torch.testing.assert_close(x, y, **tol)
    for x, y in zip(moments_f, moments_p):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-12)
    torch.testing.assert_close(clipped_f, clipped_p, rtol=1e-5, atol=1e-9)
    for x, y in zip(params_f, params_p):  # the model's (bf16) weights are the masters rounded
        torch.testing.assert_close(x, y, rtol=1e-2 if dtype == "bfloat16" else 1e-5, atol=1e-6)
