"""Sliding-window attention (model.sliding_window): each query over itself and the window-1 tokens before it.

References: an explicit per-query loop in float64 for the attention function (dense rows and packed documents), and
tests/reference_gpt.py (plain batch-first torch, its own band mask) for the whole GPT at TP 1, 2 and 4. Generation's
KV cache with a window is checked against recomputing each sequence in tests/test_generation.py; Hugging Face's
windowed models against transformers in tests/test_hf.py.
"""

import dataclasses
import math

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.reference import assert_close
from tests.reference_gpt import assert_matches_reference
from tests.training_utils import train_in_process
from tpframe.layers.documents import Documents, document_attention
from tpframe.layers.sliding_window import sliding_window_attention
from tpframe.models.config import ModelConfig


def loop_attention(q, k, v, window, doc_ids=None):
    """Query by query: softmax over the keys j with 0 <= i - j < window (and j in i's document), GQA by repeat."""
    b, nq, s, d = q.shape
    k, v = (t.repeat_interleave(nq // t.shape[1], dim=1) for t in (k, v))
    out = torch.zeros_like(q)
    for row in range(b):
        for i in range(s):
            keys = [
                j for j in range(max(0, i - window + 1), i + 1) if doc_ids is None or doc_ids[row, j] == doc_ids[row, i]
            ]
            scores = q[row, :, i, None, :] @ k[row][:, keys].transpose(-1, -2) / math.sqrt(d)  # [nq, 1, keys]
            out[row, :, i] = (scores.softmax(-1) @ v[row][:, keys])[:, 0]
    return out


@pytest.mark.parametrize("window", [1, 3, 12, 40])
@pytest.mark.parametrize("nq,nkv", [(4, 4), (4, 2)])
def test_window_attention_equals_a_per_query_loop(window, nq, nkv):
    g = torch.Generator().manual_seed(window)
    q, k, v = (torch.randn(2, n, 12, 8, generator=g, dtype=torch.float64, requires_grad=True) for n in (nq, nkv, nkv))
    out = sliding_window_attention(q, k, v, window, enable_gqa=nq != nkv)
    ref = loop_attention(q, k, v, window)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    assert_close(out, ref, 1e-12, f"window {window}: output")
    for name, got, want in zip("qkv", grads, ref_grads):
        assert_close(got, want, 1e-12, f"window {window}: grad of {name}")
    causal = loop_attention(q, k, v, 12)
    assert (window >= 12) == torch.allclose(out, causal), "a window shorter than the row must change the output"


@pytest.mark.parametrize("window", [2, 5])
def test_window_inside_packed_documents_equals_a_per_query_loop(window):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 9, (2, 14), generator=g)
    ids[0, 3], ids[0, 11], ids[1, 8] = 0, 0, 0  # documents of 4, 8 and 2 tokens; of 9 and 5
    docs = Documents.from_tokens(ids, 0, varlen=False)
    q, k, v = (torch.randn(2, 4, 14, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = document_attention(q, k, v, docs, window=window)
    ref = loop_attention(q, k, v, window, docs.ids)
    assert_close(out, ref, 1e-12, f"window {window} in documents")
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    for name, got, want in zip(
        "qkv", torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)
    ):
        assert_close(got, want, 1e-12, f"window {window} in documents: grad of {name}")


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("window", [3, 7, 40])
def test_each_context_parallel_rank_attends_within_the_window(size, window):
    """Every CP rank's two chunks over the whole sequence's keys (`attend_local_chunks`, what CP attention runs after
    its all-gather) equal those rows of the per-query loop, gradients included."""
    from tpframe.layers.context import attend_local_chunks, local_positions, shard_sequence

    g = torch.Generator().manual_seed(size * window)
    q, k, v = (torch.randn(2, n, 16, 8, generator=g, dtype=torch.float64, requires_grad=True) for n in (4, 2, 2))
    ref = loop_attention(q, k, v, window)
    dout = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for rank in range(size):
        rows = local_positions(16 // size, rank=rank, size=size)
        mine = shard_sequence(q, dim=2, rank=rank, size=size)
        out = attend_local_chunks(mine, k, v, rank=rank, size=size, enable_gqa=True, window=window)
        assert_close(out, ref[:, :, rows], 1e-12, f"cp={size} rank {rank}, window {window}")
        for acc, gr in zip(grads, torch.autograd.grad(out, (q, k, v), dout[:, :, rows])):
            acc += gr
    for name, got, want in zip("qkv", grads, ref_grads):
        assert_close(got, want, 1e-12, f"cp={size}, window {window}: grad of {name} summed over the ranks")


GPT_CFG = ModelConfig(vocab_size=101, hidden=32, layers=2, heads=4, max_seq_len=16, vocab_multiple=8, sliding_window=5)
LLAMA_CFG = dataclasses.replace(
    GPT_CFG,
    hidden=64,
    heads=8,
    kv_heads=4,
    norm="rmsnorm",
    position="rotary",
    activation="swiglu",
    bias=False,
    tie_embeddings=False,
)


def _windowed_gpt_vs_reference(cfg: ModelConfig, sp: bool):
    from tpframe.models import BuildContext, build_model
    from tpframe.parallel import initialize_parallel, seed_parallel_rng

    state = initialize_parallel(tp=torch.distributed.get_world_size())
    ctx = lambda: BuildContext(state.tp_comm, sequence_parallel=sp, rng_tracker=seed_parallel_rng(0), seed=11)  # noqa: E731
    model = build_model(cfg, ctx())
    g = torch.Generator().manual_seed(3)
    ids, labels = torch.randint(0, 101, (3, 16), generator=g), torch.randint(0, 101, (3, 16), generator=g)
    loss, _ = assert_matches_reference(cfg, model, ids, labels, state.tp_comm, f"{cfg.position} tp={state.tp} sp={sp}")
    with torch.no_grad():  # the window matters: full causal attention computes something else
        causal = build_model(dataclasses.replace(cfg, sliding_window=None), ctx())(ids, labels)
    return float((causal - loss.detach()).abs().max())


@pytest.mark.parametrize(
    "cfg,tp", [(GPT_CFG, 1), (GPT_CFG, 2), (LLAMA_CFG, 4)], ids=["gpt-tp1", "gpt-tp2-sp", "llama-tp4-sp"]
)
def test_a_windowed_gpt_equals_the_reference_at_every_tp(cfg, tp):
    for differs in run_distributed(_windowed_gpt_vs_reference, tp, cfg, tp > 1):
        assert differs > 1e-3


def build_without_window(cfg, ctx):
    """A user model's builder that leaves model.sliding_window out of its attention (the pre-flight must refuse it)."""
    from tpframe.models import build_gpt

    return build_gpt(dataclasses.replace(cfg, sliding_window=None), ctx)


def _losses(overrides):
    history = train_in_process(["parallel.tp=1", "model.position=rotary", "model.sliding_window=6", *overrides])
    return [r["loss"] for r in history], [r["grad_norm"] for r in history]


@pytest.mark.slow
def test_train_py_trains_a_window_alike_at_tp2_sp_pp2_and_cp2_with_documents(tmp_path):
    """The key reaches every block through train.py: TP=2 + SP, PP=2, CP=2 and CP=2 x TP=2 + SP (with packed
    documents, which narrow the window further) follow one process; without the window the losses differ."""
    docs = ["model.attention_mask=document", "model.eod_id=10"]
    ref, ref_norms = run_distributed(_losses, 1, [*docs, f"train.run_dir={tmp_path}/ref"])[0]
    for i, (name, nproc, extra) in enumerate(
        (
            ("TP=2+SP", 2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
            ("PP=2", 2, ["parallel.pp=2"]),
            ("CP=2", 2, ["parallel.cp=2"]),
            ("CP=2 x TP=2 + SP", 4, ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
        )
    ):
        losses, norms = run_distributed(_losses, nproc, [*docs, *extra, f"train.run_dir={tmp_path}/{i}"])[0]
        for step, (a, b) in enumerate(zip(losses, ref)):
            assert math.isclose(a, b, rel_tol=1e-5), f"{name}: step {step + 1}: {a} vs {b}"
        for step, (a, b) in enumerate(zip(norms, ref_norms)):
            assert math.isclose(a, b, rel_tol=1e-4), f"{name} grad norm: step {step + 1}: {a} vs {b}"
    plain, _ = run_distributed(_losses, 1, [f"train.run_dir={tmp_path}/plain"])[0]  # whole rows: CP's own chunks
    plain_cp, _ = run_distributed(_losses, 2, ["parallel.cp=2", f"train.run_dir={tmp_path}/plain_cp"])[0]
    for step, (a, b) in enumerate(zip(plain_cp, plain)):
        assert math.isclose(a, b, rel_tol=1e-5), f"CP=2 without documents: step {step + 1}: {a} vs {b}"
    full, _ = run_distributed(_losses, 1, [*docs, "model.sliding_window=null", f"train.run_dir={tmp_path}/full"])[0]
    assert abs(full[1] - ref[1]) > 1e-4, "the window must change the computation"


@pytest.mark.slow
def test_compiled_blocks_take_the_window_without_graph_breaks(tmp_path):
    """train.compile=true (aot_eager on the CPU, fullgraph): the band mask traces into each block."""
    from tests.test_perf_paths import _assert_compiled_trains_like_eager, _train_compiled_and_eager

    common = [
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "train.steps=3",
        "model.position=rotary",
        "model.sliding_window=6",
    ]
    losses, compiled_blocks, breaks = run_distributed(
        _train_compiled_and_eager, 2, str(tmp_path), common, [], True, timeout=300
    )[0]
    _assert_compiled_trains_like_eager(losses, compiled_blocks)
    assert breaks == 0


def _gpu_inputs(b, nq, nkv, s, d, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(b, n, s, d, generator=g, device="cuda") for n in (nq, nkv, nkv))
    return q, k, v, torch.randn(b, nq, s, d, generator=g, device="cuda")


def _out_and_grads(fn, q, k, v, dout, dtype):
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    return [out.detach().double(), *(t.double() for t in torch.autograd.grad(out, (q, k, v), dout.to(dtype)))]


@pytest.mark.gpu(count=1)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("nq,nkv,d", [(8, 8, 64), (8, 2, 128)], ids=["mha-64", "gqa-128"])
def test_flex_window_attention_on_gpu_equals_the_band_mask(dtype, nq, nkv, d):
    """flex_attention's block mask (the CUDA path): output and gradients as close to float64 as SDPA with the dense
    band mask in the same dtype; the same under torch.compile and replayed in a CUDA graph."""
    from tpframe.layers.sliding_window import band, flex_usable

    b, s, window = 2, 1024, 200  # a window that does not fall on flex's 128-token blocks
    q, k, v, dout = _gpu_inputs(b, nq, nkv, s, d)
    assert flex_usable(q.to(dtype), 0.0), "flex_attention is missing: the fast path would not run"
    gqa = nq != nkv
    mask = band(s, s, window, device="cuda")

    def dense(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            enable_gqa=gqa,
        )

    flex = lambda q, k, v: sliding_window_attention(q, k, v, window, enable_gqa=gqa)  # noqa: E731
    want = _out_and_grads(dense, q, k, v, dout, torch.float64)
    ref = _out_and_grads(dense, q, k, v, dout, dtype)
    got = _out_and_grads(flex, q, k, v, dout, dtype)
    for what, a, r, w in zip(("out", "dq", "dk", "dv"), got, ref, want):
        err, ref_err = float((a - w).abs().max()), float((r - w).abs().max())
        assert err <= 2 * ref_err + 1e-5, f"{what}: flex error {err:.2e} vs SDPA's {ref_err:.2e}"
    x = [t.to(dtype) for t in (q, k, v)]
    compiled = torch.compile(lambda q, k, v: flex(q, k, v) * 2)(*x)
    assert torch.equal(compiled, flex(*x) * 2), "inside a compiled function: the same kernel, the same numbers"
    static = [t.clone() for t in x]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        flex(*static)  # warm: compiled and the block mask made
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flex(*static)
    fresh = [t * 0.5 for t in x]
    for t, f in zip(static, fresh):
        t.copy_(f)
    graph.replay()
    assert torch.equal(out, flex(*fresh)), "a CUDA graph replay computes what an eager call does"


@pytest.mark.gpu(count=1)
@pytest.mark.parametrize("size", [2, 4])
def test_context_parallel_chunks_through_flex_on_gpu_equal_the_band_mask(size):
    """bf16, every CP rank's chunks over the whole sequence's keys (flex with fewer queries than keys, right-aligned
    block masks): output and gradients as close to float64 as SDPA with the dense band mask in bf16."""
    from tpframe.layers.context import attend_local_chunks, local_positions, shard_sequence
    from tpframe.layers.sliding_window import band

    b, nq, nkv, s, d, window = 2, 8, 2, 2048, 64, 300
    q, k, v, dout = _gpu_inputs(b, nq, nkv, s, d, seed=3)
    mask = band(s, s, window, device="cuda")

    def dense(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            enable_gqa=True,
        )

    def chunks(q, k, v):  # every rank's rows, put back in sequence order
        out = torch.empty_like(q)
        for rank in range(size):
            rows = local_positions(s // size, rank=rank, size=size, device="cuda")
            out[:, :, rows] = attend_local_chunks(
                shard_sequence(q, dim=2, rank=rank, size=size),
                k,
                v,
                rank=rank,
                size=size,
                enable_gqa=True,
                window=window,
            )
        return out

    want = _out_and_grads(dense, q, k, v, dout, torch.float64)
    ref = _out_and_grads(dense, q, k, v, dout, torch.bfloat16)
    got = _out_and_grads(chunks, q, k, v, dout, torch.bfloat16)
    for what, a, r, w in zip(("out", "dq", "dk", "dv"), got, ref, want):
        err, ref_err = float((a - w).abs().max()), float((r - w).abs().max())
        assert err <= 2 * ref_err + 1e-3, f"cp={size} {what}: error {err:.2e} vs bf16 SDPA's {ref_err:.2e}"


@pytest.mark.gpu(count=1)
def test_window_inside_documents_on_gpu_equals_the_dense_mask():
    """bf16 packed documents with a window (varlen's left window where torch's varlen_attn takes one, else the dense
    mask): as close to float64 as bf16 SDPA with the combined mask."""
    from tpframe.layers.sliding_window import band

    b, nq, nkv, s, d, window = 3, 8, 2, 512, 64, 40
    q, k, v, dout = _gpu_inputs(b, nq, nkv, s, d, seed=1)
    g = torch.Generator(device="cuda").manual_seed(2)
    ids = torch.randint(1, 50, (b, s), generator=g, device="cuda")
    ids[torch.rand(b, s, generator=g, device="cuda") < 0.01] = 0  # documents of ~100 tokens
    docs = Documents.from_tokens(ids, 0)
    mask = docs.mask() & band(s, s, window, device="cuda")

    def dense(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            enable_gqa=True,
        )

    want = _out_and_grads(dense, q, k, v, dout, torch.float64)
    ref = _out_and_grads(dense, q, k, v, dout, torch.bfloat16)
    got = _out_and_grads(
        lambda q, k, v: document_attention(q, k, v, docs, enable_gqa=True, window=window), q, k, v, dout, torch.bfloat16
    )
    for what, a, r, w in zip(("out", "dq", "dk", "dv"), got, ref, want):
        err, ref_err = float((a - w).abs().max()), float((r - w).abs().max())
        assert err <= 2 * ref_err + 1e-3, f"{what}: error {err:.2e} vs bf16 SDPA's {ref_err:.2e}"


def _gpu_losses(overrides):
    return [
        r["loss"]
        for r in train_in_process(
            [
                "parallel.tp=1",
                "model.hidden=64",
                "model.position=rotary",
                "model.sliding_window=8",
                "train.dtype=bfloat16",
                "train.steps=6",
                *overrides,
            ]
        )
    ]


@pytest.mark.gpu(count=1)
def test_train_py_with_a_window_on_one_gpu_eager_compiled_and_graphed(tmp_path):
    """A windowed GPT (heads of 16: the flex path) trains alike eagerly, with compiled blocks and with the step
    captured in a CUDA graph; without the window it computes something else."""
    eager = run_distributed(_gpu_losses, 1, [f"train.run_dir={tmp_path}/a"], backend="nccl")[0]
    for name, extra in (("train.compile", ["train.compile=true"]), ("train.cuda_graph", ["train.cuda_graph=true"])):
        other = run_distributed(
            _gpu_losses, 1, [*extra, f"train.run_dir={tmp_path}/{name}"], backend="nccl", timeout=300
        )[0]
        for step, (a, b) in enumerate(zip(other, eager)):
            assert math.isclose(a, b, rel_tol=2e-2), f"{name}: step {step + 1}: {a} vs {b}"
    full = run_distributed(
        _gpu_losses, 1, ["model.sliding_window=null", f"train.run_dir={tmp_path}/full"], backend="nccl"
    )[0]
    assert abs(full[1] - eager[1]) > 1e-3 and eager[-1] < eager[0] - 0.5
