"""Packed documents (model.attention_mask=document): a packed row computes what each document computes alone.

The reference is tests/reference_gpt.py (plain batch-first torch, causal, no tpframe.layers) run on each document
by itself; tpframe's GPT runs the packed rows at TP 1, 2 and 4 with SP, learned and rotary positions.
"""

import dataclasses
import math

import pytest
import torch

from tests.dist_utils import each, run_distributed
from tests.reference import assert_close, loss_and_full_tensors
from tests.reference_gpt import reference_loss
from tests.training_utils import LLAMA_SHAPE, train_in_process
from tpframe.layers.documents import Documents
from tpframe.models.config import ModelConfig

EOD = 0
GPT_CFG = ModelConfig(
    vocab_size=101,
    hidden=32,
    layers=2,
    heads=4,
    max_seq_len=16,
    vocab_multiple=8,
    attention_mask="document",
    eod_id=EOD,
)
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
B, S = 3, 16


def packed_rows(seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of documents of 1 to 7 tokens, each ended by EOD; a row may start or end inside one.
    Row 1 ends with an EOD, row 2 starts with one (a one-token document)."""
    g = torch.Generator().manual_seed(seed)
    stream = []
    while len(stream) < B * S + 1:
        stream += torch.randint(1, 101, (int(torch.randint(0, 7, (1,), generator=g)),), generator=g).tolist() + [EOD]
    tokens = torch.tensor(stream[: B * S + 1])
    tokens[S - 1], tokens[S] = 7, EOD  # row 0's last input token is ordinary and row 1 starts with an EOD
    tokens[2 * S - 1] = EOD  # row 1 ends with one
    return tokens[:-1].view(B, S), tokens[1:].view(B, S)


def test_documents_of_a_row():
    ids = torch.tensor([[5, 6, 7, 0, 8, 9, 0, 4], [0, 1, 2, 3, 0, 0, 5, 6]])
    docs = Documents.from_tokens(ids, 0, varlen=True)
    assert docs.ids.tolist() == [[0, 0, 0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 2, 3, 3]]
    assert docs.positions.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0], [0, 0, 1, 2, 3, 0, 0, 1]]
    assert docs.cu_seqlens.tolist() == [0, 4, 7, 8, 9, 13, 14, 16] and docs.max_len == 4  # the flattened batch
    mask = docs.mask()[1, 0]
    assert mask.tolist()[4] == [False, True, True, True, True, False, False, False]  # the EOD ends document 1
    assert mask.tolist()[7] == [False] * 6 + [True, True]
    assert Documents.from_tokens(ids, 0).cu_seqlens is None  # on the CPU: the dense mask only


def _packed_vs_alone(cfg: ModelConfig, sp: bool):
    from tpframe.models import BuildContext, build_model
    from tpframe.parallel import initialize_parallel, seed_parallel_rng

    state = initialize_parallel(tp=torch.distributed.get_world_size())
    model = build_model(
        cfg, BuildContext(state.tp_comm, sequence_parallel=sp, rng_tracker=seed_parallel_rng(0), seed=11)
    )
    ids, labels = packed_rows()
    loss, weights, grads = loss_and_full_tensors(model, ids, labels, state.tp_comm)

    P = {k: v.clone().requires_grad_() for k, v in weights.items()}
    causal = dataclasses.replace(cfg, attention_mask="causal")
    alone = torch.zeros(B, S)
    for row in range(B):  # each document by itself, at positions 0.. (what a packed row must reproduce)
        ends = [i + 1 for i in range(S) if ids[row, i] == EOD]
        for start, end in zip([0, *ends], [*ends, S]):
            if end > start:
                alone[row, start:end] = reference_loss(
                    causal, P, ids[row : row + 1, start:end], labels[row : row + 1, start:end]
                )[0]
    alone.mean().backward()
    case = f"{cfg.position} tp={state.tp} sp={sp}"
    assert_close(loss, alone, 1e-5, f"{case}: per-token loss")
    for name in P:
        assert_close(grads[name], P[name].grad, 1e-5, f"{case}: grad of {name}", atol=1e-7)
    with torch.no_grad():  # the mask matters: the same row as one causal sequence computes something else
        plain = build_model(
            causal, BuildContext(state.tp_comm, sequence_parallel=sp, rng_tracker=seed_parallel_rng(0), seed=11)
        )(ids, labels)
    return float((plain - loss.detach()).abs().max())


@pytest.mark.parametrize(
    "cfg,tp", [(GPT_CFG, 1), (GPT_CFG, 2), (LLAMA_CFG, 4)], ids=["gpt-tp1", "gpt-tp2-sp", "llama-tp4-sp"]
)
def test_a_packed_row_computes_each_document_alone(cfg, tp):
    differs = run_distributed(_packed_vs_alone, tp, cfg, tp > 1)[0]
    assert differs > 1e-3


def build_without_documents(cfg, ctx):
    """A user model's builder that does not declare supports_document_mask (the pre-flight must refuse it)."""
    from tpframe.models import build_gpt

    return build_gpt(cfg, ctx)


def _layout_losses(overrides):
    """train.py's 10 losses then its 2 eval losses (steps 5 and 10), and its gradient norms."""
    history = train_in_process(
        [
            "parallel.tp=1",
            "model.attention_mask=document",
            "model.eod_id=10",
            "train.eval_interval=5",
            "train.eval_steps=2",
            *overrides,
        ]
    )
    evals = [r["eval_loss"] for r in history if "eval_loss" in r]
    assert len(evals) == 2
    return [r["loss"] for r in history] + evals, [r["grad_norm"] for r in history]


def _same(a, b, what, rel=1e-5):
    for i, (x, y) in enumerate(zip(a, b)):
        assert math.isclose(x, y, rel_tol=rel, abs_tol=1e-7), f"{what}: step {i + 1}: {x!r} vs {y!r}"


def test_document_masking_trains_the_same_at_every_layout(tmp_path):
    """train.py with each line of the synthetic corpus one document (eod_id=10, '\\n'), rotary positions: TP=2 + SP,
    PP=2, CP=2 (with TP=2 + SP too) and DP=2 follow one process, and causal attention does not (the option reaches the
    model). The runs of one world size share its processes."""
    rotary = ["model.position=rotary", "optim.grad_clip=0.5"]
    (ref, ref_norms), (causal, _) = run_distributed(
        each,
        1,
        _layout_losses,
        [
            [*rotary, f"train.run_dir={tmp_path}/ref"],
            [*rotary, "model.attention_mask=causal", f"train.run_dir={tmp_path}/c"],
        ],
    )[0]
    layouts = {
        2: {
            "TP=2+SP": ["parallel.tp=2", "parallel.sequence_parallel=true"],
            "PP=2": ["parallel.pp=2"],
            "CP=2": ["parallel.cp=2"],
            "DP=2 zero1, selective recompute": [
                "train.micro_batch_size=2",
                "parallel.dp_strategy=zero1",
                "parallel.activation_checkpointing=selective",
            ],
        },
        4: {"CP=2 x TP=2 + SP": ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]},
    }
    for nproc, named in layouts.items():
        runs = [[*rotary, *extra, f"train.run_dir={tmp_path}/{nproc}-{i}"] for i, extra in enumerate(named.values())]
        results = run_distributed(each, nproc, _layout_losses, runs, timeout=300)[0]
        for name, (losses, norms) in zip(named, results):
            _same(losses, ref, name)
            _same(norms, ref_norms, f"{name} grad norm", rel=1e-4)
    assert abs(causal[0] - ref[0]) > 1e-4


