"""LoRA (optim.lora_rank): adapters on the tensor-parallel layers train alike on every layout, only they train, and
their checkpoints resume exactly, on another TP size too; bad keys are one line before anything is written."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.training_utils import (
    LLAMA_SHAPE,
    REPO,
    TINY,
    assert_layouts_follow,
    merge_overrides,
    train_in_process,
)

# Llama's shape (fused q/k/v and gate/up, GQA, an untied head), every target adapted
LLAMA = [*LLAMA_SHAPE, "model.heads=8", "model.kv_heads=4"]
LORA = ["optim.lora_rank=4", "optim.lora_alpha=8", "optim.lora_targets=[qkv,proj,fc1,fc2,head]"]


def write_base(path: str, overrides: list[str], *, hf: bool = False) -> str:
    """A seeded model of the config's `model:` section (the LoRA base) as a consolidated safetensors file, or with `hf`
    a Hugging Face directory."""
    from safetensors.torch import save_file

    from tpframe.checkpoint.hf import hf_config, to_hf
    from tpframe.models import BuildContext, ShapeComm, build_model
    from tpframe.parallel.sharding import param_shards
    from tpframe.training.config import load_config

    cfg = load_config(os.path.join(REPO, "configs", "tiny_cpu.yaml"), merge_overrides(TINY, overrides))
    comm = ShapeComm(1)
    comm.device = torch.device("cpu")
    model = build_model(cfg.model, BuildContext(comm, device=comm.device, seed=7))
    tensors = {
        s.name: s.view(p.detach()).contiguous() for n, p in model.named_parameters() for s in param_shards(n, p, 0, 1)
    }
    if not hf:
        save_file(tensors, path)
        return path
    os.makedirs(path)
    save_file(to_hf(tensors, cfg.model), os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config(cfg.model), f)
    return path


# name: overrides, on 4 processes. The reference is TP=1 x DP=4 (one process's computation: DP is tested equal to
# it); every layout takes 8 sequences per micro-step (evaluation sees the same held-out samples), 16 per step.
ONE_REPLICA = "train.micro_batch_size=8"
LAYOUTS = {
    "tp=4 + SP": ["parallel.tp=4", "parallel.sequence_parallel=true", ONE_REPLICA],
    "tp=2 x pp=2 + SP": ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true", ONE_REPLICA],
    "tp=2 x dp=2 zero1": ["parallel.tp=2", "parallel.dp_strategy=zero1"],
    "tp=2 x cp=2 fsdp": ["parallel.tp=2", "parallel.cp=2", "parallel.dp_strategy=fsdp", ONE_REPLICA],
}
COMMON = [*LLAMA, *LORA, "train.global_batch_size=16", "train.eval_interval=5", "train.eval_steps=2"]


def _adapter_state(trainer) -> tuple[set[str], set[str]]:
    """(the parameters with a gradient, the model tensors the strategy checkpoints)."""
    grads = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    saved = {k for k in trainer.strategy.state_dict() if k.startswith("model/")}
    return grads, saved


def _train_layouts(tmp: str, base: str):
    common = [*COMMON, f"checkpoint.init_from={base}"]
    ref = train_in_process([*common, "parallel.tp=1", "train.micro_batch_size=2", f"train.run_dir={tmp}/ref"], True)
    out, trained = {"ref": ref.history}, _adapter_state(ref)
    for name, extra in LAYOUTS.items():
        out[name] = train_in_process([*common, *extra, "checkpoint.interval=5", f"train.run_dir={tmp}/{name}"])
    # the TP=2 zero1 run's step-5 checkpoint (adapters only) resumes on its own layout and at TP=1
    saved = f"{tmp}/tp=2 x dp=2 zero1/checkpoints/step_00000005"
    for name, extra in (("resumed same", LAYOUTS["tp=2 x dp=2 zero1"]), ("resumed at tp=1", ["parallel.tp=1"])):
        extra = [*extra, *(["train.micro_batch_size=2"] if "tp=1" in name else [])]
        out[name] = train_in_process([*common, *extra, f"checkpoint.load={saved}", f"train.run_dir={tmp}/{name}"])
    return out, trained


def test_lora_trains_alike_at_tp_1_2_4_with_sp_pp_cp_and_every_strategy_and_resumes_at_tp1(tmp_path):
    base = write_base(str(tmp_path / "base.safetensors"), LLAMA)
    results, (grads, saved) = run_distributed(_train_layouts, 4, str(tmp_path), base, timeout=600)[-1]
    ref = results.pop("ref")
    assert len(ref) == 10 and ref[-1]["loss"] < ref[0]["loss"] - 0.05, [r["loss"] for r in ref]  # the adapters learn
    # step 6+'s gradient norms move by ~1e-5 relative with the layout alone (rounding); every loss within 1e-6
    assert_layouts_follow(ref, {k: (h, None) for k, h in results.items()}, grad_norm_rel=1e-4)
    same = {r["step"]: r["loss"] for r in results["tp=2 x dp=2 zero1"]}
    assert all(r["loss"] == same[r["step"]] for r in results["resumed same"])  # bit-exact
    # only the adapters have gradients, and they are all the checkpoint holds of the model
    assert grads and all(".lora_" in n for n in grads)
    assert saved and all(".lora_" in k for k in saved)
    adapted = {k.rsplit(".", 1)[0] for k in saved}
    assert adapted >= {"model/blocks.0.attn.qkv.k", "model/blocks.1.mlp.fc1.up", "model/blocks.1.mlp.fc2", "model/head"}


@pytest.mark.slow
def test_compiled_lora_blocks_train_like_eager(tmp_path):
    """train.compile=true (aot_eager on the CPU, fullgraph) with adapters on every block layer, TP=2 + SP."""
    from tests.test_perf_paths import _assert_compiled_trains_like_eager, _train_compiled_and_eager

    base = write_base(str(tmp_path / "base.safetensors"), LLAMA)
    common = [*LLAMA, *LORA, f"checkpoint.init_from={base}", "parallel.tp=2", "parallel.sequence_parallel=true"]
    losses, compiled_blocks, breaks = run_distributed(
        _train_compiled_and_eager, 2, str(tmp_path), [*common, "train.steps=3"], [], True, timeout=300
    )[0]
    _assert_compiled_trains_like_eager(losses, compiled_blocks)
    assert breaks == 0


BAD_KEYS = [
    (["optim.lora_rank=0"], "optim.lora_rank=0 must be a positive integer"),
    (["optim.lora_rank=-2"], "optim.lora_rank=-2 must be a positive integer"),
    (["optim.lora_rank=4", "optim.lora_targets=[qkv,mlp]"], "optim.lora_targets[1]='mlp' is not allowed"),
    (["optim.lora_rank=4", "optim.lora_targets=[gate]"], "optim.lora_targets names 'gate', which model.name='gpt'"),
    (["optim.lora_rank=4", "optim.lora_targets=[head]"], "optim.lora_targets names 'head'"),  # tied: the embedding
    (["optim.lora_rank=4", "optim.lora_targets=[qkv,gate]"], "optim.lora_targets names 'gate'"),  # once accepted
    (["optim.lora_rank=4", "checkpoint.init_from="], "trains adapters on a frozen base model"),
    (["optim.lora_rank=4", "parallel.sequence_parallel=true", "parallel.async_tp=true"], "parallel.async_tp=true:"),
    (["optim.lora_rank=4", "model.moe_experts=4"], "no adapters for mixture-of-experts models"),
    (["optim.lora_targets=[qkv]"], "optim.lora_targets set LoRA's adapters, but optim.lora_rank is null"),
    (["optim.lora_alpha=32"], "optim.lora_alpha set LoRA's adapters, but optim.lora_rank is null"),
]


@pytest.mark.parametrize("overrides,message", BAD_KEYS)
def test_bad_lora_keys_are_one_line_before_anything_is_written(tmp_path, overrides, message):
    import train
    from tpframe.errors import ConfigError

    base = write_base(str(tmp_path / "base.safetensors"), [])
    argv = merge_overrides(
        ["--config", os.path.join(REPO, "configs", "tiny_cpu.yaml")],
        TINY,
        ["parallel.tp=1", f"checkpoint.init_from={base}", f"train.run_dir={tmp_path}/run", *overrides],
    )
    with pytest.raises(ConfigError) as e:
        train.prepare(argv, world_size=1, rank=0)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not (tmp_path / "run").exists()


def checkpoint_tool():
    """tools/checkpoint.py as a module."""
    spec = importlib.util.spec_from_file_location("tools_checkpoint", os.path.join(REPO, "tools", "checkpoint.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


IDS = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))


def _train_export_and_forward(tmp: str, base: str):
    """Train LoRA at TP=2 + SP and export it (rank 0: merged HF directory, PEFT directory); then tpframe's TP=1
    forward of the base with the checkpoint's adapters."""
    import torch.distributed as dist

    from tpframe.checkpoint.export import CheckpointWeights, copy_logical_tensors
    from tpframe.checkpoint.init_from import base_weights
    from tpframe.layers.mode import LayerMode
    from tpframe.models import BuildContext, build_model
    from tpframe.parallel import initialize_parallel
    from tpframe.parallel.sharding import param_shards

    common = [*LLAMA, *LORA, f"checkpoint.init_from={base}", "train.steps=3", "checkpoint.save_at_end=true"]
    trainer = train_in_process(
        [*common, "parallel.tp=2", "parallel.sequence_parallel=true", f"train.run_dir={tmp}/r"], True
    )
    step = f"{tmp}/r/checkpoints/step_00000003"
    if dist.get_rank() == 0:
        for fmt, extra in (("hf", ["--merge-lora"]), ("peft", [])):
            assert checkpoint_tool().main(["export", step, "--format", fmt, *extra, "--out", f"{tmp}/{fmt}"]) == 0
    dist.barrier()
    cfg = trainer.cfg
    state = initialize_parallel(tp=1)
    model = build_model(cfg.model, BuildContext(state.tp_comm, mode=LayerMode(lora=cfg.optim.lora()))).eval()
    copy_logical_tensors(model, base_weights(base, cfg.model), 0, 1, source=base)
    adapters = CheckpointWeights(step)
    with torch.no_grad():
        for name, p in model.named_parameters():
            for shard in param_shards(name, p, 0, 1) if p.lora else ():
                shard.view(p).copy_(adapters[shard.name])
        return model(IDS)[..., :256]


