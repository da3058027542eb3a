"""The performance paths on GPUs, each against the plain path it replaces: the Triton rotary and cross-entropy
kernels against their torch twins, async-TP layers against the plain SP layers at TP=2, and the compiled /
fused / async-TP GPT against the plain eager GPT (loss and gradients within bf16 tolerance).

Tolerances: fp32 kernels 1e-5 relative; bf16 outputs compared by ‖got - ref‖ / ‖ref‖ against an fp64
reference, where the fused kernel (fp32 inside, one rounding) must be at least as close as eager bf16;
whole-model bf16 variants: loss within 1e-2 relative, gradient norms within 3e-2 of the plain eager model.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.reference import rel_err


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_rotary_matches_the_torch_path(dtype):
    from tpframe.kernels.rotary import qkv_rotary
    from tpframe.layers.attention import RotaryEmbedding, split_heads

    torch.manual_seed(0)
    # per_row: a table row per sequence ([s, b, 1, d]), as generation's left-padded rows use
    for s, b, nq, nkv, d, per_row in (
        (2048, 2, 16, 16, 128, False),
        (37, 3, 8, 2, 64, False),
        (16, 1, 6, 3, 80, False),
        (37, 3, 8, 2, 64, True),
        (1, 8, 16, 16, 128, True),
    ):
        rope = RotaryEmbedding(d, s + 64).cuda()
        positions = torch.stack([torch.arange(s, device="cuda") + 5 * i for i in range(b)])
        cos, sin = rope.at(positions, dtype) if per_row else rope(s, dtype)
        qkv64 = torch.randn(s, b, (nq + 2 * nkv) * d, dtype=torch.float64, device="cuda")
        grads64 = [torch.randn(b, n, s, d, dtype=torch.float64, device="cuda") for n in (nq, nkv, nkv)]
        rope64 = RotaryEmbedding(d, s + 64).cuda().double()
        c64, s64 = rope64.at(positions, torch.float64) if per_row else rope64(s, torch.float64)
        ref = [t.contiguous() for t in split_heads(qkv64, nq, nkv, d, (c64, s64), fused=False)]
        x = qkv64.to(dtype).requires_grad_()
        ref_grad = torch.autograd.grad(
            split_heads(qkv64.requires_grad_(), nq, nkv, d, (c64, s64), fused=False), qkv64, grads64
        )[0]
        outs = {}
        torch._dynamo.reset()
        compiled = torch.compile(lambda t: split_heads(t, nq, nkv, d, (cos, sin)), fullgraph=True)
        compiled_tm = torch.compile(lambda t: split_heads(t, nq, nkv, d, (cos, sin), token_major=True), fullgraph=True)
        token_major = lambda g: g.transpose(1, 2).contiguous().transpose(1, 2)  # noqa: E731 (varlen's gradients)
        for name, fn in (
            ("eager", lambda: split_heads(x, nq, nkv, d, (cos, sin), fused=False)),
            ("fused", lambda: qkv_rotary(x, cos, sin, nq, nkv, d)),
            ("compiled", lambda: compiled(x)),  # the kernels as the custom op tpframe::qkv_rotary
            ("fused token-major", lambda: qkv_rotary(x, cos, sin, nq, nkv, d, token_major=True)),
            ("compiled token-major", lambda: compiled_tm(x)),
        ):
            out = fn()
            if "token-major" in name:
                assert all(o.transpose(1, 2).is_contiguous() for o in out), name
            grads = [g.to(dtype) for g in grads64]
            grad = torch.autograd.grad(out, x, [token_major(g) for g in grads] if "token" in name else grads)[0]
            outs[name] = ([rel_err(o, r) for o, r in zip(out, ref)], rel_err(grad, ref_grad))
        case = f"s={s} b={b} nq={nq} nkv={nkv} d={d} per_row={per_row} {dtype}"
        (fwd_e, bwd_e) = outs["eager"]
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        for name in ("fused", "compiled", "fused token-major", "compiled token-major"):
            fwd_f, bwd_f = outs[name]
            assert max(fwd_f) <= max(tol, 1.01 * max(fwd_e)), f"{case}: {name} forward errors {fwd_f} vs eager {fwd_e}"
            assert bwd_f <= max(tol, 1.01 * bwd_e), f"{case}: {name} backward error {bwd_f} vs eager {bwd_e}"
        if s < 100:  # the op's registration (schema, fake, autograd) checked by torch itself
            for token_major in (False, True):
                torch.library.opcheck(
                    torch.ops.tpframe.qkv_rotary, (x.detach().requires_grad_(), cos, sin, nq, nkv, d, token_major)
                )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_rotary_with_qk_norms_matches_the_torch_path(dtype):
    """Qwen3's query and key RMSNorms in the split + rotary kernel (eager; compiled, split_heads leaves them to
    Inductor): q, k, v and the gradients of qkv and both norm weights against an fp64 torch reference, at least as
    close as eager torch in the same dtype."""
    from tpframe.kernels.rotary import qkv_rotary
    from tpframe.layers.attention import RotaryEmbedding, split_heads
    from tpframe.layers.norm import RMSNorm

    torch.manual_seed(0)
    for s, b, nq, nkv, d, per_row in (
        (2048, 2, 16, 8, 128, False),
        (37, 3, 8, 2, 64, False),
        (16, 2, 6, 3, 48, False),
        (1, 8, 16, 8, 128, True),
    ):
        positions = torch.stack([torch.arange(s, device="cuda") + 5 * i for i in range(b)])
        tables = {}
        for t in (dtype, torch.float64):
            rope = RotaryEmbedding(d, s + 64).cuda().to(t)
            tables[t] = rope.at(positions, t) if per_row else rope(s, t)
        w64 = [torch.randn(d, dtype=torch.float64, device="cuda") * 0.5 + 1 for _ in "qk"]
        qkv64 = torch.randn(s, b, (nq + 2 * nkv) * d, dtype=torch.float64, device="cuda") * 2
        grads64 = [torch.randn(b, n, s, d, dtype=torch.float64, device="cuda") for n in (nq, nkv, nkv)]

        def norms(t):
            out = [RMSNorm(d, 1e-6, dtype=t, device="cuda") for _ in "qk"]
            with torch.no_grad():
                for n, w in zip(out, w64):
                    n.weight.copy_(w)
            return out

        ref_norms = norms(torch.float64)
        x64 = qkv64.clone().requires_grad_()
        ref = [
            t.contiguous() for t in split_heads(x64, nq, nkv, d, tables[torch.float64], fused=False, qk_norm=ref_norms)
        ]
        ref_grads = torch.autograd.grad(ref, [x64, *(n.weight for n in ref_norms)], grads64)
        mine = norms(dtype)
        x = qkv64.to(dtype).requires_grad_()
        cos, sin = tables[dtype]
        weights = (mine[0].weight, mine[1].weight, 1e-6)
        torch._dynamo.reset()
        compiled = torch.compile(lambda t: split_heads(t, nq, nkv, d, (cos, sin), qk_norm=mine), fullgraph=True)
        results = {}
        for name, fn in (
            ("eager", lambda: split_heads(x, nq, nkv, d, (cos, sin), fused=False, qk_norm=mine)),
            ("fused", lambda: qkv_rotary(x, cos, sin, nq, nkv, d, norm=weights)),
            ("fused token-major", lambda: qkv_rotary(x, cos, sin, nq, nkv, d, token_major=True, norm=weights)),
            ("compiled", lambda: compiled(x)),
        ):
            out = fn()
            if name == "fused token-major":
                assert all(o.transpose(1, 2).is_contiguous() for o in out), name
            grads = torch.autograd.grad(out, [x, *(n.weight for n in mine)], [g.to(dtype) for g in grads64])
            results[name] = (
                [rel_err(o, r) for o, r in zip(out, ref)],
                [rel_err(g, r) for g, r in zip(grads, ref_grads)],
            )
        case = f"s={s} b={b} nq={nq} nkv={nkv} d={d} per_row={per_row} {dtype}"
        fwd_e, bwd_e = results["eager"]
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        for name in ("fused", "fused token-major", "compiled"):
            fwd, bwd = results[name]
            assert max(fwd) <= max(tol, 1.01 * max(fwd_e)), f"{case}: {name} forward errors {fwd} vs eager {fwd_e}"
            for what, got, eager in zip(("qkv", "q_norm.weight", "k_norm.weight"), bwd, bwd_e):
                assert got <= max(tol, 1.01 * eager), f"{case}: {name} gradient of {what}: {got} vs eager {eager}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_kernel_matches_sdpa(dtype):
    """The decode-attention kernel (eager and as the custom op under torch.compile) against SDPA with the cache
    mask, both measured against an fp64 SDPA: one split, several (the merge kernel), grouped-query heads (their own
    kernel, two tl.dot per tile), masked leading slots."""
    import torch.nn.functional as F

    from tests.test_decode_attention_interpreter import cache_case
    from tpframe.kernels.decode_attention import decode_attention, launch_plan

    for b, nq, nkv, s, slots, d in (
        (1, 16, 16, 1, 256, 128),
        (8, 8, 8, 1, 256, 128),
        (2, 32, 4, 1, 4096, 128),
        (3, 6, 2, 2, 144, 64),
        (1, 4, 4, 1, 16, 80),
    ):
        q, k, v, mask = cache_case(b, nq, nkv, s, slots, d, dtype=torch.float64, device="cuda")
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=nkv != nq)
        q, k, v, mask = (t.to(dtype) for t in (q, k, v, mask))
        torch._dynamo.reset()
        compiled = torch.compile(decode_attention, fullgraph=True)
        sdpa = rel_err(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=nkv != nq), ref)
        case = f"b={b} nq={nq} nkv={nkv} s={s} L={slots} d={d} splits={launch_plan(b, nq, nkv, s, slots)[2]} {dtype}"
        for name, out in (("kernel", decode_attention(q, k, v, mask)), ("compiled", compiled(q, k, v, mask))):
            err = rel_err(out, ref)
            bound = max(1e-5 if dtype == torch.float32 else 1e-2, 1.01 * sdpa)
            assert err <= bound, f"{case}: {name} {err} vs sdpa {sdpa}"
    torch.library.opcheck(torch.ops.tpframe.decode_attention, (q, k, v, mask))


@pytest.mark.gpu
def test_triton_cross_entropy_kernels_match_the_torch_path():
    from tpframe.kernels.cross_entropy import logits_grad_, row_stats

    torch.manual_seed(1)
    for n, v, n_valid, dtype in (
        (1000, 25152, 25100, torch.bfloat16),
        (77, 5000, 5000, torch.float32),
        (33, 300, 0, torch.bfloat16),
    ):
        logits = (torch.randn(n, v, device="cuda") * 3).to(dtype)
        target = torch.randint(-1, max(n_valid, 1), (n,), device="cuda")
        if n_valid == 0:
            target.fill_(-1)
        got = row_stats(logits, target, n_valid, triton=True)
        want = row_stats(logits, target, n_valid, chunk=64, triton=False)
        finite = torch.isfinite(want)
        assert torch.equal(finite, torch.isfinite(got)), f"n={n} v={v}: non-finite stats differ"
        assert rel_err(got[finite], want[finite]) <= 1e-5, f"n={n} v={v} valid={n_valid}: row stats"
        log_z = torch.randn(n, device="cuda") + 10
        scale = torch.rand(n, device="cuda")
        for smoothing in (0.0, 0.1):
            args = (target, log_z, scale, n_valid, smoothing, max(n_valid, 1))
            a = logits_grad_(logits.clone(), *args, triton=True)
            b = logits_grad_(logits.clone(), *args, chunk=64, triton=False)
            tol = 1e-5 if dtype == torch.float32 else 8e-3
            assert rel_err(a, b) <= tol, f"n={n} v={v} smoothing={smoothing}: logits gradient"


def _async_tp_layers_match_plain():
    from tests.reference import scatter_to_sp
    from tpframe.comm import Communicator
    from tpframe.layers import ColumnParallelLinear, RowParallelLinear
    from tpframe.layers.async_tp import async_tp_available
    from tpframe.layers.mode import LayerMode

    comm = Communicator(backend="auto")
    s, b, h, f = 1024, 2, 1024, 4096

    def pair(mode):  # the same weights in every mode
        torch.manual_seed(0)
        kw = dict(sequence_parallel=True, comm=comm, dtype=torch.bfloat16, mode=LayerMode(async_tp=mode))
        return ColumnParallelLinear(h, f, **kw), RowParallelLinear(f, h, **kw)

    g = torch.Generator(device="cuda").manual_seed(3)
    x_full = torch.randn(s, b, h, device="cuda", generator=g).bfloat16()
    grad = torch.randn(s // comm.size, b, h, device="cuda", generator=g).bfloat16()
    x0 = scatter_to_sp(x_full, comm)
    assert async_tp_available(comm, x0), "the copy-engine transport must be set up for this test"
    layers = {mode: pair(mode) for mode in (None, "copy_engine")}
    results = []
    # copy_engine twice: the second call reuses its slots
    for async_tp in (None, "copy_engine", "copy_engine"):
        fc1, fc2 = layers[async_tp]
        x = x0.clone().requires_grad_()
        for p in (*fc1.parameters(), *fc2.parameters()):
            p.grad = None
        y = fc2(torch.nn.functional.gelu(fc1(x)))
        y.backward(grad)
        results.append([y.float(), x.grad.float()] + [p.grad.float() for p in (*fc1.parameters(), *fc2.parameters())])
    errors = [[rel_err(a, b) for a, b in zip(r, results[0])] for r in results[1:]]
    comm.close()
    return errors


@pytest.mark.gpu(count=2)
def test_async_tp_layers_match_the_plain_sp_layers_at_tp2():
    for rank_errors in run_distributed(
        _async_tp_layers_match_plain,
        2,
        backend="nccl",
        env={"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0"},
    ):
        for errors in rank_errors:
            # bf16: the pipelined GEMM chunks round and sum in another order than one GEMM + NCCL
            assert max(errors) <= 1e-2, (
                f"async TP (copy_engine x2) vs plain (y, grad x, grads fc1.w fc1.b fc2.w fc2.b): {errors}"
            )


def _gpt_variants_agree(variants):
    from tpframe.layers.mode import LayerMode
    from tpframe.models import BuildContext, build_model
    from tpframe.models.compile import compile_model
    from tpframe.models.config import ModelConfig
    from tpframe.parallel import initialize_parallel, seed_parallel_rng

    state = initialize_parallel(tp=torch.distributed.get_world_size())
    cfg = ModelConfig(
        vocab_size=1000,
        hidden=256,
        layers=2,
        heads=8,
        kv_heads=4,
        max_seq_len=256,
        position="rotary",
        vocab_multiple=128,
    )
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (4, 256), device="cuda", generator=g)
    out = {}
    for name, (fused, compiled, async_tp) in variants.items():
        tracker = seed_parallel_rng(0)
        ctx = BuildContext(
            state.tp_comm,
            sequence_parallel=True,
            rng_tracker=tracker,
            dtype=torch.bfloat16,
            seed=4,
            mode=LayerMode(fused_kernels=fused, async_tp=async_tp),
        )
        model = build_model(cfg, ctx)
        if compiled:
            compile_model(model, fullgraph=True)
        loss = model(ids, ids.roll(-1, 1))
        loss.mean().backward()
        out[name] = (loss.float().mean().item(), [p.grad.float() for p in model.parameters()])
    base_loss, base_grads = out["plain eager"]
    report = {}
    for name, (loss, grads) in out.items():
        report[name] = (abs(loss - base_loss) / base_loss, max(rel_err(a, b) for a, b in zip(grads, base_grads)))
    return report


@pytest.mark.gpu(count=2)
def test_compiled_fused_and_async_tp_gpt_match_plain_eager_at_tp2():
    variants = {
        "plain eager": (False, False, False),
        "fused": (True, False, False),  # (fused, compiled, async TP)
        "fused + async TP copy_engine": (True, False, "copy_engine"),
        "compiled": (True, True, False),
        "compiled + async TP copy_engine": (True, True, "copy_engine"),
    }
    report = run_distributed(
        _gpt_variants_agree,
        2,
        variants,
        backend="nccl",
        timeout=600,
        env={"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0"},
    )[0]
    for name, (loss_err, grad_err) in report.items():
        assert loss_err <= 1e-2 and grad_err <= 3e-2, f"{name}: loss rel err {loss_err:.2e}, worst grad {grad_err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_kernels_match_torch_on_cuda(dtype):
    """LayerNorm (with and without bias) and RMSNorm, forward and all gradients, against fp64 torch: no worse than
    torch's own kernels in the same dtype, at training shapes (rows past the backward's program count) and odd
    widths."""
    import torch.nn.functional as F

    from tpframe.kernels.norm import _Norm, fused_norm_applies

    torch.manual_seed(0)
    for shape, rms, bias in (
        ((2048, 4, 768), False, True),
        ((1000, 2048), False, False),
        ((512, 3, 4096), True, False),
        ((7, 5, 1000), True, False),
        ((3, 1, 16384), False, True),
    ):
        h = shape[-1]
        x64 = torch.randn(shape, device="cuda", dtype=torch.float64)
        w64 = 1 + 0.1 * torch.randn(h, device="cuda", dtype=torch.float64)
        b64 = 0.1 * torch.randn(h, device="cuda", dtype=torch.float64) if bias else None
        dy64 = torch.randn(shape, device="cuda", dtype=torch.float64)

        def run(fn, x, w, b, dy):
            x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
            b = b.detach().requires_grad_() if b is not None else None
            y = fn(x, w, b)
            return [y, *torch.autograd.grad(y, [t for t in (x, w, b) if t is not None], dy)]

        def torch_norm(x, w, b):
            return F.rms_norm(x, (h,), w, 1e-5) if rms else F.layer_norm(x, (h,), w, b, 1e-5)

        ref = run(torch_norm, x64, w64, b64, dy64)
        low = [t.to(dtype) if t is not None else None for t in (x64, w64, b64, dy64)]
        assert fused_norm_applies(low[0], low[1])
        eager = run(torch_norm, *low)
        ours = run(lambda x, w, b: _Norm.apply(x, w, b, 1e-5, rms), *low)
        for name, o, e, r in zip(("y", "dx", "dw", "db"), ours, eager, ref):
            err, base = rel_err(o, r), rel_err(e, r)
            bound = max(1e-5 if dtype == torch.float32 else 1e-2, 1.5 * base)
            assert err <= bound, f"shape={shape} rms={rms} bias={bias} {dtype} {name}: {err} vs torch {base}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_linear_kernel_matches_cublas_and_runs_only_in_decode_graphs(dtype):
    """The one-row kernel against fp64 (no worse than cuBLAS in the same dtype) at decode shapes, with the MLP's
    activation in the kernel (no worse than torch's GEMM + activation), and the layers' dispatch: a one-row input under
    no_grad inside a CUDA-graph capture takes it; two rows, eager calls or autograd do not."""
    from unittest import mock

    from tpframe.kernels import gemv
    from tpframe.layers.linear import local_linear

    g = torch.Generator(device="cuda").manual_seed(7)
    for n, k, bias in ((6144, 2048, True), (2048, 5504, False), (50304, 2048, False), (1000, 100, True)):
        x64 = torch.randn(1, 1, k, device="cuda", dtype=torch.float64, generator=g)
        w64 = torch.randn(n, k, device="cuda", dtype=torch.float64, generator=g) / k**0.5
        b64 = torch.randn(n, device="cuda", dtype=torch.float64, generator=g) if bias else None
        ref = torch.nn.functional.linear(x64, w64, b64)
        x, w, b = (t.to(dtype) if t is not None else None for t in (x64, w64, b64))
        cublas = rel_err(torch.nn.functional.linear(x, w, b), ref)
        ours = rel_err(gemv.row_linear(x, w, b), ref)
        assert ours <= max(1e-6 if dtype == torch.float32 else 1e-2, 1.01 * cublas), (n, k, ours, cublas)
    acts = {
        "swiglu": lambda h: torch.nn.functional.silu(h.chunk(2, -1)[0]) * h.chunk(2, -1)[1],
        "gelu": lambda h: torch.nn.functional.gelu(h, approximate="tanh"),
    }
    for name, act in acts.items():  # the MLP's activation inside the kernel, against torch's GEMM + activation
        x64 = torch.randn(1, 2048, device="cuda", dtype=torch.float64, generator=g)
        w64 = torch.randn(11008, 2048, device="cuda", dtype=torch.float64, generator=g) / 2048**0.5
        b64 = torch.randn(11008, device="cuda", dtype=torch.float64, generator=g)
        ref = act(torch.nn.functional.linear(x64, w64, b64))
        x, w, b = (t.to(dtype) for t in (x64, w64, b64))
        eager = rel_err(act(torch.nn.functional.linear(x, w, b)), ref)
        ours = rel_err(gemv.row_linear(x, w, b, activation=name), ref)
        assert ours <= max(1e-6 if dtype == torch.float32 else 1e-2, 1.01 * eager), (name, ours, eager)

    w = torch.randn(256, 128, device="cuda", dtype=dtype, generator=g)
    calls = []
    real = gemv.row_linear

    def counted(*args):
        calls.append(args[0].shape)
        return real(*args)

    def captured(x):
        out = {}
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            local_linear(x, w)  # warm-up outside the capture (Triton compiles here)
            with torch.cuda.graph(graph):
                out["y"] = local_linear(x, w)
        torch.cuda.current_stream().wait_stream(side)
        graph.replay()
        torch.cuda.synchronize()
        return out["y"]

    with mock.patch.object(gemv, "row_linear", counted):
        one, two = (torch.randn(rows, 1, 128, device="cuda", dtype=dtype, generator=g) for rows in (1, 2))
        y = captured(one)
        assert calls == [(1, 1, 128)], f"one row in a capture must take the kernel: {calls}"
        assert rel_err(y, torch.nn.functional.linear(one, w)) <= (1e-5 if dtype == torch.float32 else 1e-2)
        calls.clear()
        captured(two)
        with torch.no_grad():
            local_linear(one, w)
        local_linear(one.requires_grad_(), w)
        assert calls == [], f"two rows, eager calls and autograd keep cuBLAS: {calls}"


@pytest.mark.gpu
def test_kv_write_kernel_runs_in_decode_graphs_and_writes_what_index_copy_writes():
    """LayerCache.append inside a CUDA-graph capture takes the one-launch kernel and leaves the caches exactly as
    torch's index_copy_ does; an eager append keeps index_copy_."""
    from unittest import mock

    from tpframe.inference.kv_cache import KVCache
    from tpframe.kernels import kv_write

    g = torch.Generator(device="cuda").manual_seed(3)
    cache = KVCache(["0"], batch=2, kv_heads=4, head_dim=128, max_len=64, dtype=torch.bfloat16, device="cuda")
    cache.reset(torch.zeros(2, dtype=torch.long, device="cuda"))
    cache.advance(9)
    cache.begin(1)
    layer = cache.layer(0)
    layer.k.normal_(generator=g)
    layer.v.normal_(generator=g)
    k, v = (torch.randn(2, 4, 1, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    want_k = layer.k.clone().index_copy_(2, cache.index, k)
    want_v = layer.v.clone().index_copy_(2, cache.index, v)
    calls = []
    real = kv_write.kv_write

    def counted(*args):
        calls.append(args[0].shape)
        return real(*args)

    with mock.patch.object(kv_write, "kv_write", counted):
        layer.append(k, v)  # eager: index_copy_
        assert calls == [], "an eager append must keep index_copy_"
        layer.k.normal_(generator=g)
        layer.v.normal_(generator=g)
        kv_write.kv_write(k, v, layer.k, layer.v, cache.index)  # compile the kernel outside the capture
        graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.cuda.graph(graph):
            layer.append(k, v)
        torch.cuda.current_stream().wait_stream(side)
        layer.k.normal_(generator=g)
        layer.v.normal_(generator=g)
        untouched = layer.k.clone()
        graph.replay()
        torch.cuda.synchronize()
    assert len(calls) == 2, "the captured append must take the kernel"
    slot = int(cache.index)
    assert torch.equal(layer.k[:, :, slot], want_k[:, :, slot]) and torch.equal(layer.v[:, :, slot], want_v[:, :, slot])
    others = [t for t in range(64) if t != slot]
    assert torch.equal(layer.k[:, :, others], untouched[:, :, others]), "only the step's slot may change"