def test_learned_positions_restart_at_each_document_under_pipeline_and_full_recompute(tmp_path):
    ref, _ = run_distributed(_layout_losses, 1, [f"train.run_dir={tmp_path}/a"])[0]
    pp, _ = run_distributed(
        _layout_losses, 2, ["parallel.pp=2", "parallel.activation_checkpointing=full", f"train.run_dir={tmp_path}/b"]
    )[0]
    _same(pp, ref, "PP=2 + full recompute, learned positions")
    cp, _ = run_distributed(_layout_losses, 4, ["parallel.cp=2", "parallel.pp=2", f"train.run_dir={tmp_path}/c"])[0]
    _same(cp, ref, "CP=2 x PP=2, learned positions")


def test_the_end_of_document_token_comes_from_the_data(tmp_path, monkeypatch):
    """model.eod_id unset: the byte 0 that ends each stdlib file, a token file's own eot_id (here edited to '.')."""
    import json
    import os

    import train
    from tests.training_utils import REPO, TINY, merge_overrides
    from tpframe.data.tokenizer import write_token_file

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox. jumps over the lazy dog. " * 300)
    write_token_file([text], tmp_path / "tokens.bin")
    sidecar = tmp_path / "tokens.bin.json"
    meta = json.loads(sidecar.read_text())
    sidecar.write_text(json.dumps({**meta, "eot_id": ord(".")}))
    base = merge_overrides(
        ["--config", os.path.join(REPO, "configs", "tiny_cpu.yaml")],
        TINY,
        ["parallel.tp=1", "model.attention_mask=document", f"train.run_dir={tmp_path}/run"],
    )
    for data, expected in (
        (["data.source=stdlib"], 0),
        (["data.source=tokens", f"data.path={tmp_path}/tokens.bin"], 46),
    ):
        cfg = train.prepare(merge_overrides(base, data))[0]
        assert cfg.model.eod_id == expected, data
    cfg = train.prepare(merge_overrides(base, ["data.source=stdlib", "model.eod_id=10"]))[0]
    assert cfg.model.eod_id == 10  # given: kept