def test_merged_export_and_peft_adapter_give_tpframes_logits_in_transformers(tmp_path):
    """A TP=2 LoRA checkpoint: its merged HF directory in transformers, and its PEFT directory loaded with peft onto
    the base, give the logits of tpframe's TP=1 model with those adapters (fp32, 1e-5)."""
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = write_base(str(tmp_path / "base"), LLAMA, hf=True)
    ours = run_distributed(_train_export_and_forward, 2, str(tmp_path), base, timeout=300)[0]
    load = lambda path: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # noqa: E731
    with torch.no_grad():
        merged = load(tmp_path / "hf")(IDS).logits
        peft = PeftModel.from_pretrained(load(base), str(tmp_path / "peft")).eval()(IDS).logits
        plain = load(base)(IDS).logits
    torch.testing.assert_close(merged, ours, atol=1e-5, rtol=0)
    torch.testing.assert_close(peft, ours, atol=1e-5, rtol=0)
    assert (plain - ours).abs().max() > 1e-3  # the adapters trained: not the base's logits


def _train_lora(tmp: str, base: str) -> None:
    train_in_process([*LLAMA, *LORA, f"checkpoint.init_from={base}", "parallel.tp=1", "train.steps=2",
                      "checkpoint.save_at_end=true", f"train.run_dir={tmp}/r"])  # fmt: skip


