"""Config parsing and validation: every mistake is one clear ConfigError naming the key."""

import pytest

from tpframe.training.config import ConfigError, grad_accumulation_steps, load_config, validate


def _errors(overrides, world=2, path=None):
    with pytest.raises(ConfigError) as info:
        validate(load_config(path, overrides), world)
    return str(info.value)


def test_yaml_and_overrides_build_typed_sections(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  hidden: 64\n  heads: 4\noptim:\n  lr: 1e-3\ntrain:\n  global_batch_size: 32\n")
    cfg = load_config(path, ["parallel.tp=2", "train.micro_batch_size=4", "model.kv_heads=2", "optim.min_lr=0"])
    assert cfg.model.hidden == 64 and cfg.parallel.tp == 2 and cfg.model.kv_heads == 2
    assert cfg.optim.lr == 1e-3 and isinstance(cfg.optim.min_lr, float)  # YAML's "1e-3" string and int 0 coerced
    validate(cfg, world_size=4)
    assert grad_accumulation_steps(cfg, 4) == 32 // (4 * 2)


@pytest.mark.parametrize(
    "overrides,world,message",
    [
        (["model.hiden=3"], 2, "unknown config key 'model.hiden' (did you mean 'model.hidden'?)"),
        (["modle.hidden=3"], 2, "unknown config section 'modle' (did you mean 'model'?)"),
        (["train.steps=ten"], 2, "train.steps='ten' must be an integer"),
        (["parallel.sequence_parallel=3"], 2, "parallel.sequence_parallel=3 must be true or false"),
        (["model.norm=batchnorm"], 2, "model.norm='batchnorm' is not allowed; choose one of 'layernorm', 'rmsnorm'"),
        (["parallel.tp=4"], 6, "world size 6 is not divisible by parallel.tp*parallel.pp = 4*1"),
        (["parallel.tp=2", "model.heads=3", "model.hidden=96"], 2, "parallel.tp=2 does not divide model.heads=3"),
        (["parallel.tp=2", "model.heads=4", "model.kv_heads=1"], 2, "parallel.tp=2 does not divide model.kv_heads=1"),
        (["model.hidden=100", "model.heads=3"], 1, "model.hidden=100 is not divisible by model.heads=3"),
        (["parallel.tp=4", "model.ffn_hidden=130"], 4, "parallel.tp=4 does not divide model.ffn_hidden=130"),
        (
            ["train.micro_batch_size=3", "train.global_batch_size=8"],
            2,
            "train.global_batch_size=8 is not divisible by train.micro_batch_size*dp = 3*2",
        ),
        (
            ["parallel.tp=2", "parallel.sequence_parallel=true", "train.seq_len=63", "model.max_seq_len=64"],
            2,
            "needs train.seq_len=63 divisible by parallel.tp=2",
        ),
        (["train.seq_len=256"], 1, "train.seq_len=256 exceeds model.max_seq_len=128"),
        (["parallel.pp=2"], 2, "parallel.pp_schedule=1f1b needs the micro-batches per step"),
        (["data.source=tokens"], 1, "data.source=tokens needs data.path"),
        (["model.moe_expert_bias=true"], 1, "model.moe_expert_bias=True belongs to a mixture-of-experts model"),
        (
            ["model.moe_experts=4", "model.moe_expert_bias=true", "model.moe_expert_bias_rate=0"],
            1,
            "model.moe_expert_bias_rate=0.0 must be a positive number",
        ),
        (["data.source=tokens", "data.path=a.bin", "data.weights=[1]"], 1, "give data.path as a list of as many files"),
        (
            ["data.source=tokens", "data.path=[a.bin,b.bin]", "data.weights=[1]"],
            1,
            "data.weights has 1 entries but data.path lists 2",
        ),
        (["data.source=tokens", "data.path=[a.bin,b.bin]", "data.weights=[1,-1]"], 1, "must all be positive numbers"),
        (["data.path=[a.bin]"], 1, "data.path and data.weights are for data.source=tokens"),
        (["optim.lr=-1"], 1, "optim.lr=-1.0"),
        (
            ["model.rope_scaling_factor=8"],
            1,
            "model.rope_scaling_factor=8.0 scales rotary positions; set model.position",
        ),
        (
            ["model.position=rotary", "model.rope_scaling_factor=8", "model.rope_high_freq_factor=1"],
            1,
            "model.rope_high_freq_factor=1.0 must exceed model.rope_low_freq_factor=1.0",
        ),
        (
            ["model.position=rotary", "model.rope_scaling_factor=8", "model.rope_original_max_seq_len=0"],
            1,
            "model.rope_original_max_seq_len=0 must be at least 1",
        ),
        (["model.position=rotary", "model.rope_scaling_factor=0"], 1, "model.rope_scaling_factor=0 must be > 0"),
        (["model.sliding_window=0"], 1, "model.sliding_window=0 must be a number of tokens >= 1 (or null"),
        (["train.steps"], 1, "must look like section.key=value"),
        (["optim.lr=1e-3", "train.steps=3", "optim.lr=1e-3"], 1, "override optim.lr is given twice"),
    ],
)
def test_bad_config_is_one_clear_error(overrides, world, message):
    assert message in _errors(overrides, world)


def test_missing_and_malformed_files(tmp_path):
    assert "does not exist" in _errors([], path=tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    assert "is not valid YAML" in _errors([], path=bad)
    bad.write_text("model: 3\n")
    assert "config section 'model' must be a mapping" in _errors([], path=bad)


def test_qkv_bias_is_in_the_architecture_only_where_it_differs_from_bias():
    """model.qkv_bias (Qwen2's attention): a checkpoint holds q/k/v biases or not, so loading compares it; a model
    whose qkv projection follows model.bias (qkv_bias unset, or equal) keeps the keys older checkpoints hold."""
    from tpframe.models.config import ModelConfig, architecture, architecture_diffs

    plain, qwen = ModelConfig(bias=False), ModelConfig(bias=False, qkv_bias=True)
    assert "qkv_bias" not in architecture(plain) and "qkv_bias" not in architecture(ModelConfig(qkv_bias=True))
    assert architecture(qwen)["qkv_bias"] is True
    assert architecture_diffs(qwen, architecture(plain), {"bias": False}) == [("qkv_bias", True, False)]
    assert architecture_diffs(plain, architecture(qwen), {"bias": False, "qkv_bias": True}) == [
        ("qkv_bias", False, True)
    ]
    assert architecture_diffs(ModelConfig(bias=False, qkv_bias=False), architecture(plain), {"bias": False}) == []
    # a checkpoint written before the key existed: its model section has no qkv_bias
    assert architecture_diffs(ModelConfig(qkv_bias=True), architecture(ModelConfig()), {"bias": True}) == []
    assert architecture_diffs(ModelConfig(qkv_bias=False), architecture(ModelConfig()), {"bias": True}) == [
        ("qkv_bias", False, True)
    ]
