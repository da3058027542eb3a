"""CUDA-graphed decode on GPUs: the graph gives the eager decode's tokens, token for token (greedy, bf16, a
mixed-length batch), with the TP all-reduces inside the graph on NCCL and on the symm kernels (`auto` with
a thresholds table that picks the Lamport all-reduce for decode sizes, as the measured table does), with eager
and with compiled blocks; and at TP=1 the decode-attention kernel and compiled blocks give the SDPA path's tokens."""

from __future__ import annotations

import json

import pytest
import torch

from tests.dist_utils import run_distributed

ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
PROMPTS = [[5, 9, 200, 3, 77, 12, 1, 900, 4], [44], [7, 7, 8, 250, 31]]


def _graph_and_eager_decode(backend: str, compiled: bool = False):
    from tpframe.inference import Generator, SamplingConfig
    from tpframe.models import BuildContext
    from tpframe.models.config import ModelConfig
    from tpframe.models.gpt import GPT
    from tpframe.parallel import initialize_parallel

    state = initialize_parallel(tp=torch.distributed.get_world_size(), comm_backend=backend)
    cfg = ModelConfig(
        vocab_size=1000,
        hidden=512,
        layers=4,
        heads=8,
        kv_heads=4,
        max_seq_len=128,
        position="rotary",
        activation="swiglu",
        norm="rmsnorm",
        tie_embeddings=False,
        init_std=0.05,
    )
    model = GPT(cfg, BuildContext(state.tp_comm, dtype=torch.bfloat16, device=state.device, seed=3)).eval()
    if compiled:  # the blocks' collectives are tpframe's custom ops; the graph captures the compiled code
        from tpframe.models.compile import compile_model

        compile_model(model, fullgraph=True)
    out = {}
    lamport = state.tp_comm.symm.lamport if state.tp_comm.symm is not None else None
    for graph in (False, True):
        gen = Generator(model, state.tp_comm, sampling=SamplingConfig(greedy=True), vocab_size=1000, cuda_graph=graph)
        calls = int(lamport.state[0]) if lamport is not None else 0
        res = gen.generate(PROMPTS, max_new_tokens=48)
        out[graph] = (res.tokens, (int(lamport.state[0]) - calls) if lamport is not None else 0, gen.graph is not None)
    sampled = []
    for graph in (False, True):  # seeded sampling: the noise is drawn outside the graph, so both agree too
        gen = Generator(
            model,
            state.tp_comm,
            sampling=SamplingConfig(temperature=0.8, top_k=50, top_p=0.9),
            vocab_size=1000,
            seed=5,
            cuda_graph=graph,
        )
        sampled.append(gen.generate(PROMPTS, max_new_tokens=24).tokens)
    return out, sampled


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("backend,compiled", [("nccl", False), ("auto", False), ("auto", True)])
def test_graph_decode_equals_eager_decode_token_for_token(backend, compiled, tmp_path):
    everywhere = {d: {"eager": [[0, None]], "graph": [[0, None]]} for d in ("bfloat16", "float32")}
    table = {
        "symm_ranges": {op: {"2": everywhere} for op in ("all_reduce", "all_gather", "reduce_scatter")},
        "all_reduce_algos": {
            "all_reduce": {
                "2": {d: {"graph": [[262144, "lamport"], [None, "two_shot"]]} for d in ("bfloat16", "float32")}
            }
        },
    }
    (tmp_path / "thresholds.json").write_text(json.dumps(table))
    env = dict(ENV, TPFRAME_COMM_THRESHOLDS=str(tmp_path / "thresholds.json"))
    for out, sampled in run_distributed(
        _graph_and_eager_decode, 2, backend, compiled, backend="nccl", env=env, timeout=300
    ):
        (eager, eager_calls, _), (graph, graph_calls, captured) = out[False], out[True]
        assert captured, "the decode step was not captured"
        assert graph == eager, "graph decode must give the eager decode's tokens"
        assert all(len(t) == 48 for t in graph)
        assert sampled[0] == sampled[1], "seeded sampling: graph and eager must agree"
        if backend == "auto":  # two all-reduces per layer and step ran through the Lamport kernel, graph included
            assert graph_calls >= eager_calls >= 48 * 4 * 2, (graph_calls, eager_calls)


def _decode_variants(options: dict):
    from tpframe.inference import Generator, SamplingConfig
    from tpframe.layers.mode import LayerMode
    from tpframe.models import BuildContext
    from tpframe.models.compile import compile_model
    from tpframe.models.config import ModelConfig
    from tpframe.models.gpt import GPT
    from tpframe.parallel import initialize_parallel

    state = initialize_parallel(tp=1, comm_backend="nccl")
    cfg = ModelConfig(
        vocab_size=1000,
        hidden=256,
        layers=3,
        heads=8,
        max_seq_len=256,
        position="rotary",
        activation="swiglu",
        norm="rmsnorm",
        tie_embeddings=False,
        init_std=0.05,
        **options,
    )
    out = {}
    for name, fused, compiled in (("sdpa", False, False), ("kernel", True, False), ("compiled", True, True)):
        model = GPT(
            cfg,
            BuildContext(
                state.tp_comm, dtype=torch.float32, device=state.device, seed=3, mode=LayerMode(fused_kernels=fused)
            ),
        ).eval()
        if compiled:
            compile_model(model, fullgraph=True)
        for graph in (False, True):
            gen = Generator(
                model, state.tp_comm, sampling=SamplingConfig(greedy=True), vocab_size=1000, cuda_graph=graph
            )
            out[name, graph] = gen.generate(PROMPTS + [list(range(1, 100))], max_new_tokens=100).tokens
            out[name, graph, "batch 1"] = gen.generate(PROMPTS[:1], max_new_tokens=100).tokens  # the one-row GEMMs
    return out


@pytest.mark.gpu
@pytest.mark.parametrize(
    "options",
    [
        dict(kv_heads=8),
        dict(kv_heads=2, bias=False, qkv_bias=True),
        dict(kv_heads=2, bias=False, head_dim=48, qk_norm=True),
        dict(kv_heads=2, bias=False, sliding_window=24),
    ],
    ids=["mha", "gqa-qkv-bias", "gqa-qk-norm-head-dim-48", "gqa-window-24"],
)
def test_decode_attention_kernel_and_compiled_blocks_give_the_sdpa_tokens(options):
    """fp32, greedy: the decode-attention kernel (eager, in the graph, and as a custom op in compiled blocks, where a
    100-token prompt puts the cache past one split; multi-head with every bias, grouped-query with Qwen2's q/k/v
    biases alone, with Qwen3's query/key norms and heads of 48, and with a sliding window of 24 tokens)
    gives the SDPA path's tokens; at batch 1 the graphed step's one-row linear kernel (tpframe/kernels/gemv.py) gives
    cuBLAS's tokens too."""
    (out,) = run_distributed(_decode_variants, 1, options, backend="nccl", env=ENV, timeout=300)
    for batch in ((), ("batch 1",)):
        ref = out[("sdpa", False) + batch]
        assert all(len(t) == 100 for t in ref)
        for key, tokens in out.items():
            if key[2:] == batch:
                assert tokens == ref, f"{key} differs from the eager SDPA decode"