def test_a_lora_checkpoint_refuses_a_base_that_is_not_the_one_it_was_trained_on(tmp_path, capsys):
    """The base's fingerprint is in the checkpoint: export (merged or PEFT) and resume refuse, in one line, a base
    directory whose weights changed since (here one weight, same shapes and file size)."""
    from safetensors.torch import load_file, save_file

    import train
    from tpframe.errors import ConfigError

    base = write_base(str(tmp_path / "base"), LLAMA, hf=True)
    run_distributed(_train_lora, 1, str(tmp_path), base, timeout=300)
    step, tool = f"{tmp_path}/r/checkpoints/step_00000002", checkpoint_tool()
    assert tool.main(["export", step, "--format", "peft", "--out", f"{tmp_path}/peft"]) == 0  # its own base
    file = os.path.join(base, "model.safetensors")
    tensors = load_file(file)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 0.01
    size = os.path.getsize(file)
    save_file(tensors, file, metadata={"format": "pt"})
    assert os.path.getsize(file) == size
    capsys.readouterr()
    message = f"the LoRA base '{base}' is not the one checkpoint '{step}' was trained on: model.safetensors has other"
    for fmt, extra in (("hf", ["--merge-lora"]), ("peft", [])):
        assert tool.main(["export", step, "--format", fmt, *extra, "--out", f"{tmp_path}/{fmt}2"]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
        assert not os.path.exists(f"{tmp_path}/{fmt}2")
    resume = [*LLAMA, *LORA, f"checkpoint.init_from={base}", "parallel.tp=1", "train.steps=4"]
    resume += ["checkpoint.auto_resume=true", f"train.run_dir={tmp_path}/r"]
    argv = merge_overrides(["--config", os.path.join(REPO, "configs", "tiny_cpu.yaml")], TINY, resume)
    with pytest.raises(ConfigError) as e:
        train.prepare(argv, world_size=1, rank=0)
    assert message.replace(f"'{step}'", f"'{tmp_path}/r/checkpoints/step_00000002'") in str(e.value), str(e.value)