def test_compiled_blocks_take_the_documents_without_graph_breaks(tmp_path):
    """train.compile=true (aot_eager on the CPU, fullgraph): the dense document mask traces into each block."""
    from tests.test_perf_paths import _assert_compiled_trains_like_eager, _train_compiled_and_eager

    common = [
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "train.steps=3",
        "model.position=rotary",
        "model.attention_mask=document",
        "model.eod_id=10",
    ]
    losses, compiled_blocks, breaks = run_distributed(
        _train_compiled_and_eager, 2, str(tmp_path), common, [], True, timeout=300
    )[0]
    _assert_compiled_trains_like_eager(losses, compiled_blocks)
    assert breaks == 0


# -- GPU: the variable-length Flash path ---------------------------------------------------------------------


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=True, enable_gqa=False):
    """torch.nn.attention.varlen's contract in plain torch: sequence i's queries q[cu_q[i]:cu_q[i+1]] over its keys,
    causal with the mask aligned to the last key (Flash's bottom-right alignment)."""
    assert is_causal
    outs = []
    for i in range(len(cu_q) - 1):
        qi, ki, vi = (
            t[a:z].transpose(0, 1)
            for t, a, z in ((q, cu_q[i], cu_q[i + 1]), (k, cu_k[i], cu_k[i + 1]), (v, cu_k[i], cu_k[i + 1]))
        )
        lq, lk = qi.shape[1], ki.shape[1]
        assert 0 < lq <= max_q and lq <= lk <= max_k
        mask = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, enable_gqa=enable_gqa
            ).transpose(0, 1)
        )
    return torch.cat(outs)


