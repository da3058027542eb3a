"""Activation recompute modes against no recompute: selective (norms and activation functions), full, and
full for only the first N blocks. Same losses and gradients (eager: bit for bit), and the bytes kept for
backward shrink by exactly what each mode promises, eager and compiled, at TP 1 and 2 with and without SP."""

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.reference import kept_for_backward
from tests.training_utils import train_in_process

S, B = 16, 2


def _model_case(
    arch: dict, sp: bool, compiled: bool, modes: tuple[str, ...] = ("none", "selective", "full", "first 1")
):
    """Per mode: (loss, grads, bytes of the tensors the forward keeps for backward) on this rank."""
    from tpframe.models import BuildContext, build_model
    from tpframe.models.compile import compile_model
    from tpframe.models.config import ModelConfig, ffn_hidden_size
    from tpframe.parallel import initialize_parallel, seed_parallel_rng
    from tpframe.parallel.state import get_parallel_state, is_initialized

    state = get_parallel_state() if is_initialized() else initialize_parallel(tp=torch.distributed.get_world_size())
    cfg = ModelConfig(vocab_size=64, hidden=32, layers=3, heads=4, max_seq_len=S, **arch)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    modes = {
        name: fields
        for name, fields in (
            ("none", {}),
            ("selective", dict(selective_recompute=True)),
            ("full", dict(activation_checkpointing=True)),
            ("first 1", dict(activation_checkpointing=True, recompute_layers=1)),
        )
        if name in modes
    }
    out = {}
    for name, fields in modes.items():
        tracker = seed_parallel_rng(0)
        model = build_model(
            cfg, BuildContext(state.tp_comm, sequence_parallel=sp, rng_tracker=tracker, seed=3, **fields)
        )
        params = frozenset(p.untyped_storage().data_ptr() for p in model.parameters())
        if compiled:
            compile_model(model, fullgraph=True)
        loss, kept_bytes = kept_for_backward(model, ids, labels, besides=params)
        loss.mean().backward()
        out[name] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()}, kept_bytes)
    tp, elem = state.tp, 4
    ffn_out = ffn_hidden_size(cfg) // tp  # the activation's output per rank (SwiGLU: after the gate)
    # per layer: the two norm outputs as their GEMMs take them (all-gathered under SP), the activation's output,
    # and the norms' own statistics (mean and rstd per token for LayerNorm, rstd for RMSNorm; local tokens)
    stats = 2 * (2 if cfg.norm == "layernorm" else 1) * S * B // (tp if sp else 1)
    promised = cfg.layers * ((2 * cfg.hidden + ffn_out) * S * B + stats) * elem
    return {k: v for k, v in out.items()}, promised


@pytest.mark.parametrize("fn", ["gelu", "relu"])
def test_recomputed_output_frees_its_storage_and_gives_the_plain_gradients(fn):
    """gelu: the recomputed memory is handed over; relu keeps its own output for backward, so it is copied back
    instead (handing it over would leave relu's backward reading freed memory). Either way: the plain gradients."""
    from tpframe.parallel.recompute import RecomputedOutput

    f = {"gelu": torch.nn.functional.gelu, "relu": torch.relu}[fn]
    torch.manual_seed(0)
    w, x0 = torch.randn(6, 5, requires_grad=True), torch.randn(4, 5)
    x = x0.clone().requires_grad_()
    (torch.nn.functional.linear(f(x), w) ** 2).sum().backward()
    want = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    held = RecomputedOutput(f, x)
    y = torch.nn.functional.linear(held.output, w)  # saves held.output for the weight gradient
    held.discard(after=y)
    assert held.output.untyped_storage().nbytes() == 0
    (y**2).sum().backward(retain_graph=True)
    assert torch.equal(x.grad, want[0]) and torch.equal(w.grad, want[1])
    with pytest.raises(RuntimeError, match="one backward per forward"):
        (y**2).sum().backward()


GPT = dict()
LLAMA = dict(norm="rmsnorm", position="rotary", activation="swiglu", bias=False, kv_heads=2, tie_embeddings=False)


