"""The GPT built from tpframe.layers against a plain batch-first torch GPT, at TP 1/2/4, SP on/off."""

import dataclasses
import math

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.reference_gpt import assert_matches_reference
from tpframe.models.config import ModelConfig

GPT_CFG = ModelConfig(vocab_size=101, hidden=32, layers=2, heads=4, max_seq_len=16, vocab_multiple=8)
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
B, S = 2, 8


def _parallel_vs_reference(cfg: ModelConfig, sp: bool):
    from tpframe.models import BuildContext, build_model
    from tpframe.parallel import initialize_parallel, seed_parallel_rng
    from tpframe.parallel.sharding import param_shards

    state = initialize_parallel(tp=torch.distributed.get_world_size())
    tracker = seed_parallel_rng(0)
    model = build_model(cfg, BuildContext(state.tp_comm, sequence_parallel=sp, rng_tracker=tracker, seed=11))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    case = f"{cfg.norm}/{cfg.position}/{cfg.activation} tp={state.tp} sp={sp}"
    _, weights = assert_matches_reference(cfg, model, ids, labels, state.tp_comm, case)
    # the parameters of the TP-unsplit model, from the shapes of the global tensors (vocabulary padding excluded)
    n_params = sum(
        math.prod(s.global_shape) for n, p in model.named_parameters() for s in param_shards(n, p, 0, state.tp)
    )
    return {k: v for k, v in weights.items()}, n_params, model.flops_per_token(S)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("cfg", [GPT_CFG, LLAMA_CFG], ids=["gpt", "llama-style"])
def test_gpt_matches_plain_torch_reference(tp, cfg):
    results = [
        run_distributed(_parallel_vs_reference, tp, cfg, sp)[0] for sp in ((False, True) if tp > 1 else (False,))
    ]
    weights, n_params, _ = results[0]
    assert n_params == sum(w.numel() for w in weights.values())


def test_same_seed_gives_the_same_model_at_any_tp():
    w1 = run_distributed(_parallel_vs_reference, 1, LLAMA_CFG, False)[0][0]
    w4 = run_distributed(_parallel_vs_reference, 4, LLAMA_CFG, True)[0][0]
    for name in w1:
        assert torch.equal(w1[name], w4[name]), name


def test_flops_per_token_matches_megatron_formula():
    from tpframe.models import BuildContext
    from tpframe.models.gpt import GPT

    class FakeComm:
        size, rank, device = 1, 0, torch.device("cpu")

    cfg = ModelConfig(vocab_size=50304, hidden=256, layers=3, heads=4, max_seq_len=64, vocab_multiple=128)
    model = GPT(cfg, BuildContext(FakeComm()))
    L, h, s, V = 3, 256, 64, 50304
    assert model.flops_per_token(s) == 72 * L * h * h + 12 * L * h * s + 6 * h * V
    for p in model.parameters():  # frozen weights (LoRA's base): no weight-gradient GEMMs
        p.requires_grad_(False)
    assert model.flops_per_token(s) == 48 * L * h * h + 12 * L * h * s + 4 * h * V