def _cp_chunks_vs_dense(varlen, dev, dtype, *, b, s, nq, nkv, d, mean, seed=0):
    """Every CP rank's queries (cp 2 and 4) through `_varlen_chunks` (with `varlen` as the kernel) against the
    dense-mask CP attention: the largest (error, its scale) over output and q, k, v gradients."""
    import tpframe.layers.documents as documents
    from tpframe.layers.context import local_positions, shard_sequence

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 50, (b, s), generator=g)
    ids[torch.rand(b, s, generator=g) < 1 / mean] = EOD
    ids[0, s // 2 - 1] = ids[-1, 0] = EOD  # a document ends at a chunk edge; a row starts with a one-token one
    q, k, v = (torch.randn(b, n, s, d, generator=g).to(dev, dtype) for n in (nq, nkv, nkv))
    dout = torch.randn(b, nq, s, d, generator=g).to(dev, dtype)
    worst = []
    for cp in (2, 4):
        for rank in range(cp):
            docs = Documents.for_cp_rank(ids.to(dev), EOD, rank=rank, size=cp, varlen=True)
            full = Documents.from_tokens(ids.to(dev), EOD, varlen=False)
            assert torch.equal(docs.ids, full.ids) and docs.chunks is not None
            ql, kk, vv = (t.clone().requires_grad_() for t in (shard_sequence(q, dim=2, rank=rank, size=cp), k, v))
            dl = shard_sequence(dout, dim=2, rank=rank, size=cp)
            got = (
                documents._varlen_chunks(ql, torch.stack([kk, vv]), docs.chunks, nq != nkv)
                if varlen is None
                else _with_kernel(
                    documents,
                    varlen,
                    lambda: documents._varlen_chunks(ql, torch.stack([kk, vv]), docs.chunks, nq != nkv),
                )
            )
            got_grads = torch.autograd.grad(got, (ql, kk, vv), dl)
            rows = local_positions(s // cp, rank=rank, size=cp, device=dev)
            mask = (full.ids[:, rows, None] == full.ids[:, None, :]) & (rows[:, None] >= torch.arange(s, device=dev))
            wide = torch.float64 if dtype == torch.float64 else torch.float32
            ql32, k32, v32 = (t.detach().to(wide).requires_grad_() for t in (ql, kk, vv))
            want = torch.nn.functional.scaled_dot_product_attention(
                ql32, k32, v32, attn_mask=mask[:, None], enable_gqa=nq != nkv
            )
            want_grads = torch.autograd.grad(want, (ql32, k32, v32), dl.to(wide))
            for a, w in zip((got, *got_grads), (want, *want_grads)):
                worst.append((float((a.detach().to(wide) - w.detach()).abs().max()), float(w.detach().abs().max())))
    return worst


def _with_kernel(documents, kernel, fn):
    saved, saved_args = documents._varlen_attn, documents._VARLEN_ARGS
    documents._varlen_attn, documents._VARLEN_ARGS = kernel, {"is_causal", "enable_gqa"}
    try:
        return fn()
    finally:
        documents._varlen_attn, documents._VARLEN_ARGS = saved, saved_args


@pytest.mark.parametrize("nq,nkv", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_cp_chunks_as_variable_length_sequences_equal_the_dense_mask(nq, nkv):
    """The sequences each CP rank's two query chunks make (pieces of documents, keys from the document's start,
    rows and chunks back to back), run through the varlen contract in plain torch: the dense-mask CP attention's
    output and gradients, at CP 2 and 4, every rank, documents that span chunks and ranks."""
    worst = _cp_chunks_vs_dense(
        _reference_varlen, torch.device("cpu"), torch.float64, b=3, s=32, nq=nq, nkv=nkv, d=8, mean=6
    )
    assert max(err for err, _ in worst) < 1e-10, worst


@pytest.mark.gpu(count=1)
@pytest.mark.parametrize("nq,nkv", [(8, 8), (8, 2)], ids=["mha", "gqa"])
def test_cp_chunks_through_flash_varlen_equal_the_dense_mask_on_gpu(nq, nkv):
    """The same with torch's Flash varlen kernel in bf16 (its causal mask aligned to each sequence's last key):
    within bf16's error of the fp32 dense-mask result."""
    worst = _cp_chunks_vs_dense(None, torch.device("cuda"), torch.bfloat16, b=2, s=1024, nq=nq, nkv=nkv, d=64, mean=100)
    for err, scale in worst:
        assert err <= 0.02 * scale + 0.02, worst


@pytest.mark.gpu(count=1)
@pytest.mark.parametrize("nq,nkv", [(8, 8), (8, 2)], ids=["mha", "gqa"])
def test_varlen_flash_attention_equals_the_dense_mask_on_gpu(nq, nkv):
    """bf16: the varlen kernel's output and gradients are as close to the fp32 dense-mask result as bf16 SDPA is."""
    from tpframe.layers.documents import document_attention, uses_varlen

    dev, b, s, d = torch.device("cuda"), 3, 512, 64
    g = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randint(1, 50, (b, s), generator=g, device=dev)
    ids[torch.rand(b, s, generator=g, device=dev) < 0.01] = EOD  # documents of ~100 tokens
    ids[1, -1] = ids[2, 0] = EOD
    docs = Documents.from_tokens(ids, EOD)
    q32, k32, v32 = (torch.randn(b, n, s, d, generator=g, device=dev) for n in (nq, nkv, nkv))
    dout = torch.randn(b, nq, s, d, generator=g, device=dev)

    def run(q, k, v, dtype, fn):
        q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
        out = fn(q, k, v)
        return [out.float(), *(t.float() for t in torch.autograd.grad(out, (q, k, v), dout.to(dtype)))]

    dense = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        q, k, v, attn_mask=docs.mask(), enable_gqa=nq != nkv
    )
    want = run(q32, k32, v32, torch.float32, dense)
    ref_bf16 = run(q32, k32, v32, torch.bfloat16, dense)
    assert uses_varlen(q32.bfloat16(), docs), "torch.nn.attention.varlen is missing: the fast path would not run"
    got = run(q32, k32, v32, torch.bfloat16, lambda q, k, v: document_attention(q, k, v, docs, enable_gqa=nq != nkv))
    for what, a, r, w in zip(("out", "dq", "dk", "dv"), got, ref_bf16, want):
        err, ref_err = float((a - w).abs().max()), float((r - w).abs().max())
        assert err <= 2 * ref_err + 1e-3, f"{what}: varlen error {err:.2e} vs bf16 SDPA's {ref_err:.2e}"


def _packed_gpt_on_gpu():
    from tpframe.models import BuildContext, build_model
    from tpframe.models.compile import compile_model
    from tpframe.parallel import initialize_parallel, seed_parallel_rng

    state = initialize_parallel(tp=1)
    cfg = dataclasses.replace(LLAMA_CFG, vocab_size=512, hidden=256, heads=4, kv_heads=2, max_seq_len=256)

    def build(c):
        return build_model(
            c,
            BuildContext(
                state.tp_comm, rng_tracker=seed_parallel_rng(0), seed=11, dtype=torch.bfloat16, device=state.device
            ),
        )

    packed, alone_model = build(cfg), build(dataclasses.replace(cfg, attention_mask="causal"))
    contiguous = []  # the varlen output reaches the projection laid out [s, b, h] (a strided view: slow matmuls)
    for name, m in packed.named_modules():
        if name.endswith(".proj") and hasattr(m, "lora_a"):
            m.register_forward_pre_hook(lambda mod, args: contiguous.append(args[0].is_contiguous()))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 512, (4, 257), generator=g)
    ids[torch.rand(4, 257, generator=g) < 0.02] = EOD
    inp, labels = ids[:, :-1].to(state.device), ids[:, 1:].to(state.device)
    with torch.no_grad():
        loss = packed(inp, labels).float()
        alone = torch.zeros_like(loss)
        for row in range(inp.shape[0]):
            ends = [i + 1 for i in range(inp.shape[1]) if inp[row, i] == EOD]
            for a, z in zip([0, *ends], [*ends, inp.shape[1]]):
                if z > a:
                    alone[row, a:z] = alone_model(inp[row : row + 1, a:z], labels[row : row + 1, a:z])[0].float()
    compile_model(packed)
    with torch.no_grad():
        compiled = packed(inp, labels).float()
        inp2 = inp.clone()
        inp2[:, ::37] = EOD  # other documents: the compiled blocks take them too
        finite = bool(torch.isfinite(packed(inp2, labels)).all())
    return [
        float((loss - alone).abs().max()),
        float((loss - alone).abs().mean()),
        float((compiled - loss).abs().max()),
        finite,
        contiguous and all(contiguous),
    ]


@pytest.mark.gpu(count=1)
def test_packed_gpt_on_gpu_computes_each_document_alone_eager_and_compiled():
    """GPT in bf16 on CUDA (the varlen path): the packed rows' per-token loss (about 6.2) equals each document run
    alone within bf16 rounding; compiled blocks (Inductor) equal eager; the projections read contiguous inputs."""
    worst, mean, compiled, finite, contiguous = run_distributed(_packed_gpt_on_gpu, 1, backend="nccl", timeout=300)[0]
    assert worst < 0.05 and mean < 5e-3, (worst, mean)
    assert compiled < 0.05 and finite, compiled
    assert contiguous  # the attention output, written token-major by the varlen kernel, is laid out [s, b, h]


def _bf16_losses(overrides):
    return [
        r["loss"]
        for r in train_in_process(
            [
                "model.attention_mask=document",
                "model.eod_id=10",
                "train.dtype=bfloat16",
                "model.position=rotary",
                "train.steps=6",
                *overrides,
            ]
        )
    ]


@pytest.mark.gpu(count=2)
def test_document_masking_trains_alike_on_one_and_two_gpus(tmp_path):
    """TP=2 + SP and CP=2 (its queries' documents as varlen sequences per chunk) against one GPU."""
    one = run_distributed(_bf16_losses, 1, ["parallel.tp=1", f"train.run_dir={tmp_path}/a"], backend="nccl")[0]
    two = run_distributed(
        _bf16_losses,
        2,
        ["parallel.tp=2", "parallel.sequence_parallel=true", f"train.run_dir={tmp_path}/b"],
        backend="nccl",
    )[0]
    _same(two, one, "TP=2+SP vs TP=1, bf16", rel=2e-2)
    cp = run_distributed(
        _bf16_losses, 2, ["parallel.tp=1", "parallel.cp=2", f"train.run_dir={tmp_path}/c"], backend="nccl"
    )[0]  # dp=1: the same micro-batches as one GPU's
    _same(cp, one, "CP=2 (varlen per chunk) vs CP=1, bf16", rel=2e-2)


@pytest.mark.gpu(count=1)
def test_train_py_with_documents_on_one_gpu_learns_eager_and_compiled(tmp_path):
    eager = run_distributed(_bf16_losses, 1, ["parallel.tp=1", f"train.run_dir={tmp_path}/a"], backend="nccl")[0]
    compiled = run_distributed(
        _bf16_losses,
        1,
        ["parallel.tp=1", "train.compile=true", f"train.run_dir={tmp_path}/b"],
        backend="nccl",
        timeout=300,
    )[0]
    _same(compiled, eager, "train.compile=true vs eager, bf16", rel=2e-2)
    assert eager[-1] < eager[0] - 0.5


def test_a_user_model_takes_the_documents_through_the_layers(tmp_path):
    """examples/parallel_llama.py passes `documents=` to ParallelAttention: TP=2 + SP follows one process, and the
    mask changes what it computes."""
    llama = [
        "model.name=examples.parallel_llama:build",
        *LLAMA_SHAPE,
        "model.kv_heads=2",
        "parallel.activation_checkpointing=full",
    ]
    one, _ = run_distributed(_layout_losses, 1, [*llama, f"train.run_dir={tmp_path}/a"])[0]
    two, _ = run_distributed(
        _layout_losses, 2, [*llama, "parallel.tp=2", "parallel.sequence_parallel=true", f"train.run_dir={tmp_path}/b"]
    )[0]
    _same(two, one, "user model TP=2+SP vs TP=1", rel=1e-4)
    causal, _ = run_distributed(
        _layout_losses, 1, [*llama, "model.attention_mask=causal", f"train.run_dir={tmp_path}/c"]
    )[0]
    assert abs(causal[0] - one[0]) > 1e-4
