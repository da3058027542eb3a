"""A plug-in model that is not tpframe's GPT (examples/gpt_neox.py: GPT-NeoX's parallel block, its own Hugging Face
name table) gets the whole path: train.py trains it at TP=2, tools/checkpoint.py exports it as an HF directory whose
logits transformers reproduces, checkpoint.init_from imports that directory with the same logits, and generate.py
generates transformers' greedy tokens from it at TP 1 and 2."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.test_hf import _tool
from tests.training_utils import REPO, train_in_process

transformers = pytest.importorskip("transformers", reason="transformers is in the dev extras: pip install -e '.[dev]'")

NEOX = ["model.name=examples.gpt_neox:build", "model.position=rotary", "model.tie_embeddings=false"]
IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(7))
PROMPT = "the plug-in "


def _logits_of(source: str, m, state) -> torch.Tensor:
    """The full logits [b, s, V] of model `m` at this TP size, its weights from `source` as checkpoint.init_from
    loads them."""
    from tpframe.checkpoint.init_from import load_init_from
    from tpframe.models import BuildContext, build_model

    model = build_model(m, BuildContext(state.tp_comm, seed=5)).eval()
    load_init_from(model, m, source, state.tp_rank, state.tp)
    with torch.no_grad():
        return state.tp_comm.all_gather(model(IDS).contiguous(), dim=-1)[..., : m.vocab_size]


def _whole_path(tmp: str):
    import torch.distributed as dist

    sys.path.insert(0, REPO)
    import generate as cli
    from tpframe.checkpoint import resolve
    from tpframe.checkpoint.hf import check_hf_dir
    from tpframe.models.config import read_model_config
    from tpframe.parallel import destroy_parallel, initialize_parallel

    run = [*NEOX, "parallel.tp=2", "train.steps=2", "checkpoint.save_at_end=true", f"train.run_dir={tmp}/run"]
    train_in_process(run)
    if dist.get_rank() == 0:
        assert _tool().main(["export", f"{tmp}/run/checkpoints", "--format", "hf", "--out", f"{tmp}/hf"]) == 0
    dist.barrier()
    m = read_model_config(json.loads((resolve(f"{tmp}/run/checkpoints") / "meta.json").read_text())["config"]["model"])
    check_hf_dir(m, f"{tmp}/hf")  # checkpoint.init_from's pre-flight: config.json, names, shapes
    state = initialize_parallel(tp=2)
    try:
        out = {"trained": _logits_of(f"{tmp}/run/checkpoints", m, state), "imported": _logits_of(f"{tmp}/hf", m, state)}
    finally:
        destroy_parallel()
    argv = ["--checkpoint", f"{tmp}/run/checkpoints", "--prompt", PROMPT, "--max-new-tokens", "8", "--greedy"]
    for tp in (2, 1):  # TP=1: each rank a generator of its own
        plan = cli.prepare([*argv, "--ignore-eos"], world_size=tp)
        out[f"tokens_tp{tp}"], out["prompt_ids"] = cli.run(plan)[0]["token_ids"], plan.prompt_ids[0]
    return out


def test_a_plugin_model_trains_exports_imports_and_generates(tmp_path):
    got = run_distributed(_whole_path, 2, str(tmp_path), timeout=300)[0]
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert type(reference).__name__ == "GPTNeoXForCausalLM"
    with torch.no_grad():
        logits = reference(IDS).logits
        prompt = torch.tensor([got["prompt_ids"]])
        reference.generation_config.eos_token_id = None  # --ignore-eos
        greedy = reference.generate(prompt, max_new_tokens=8, do_sample=False)[0, prompt.shape[1] :].tolist()
    torch.testing.assert_close(got["trained"], logits, atol=1e-5, rtol=0, msg="transformers vs tpframe's TP=2")
    torch.testing.assert_close(got["imported"], got["trained"], atol=1e-6, rtol=0, msg="imported vs exported")
    assert got["tokens_tp2"] == got["tokens_tp1"] == greedy