def _check(results, promised, case, exact):
    (ref_loss, ref_grads, ref_bytes) = results["none"]
    for name, (loss, grads, _kept) in results.items():
        what = f"{case} {name}"
        if exact:
            assert torch.equal(loss, ref_loss), f"{what}: loss differs"
            for n, gr in grads.items():
                assert torch.equal(gr, ref_grads[n]), f"{what}: grad of {n} differs"
        else:
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-7, msg=f"{what}: loss")
            for n, gr in grads.items():
                torch.testing.assert_close(gr, ref_grads[n], rtol=1e-5, atol=1e-7, msg=f"{what}: grad of {n}")
    saved = ref_bytes - results["selective"][2]
    # LayerNorm and GELU keep exactly the promised tensors; torch's RMSNorm and SwiGLU are several ops each, whose
    # intermediates (x^2, rstd, silu(gate)) selective recompute frees as well
    assert saved == promised if exact else saved >= promised, (
        f"{case}: selective kept {saved} fewer bytes, promised {promised}"
    )
    if "first 1" in results:
        assert results["full"][2] < results["first 1"][2] < results["none"][2], (
            f"{case}: kept bytes full {results['full'][2]}, first 1 {results['first 1'][2]}, none {ref_bytes}"
        )


def _eager_cases():
    report = []
    for arch, sp in ((GPT, False), (GPT, True), (LLAMA, True)):
        if sp and torch.distributed.get_world_size() == 1:
            continue
        results, promised = _model_case(arch, sp, compiled=False)
        case = f"{arch.get('activation', 'gelu')} tp={torch.distributed.get_world_size()} sp={sp}"
        # LayerNorm's backward is one op: same bits. torch's RMSNorm is several, so the recomputed graph adds the
        # input gradient's three terms in another order than the residual's buffer does: ~1e-8 apart.
        _check(results, promised, case, exact=arch is GPT)
        report.append(case)
    return report


@pytest.mark.parametrize("tp", [1, 2])
def test_recompute_modes_match_no_recompute_and_keep_what_they_promise(tp):
    run_distributed(_eager_cases, tp, timeout=300)


def _compiled_case():
    results, promised = _model_case(LLAMA, True, compiled=True, modes=("none", "selective"))
    _check(results, promised, "compiled swiglu tp=2 sp", exact=False)
    eager, _ = _model_case(LLAMA, True, compiled=False)
    torch.testing.assert_close(results["selective"][0], eager["none"][0], rtol=1e-5, atol=1e-6)
    return True


@pytest.mark.slow
def test_compiled_selective_recompute_keeps_what_eager_does_at_tp2_sp():
    run_distributed(_compiled_case, 2, timeout=400)


def _user_model_case():
    results, _ = _model_case(
        dict(LLAMA, name="examples.parallel_llama:build"), True, compiled=False, modes=("none", "full", "first 1")
    )
    (loss, _grads, none), full, first = results["none"], results["full"][2], results["first 1"][2]
    for name in ("full", "first 1"):
        torch.testing.assert_close(results[name][0], loss, rtol=1e-6, atol=0)
    assert full < first < none, f"examples/parallel_llama.py must honour recompute_layers: {full}, {first}, {none}"
    return True


def test_the_user_model_example_honours_recompute_layers():
    run_distributed(_user_model_case, 2, timeout=300)


def _train(tmp: str):
    common = [
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "model.dropout=0.1",
        "model.attention_dropout=0.1",
        "train.steps=4",
    ]
    runs = {
        "none": [],
        "selective": ["parallel.activation_checkpointing=selective"],
        "full, first 1": ["parallel.activation_checkpointing=full", "parallel.recompute_layers=1"],
    }
    return {
        name: [r["loss"] for r in train_in_process([*common, *extra, f"train.run_dir={tmp}/{i}"])]
        for i, (name, extra) in enumerate(runs.items())
    }


def test_train_py_recompute_modes_change_no_bit_with_dropout_at_tp2_sp(tmp_path):
    losses = run_distributed(_train, 2, str(tmp_path), timeout=300)[0]
    assert losses["selective"] == losses["none"], losses
    assert losses["full, first 1"] == losses["none"], losses


def _pipeline_and_fsdp(tmp: str):
    out = {}
    pp = ["parallel.pp=2", "parallel.tp=1", "model.layers=4", "train.steps=3"]
    for layout, common in (
        ("pp=2", pp),
        ("pp=2 zb_h1", [*pp, "parallel.pp_schedule=zb_h1"]),
        ("fsdp dp=2", ["parallel.tp=1", "parallel.dp_strategy=fsdp", "train.steps=3"]),
    ):
        out[layout] = [
            [r["loss"] for r in train_in_process([*common, *extra, f"train.run_dir={tmp}/{layout}{i}"])]
            for i, extra in enumerate(([], ["parallel.activation_checkpointing=selective"]))
        ]
    return out


def test_selective_recompute_in_a_pipeline_and_under_fsdp_changes_no_bit(tmp_path):
    """Zero-bubble defers the weight gradients that read the refilled outputs; FSDP2 unshards a block's params
    before its backward, so the recomputed norms see the whole weights."""
    results = run_distributed(_pipeline_and_fsdp, 2, str(tmp_path), timeout=300)[-1]  # the last stage logs the loss
    for layout, (off, on) in results.items():
        assert on == off, f"{layout}: {on} vs {off}"


def _cuda_case(compiled: bool):
    """bf16 on one GPU with the Triton norms: per mode (loss, grads, peak bytes of the forward)."""
    from tpframe.models import BuildContext, build_model
    from tpframe.models.compile import compile_model
    from tpframe.models.config import ModelConfig
    from tpframe.parallel import initialize_parallel, seed_parallel_rng

    state = initialize_parallel(tp=1)
    cfg = ModelConfig(vocab_size=512, hidden=256, layers=4, heads=4, max_seq_len=512, position="rotary")
    g = torch.Generator(device="cuda").manual_seed(5)
    ids = torch.randint(0, cfg.vocab_size, (4, 512), device="cuda", generator=g)
    out = {}
    for name in ("none", "selective"):
        tracker = seed_parallel_rng(0)
        model = build_model(
            cfg,
            BuildContext(
                state.tp_comm,
                rng_tracker=tracker,
                seed=3,
                dtype=torch.bfloat16,
                device=state.device,
                selective_recompute=name == "selective",
            ),
        )
        if compiled:
            compile_model(model, fullgraph=True)
            model(ids, ids).mean().backward()  # compile outside the measured step
            model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = model(ids, ids)
        kept = torch.cuda.memory_allocated() - base  # what the forward left for backward
        loss.mean().backward()
        out[name] = (loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}, kept)
    return out


@pytest.mark.gpu(count=1)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_selective_recompute_on_cuda_keeps_less_and_changes_nothing(compiled):
    out = run_distributed(_cuda_case, 1, compiled, backend="nccl", timeout=400)[0]
    (loss0, grads0, kept0), (loss1, grads1, kept1) = out["none"], out["selective"]
    tokens, hidden, layers = 4 * 512, 256, 4
    promised = layers * (2 * hidden + 4 * hidden) * tokens * 2  # two norm outputs and GELU's, bf16
    assert kept0 - kept1 >= 0.9 * promised, f"selective kept {kept0 - kept1} fewer bytes, promised {promised}"
    if compiled:  # Inductor may fuse the recomputed norms differently: bf16 rounding
        torch.testing.assert_close(loss1, loss0, rtol=1e-2, atol=1e-2)
        for n, g in grads1.items():
            torch.testing.assert_close(g, grads0[n], rtol=5e-2, atol=2e-3, msg=f"grad of {n}")
    else:  # the same kernels in the same order: the same bits
        assert torch.equal(loss1, loss0)
        assert all(torch.equal(g, grads0[n]) for n, g in grads1.items())
