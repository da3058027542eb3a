"""Hugging Face interop: a TP=2 checkpoint exported as GPT-2 / Llama / Mixtral (a Qwen2, a Qwen3 and a Qwen3-MoE, among
others, from random weights) gives transformers' from_pretrained the
logits of tpframe's TP=1 forward; the HF directory imported at TP=2 starts from the exported model's loss;
configurations with no HF equivalent and config.json files that do not match the model are one line, exit 2."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.dist_utils import run_distributed
from tests.training_utils import REPO, TINY, merge_overrides, train_in_process

transformers = pytest.importorskip("transformers", reason="transformers is in the dev extras: pip install -e '.[dev]'")

# {architecture: (config file, overrides)}: tiny_cpu's model is GPT-2-shaped, llama_hf_cpu's Llama-shaped
ARCHS = {
    "gpt2": ("tiny_cpu.yaml", []),
    "llama": ("llama_hf_cpu.yaml", ["model.rope_theta=500.0"]),
    "mixtral": ("llama_hf_cpu.yaml", ["model.moe_experts=4", "model.moe_ffn_hidden=48"]),
}
# variants built at TP=1 from random weights (no training): the other options each architecture maps
VARIANTS = {
    "gpt2_untied_relu": dict(tie_embeddings=False, activation="relu"),
    "llama_tied_bias_mqa": dict(
        norm="rmsnorm", position="rotary", activation="swiglu", tie_embeddings=True, bias=True, kv_heads=1
    ),
    "mixtral_moe": dict(
        norm="rmsnorm",
        position="rotary",
        activation="swiglu",
        tie_embeddings=False,
        bias=False,
        kv_heads=2,
        moe_experts=4,
        moe_top_k=2,
        moe_ffn_hidden=48,
    ),
    "qwen2_tied_gqa": dict(
        norm="rmsnorm",
        position="rotary",
        activation="swiglu",
        tie_embeddings=True,
        bias=False,
        qkv_bias=True,
        kv_heads=2,
        rope_theta=1e6,
        norm_eps=1e-6,
    ),
    "qwen3_wide_heads": dict(
        norm="rmsnorm",
        position="rotary",
        activation="swiglu",
        tie_embeddings=True,
        bias=False,
        kv_heads=2,
        head_dim=12,
        qk_norm=True,
        norm_eps=1e-6,
    ),
    "qwen3moe_wide_heads": dict(
        norm="rmsnorm",
        position="rotary",
        activation="swiglu",
        tie_embeddings=False,
        bias=False,
        kv_heads=2,
        head_dim=12,
        qk_norm=True,
        norm_eps=1e-6,
        rope_theta=1e6,
        moe_experts=4,
        moe_top_k=2,
        moe_ffn_hidden=48,
    ),
    # Llama 3.1's rotary scaling, its context cut to 64: of the wavelengths 6.3, 30, 140 and 660 tokens, the
    # first is kept, the second blended (16..64) and the others stretched
    "llama_rope_scaled": dict(
        norm="rmsnorm",
        position="rotary",
        activation="swiglu",
        tie_embeddings=False,
        bias=False,
        kv_heads=2,
        rope_theta=500.0,
        rope_scaling_factor=8.0,
        rope_original_max_seq_len=64,
        max_seq_len=128,
    ),
    # sliding windows of 8 tokens on rows of 32: a windowed Llama is written as Mistral
    "mistral_window": dict(
        norm="rmsnorm",
        position="rotary",
        activation="swiglu",
        tie_embeddings=False,
        bias=False,
        kv_heads=2,
        sliding_window=8,
    ),
    "qwen2_window": dict(
        norm="rmsnorm",
        position="rotary",
        activation="swiglu",
        tie_embeddings=True,
        bias=False,
        qkv_bias=True,
        kv_heads=2,
        sliding_window=8,
    ),
    "mixtral_window": dict(
        norm="rmsnorm",
        position="rotary",
        activation="swiglu",
        tie_embeddings=False,
        bias=False,
        kv_heads=2,
        moe_experts=4,
        moe_top_k=2,
        moe_ffn_hidden=48,
        sliding_window=8,
    ),
}
HF_CLASS = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "mistral": "MistralForCausalLM",
}
IDS = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(7))


def _tool():
    spec = importlib.util.spec_from_file_location("tools_checkpoint", os.path.join(REPO, "tools", "checkpoint.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tp1_model(m, state, tensors):
    from tpframe.checkpoint.export import copy_logical_tensors
    from tpframe.models import BuildContext, build_model

    model = build_model(m, BuildContext(state.tp_comm, seed=11))
    if tensors is not None:
        copy_logical_tensors(model, tensors, 0, 1, source="test")
    return model.eval()


def _round_trip(tmp: str):
    """Train each architecture at TP=2 and export it (rank 0); the TP=1 forward of each export and of the
    random variants; import each HF directory at TP=2 (first loss); an unmappable model's checkpoint."""
    import torch.distributed as dist

    from tests.reference import gather_full_tensors
    from tpframe.checkpoint import hf
    from tpframe.checkpoint.export import read_model_tensors
    from tpframe.models.config import ModelConfig
    from tpframe.parallel import destroy_parallel, initialize_parallel

    rank, out = dist.get_rank(), {"logits": {}, "first_loss": {}}
    for arch, (config, overrides) in ARCHS.items():
        train_in_process(
            [
                *overrides,
                "parallel.tp=2",
                "train.steps=3",
                "checkpoint.save_at_end=true",
                f"train.run_dir={tmp}/{arch}",
            ],
            config=config,
        )
    train_in_process(
        [
            "model.norm=rmsnorm",
            "parallel.tp=2",
            "train.steps=1",
            "checkpoint.save_at_end=true",
            f"train.run_dir={tmp}/unmappable",
        ]
    )
    if rank == 0:
        for arch in ARCHS:
            argv = ["export", f"{tmp}/{arch}/checkpoints", "--format", "hf", "--out", f"{tmp}/{arch}/hf"]
            assert _tool().main(argv) == 0
    dist.barrier()
    state = initialize_parallel(tp=1)  # TP=1 (DP=2) models: tpframe's single-device forward
    try:
        for arch in ARCHS:
            step = f"{tmp}/{arch}/checkpoints/step_00000003"
            from tpframe.training.config import from_dict

            m = from_dict({"model": json.loads(Path(step, "meta.json").read_text())["config"]["model"]}).model
            with torch.no_grad():
                out["logits"][arch] = _tp1_model(m, state, read_model_tensors(step))(IDS)[..., : m.vocab_size]
        for name, options in VARIANTS.items():
            m = ModelConfig(**{"hidden": 32, "layers": 2, "heads": 4, "max_seq_len": 32, **options})
            model = _tp1_model(m, state, None)
            with torch.no_grad():
                for i, p in enumerate(model.parameters()):  # non-trivial norms and biases, each its own
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.1)
                out["logits"][name] = model(IDS)[..., : m.vocab_size]
            if rank == 0:
                Path(f"{tmp}/{name}").mkdir()
                from safetensors.torch import save_file

                save_file(
                    hf.to_hf(gather_full_tensors(model, state.tp_comm), m),
                    f"{tmp}/{name}/model.safetensors",
                    metadata={"format": "pt"},
                )
                Path(f"{tmp}/{name}/config.json").write_text(json.dumps(hf.hf_config(m)))
    finally:
        destroy_parallel()
    for arch, (config, overrides) in ARCHS.items():
        console = io.StringIO()
        with contextlib.redirect_stdout(console):
            imported = [
                *overrides,
                "parallel.tp=2",
                "train.steps=1",
                f"checkpoint.init_from={tmp}/{arch}/hf",
                f"train.run_dir={tmp}/{arch}_imported",
            ]
            history = train_in_process(imported, config=config)
        out["first_loss"][arch], out[f"console_{arch}"] = history[0]["loss"], console.getvalue()
    return out


def _first_batch(config, overrides, run_dir):
    """The first optimizer step's sequences (every micro-batch of the global batch, DP=1), as train.py reads them.
    `run_dir`: a fresh one (the config's own, e.g. runs/tiny_cpu, may hold the README quick start's run)."""
    sys.path.insert(0, REPO)
    import train

    argv = merge_overrides(
        ["--config", os.path.join(REPO, "configs", config)],
        TINY,
        overrides,
        ["parallel.tp=1", f"train.run_dir={run_dir}"],
    )
    cfg, data, _, _ = train.prepare(argv)
    batches = [data.next() for _ in range(cfg.train.global_batch_size // cfg.train.micro_batch_size)]
    return torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


@pytest.mark.slow
def test_hf_export_and_import_round_trip(tmp_path, capsys):
    got = run_distributed(_round_trip, 2, str(tmp_path), timeout=300)[0]
    for name in [*ARCHS, *VARIANTS]:
        directory = tmp_path / name / "hf" if name in ARCHS else tmp_path / name
        model = transformers.AutoModelForCausalLM.from_pretrained(str(directory)).eval()
        assert type(model).__name__ == HF_CLASS[name.split("_")[0]]
        with torch.no_grad():
            logits = model(IDS).logits
        torch.testing.assert_close(logits, got["logits"][name], atol=1e-4, rtol=0, msg=f"{name}: HF vs tpframe TP=1")
        if name in ARCHS:  # the HF directory imported at TP=2 starts where the exported model is
            ids, labels = _first_batch(*ARCHS[name], tmp_path / f"{name}_batch")
            with torch.no_grad():
                hf_loss = F.cross_entropy(model(ids).logits.flatten(0, 1), labels.flatten()).item()
            assert got["first_loss"][name] == pytest.approx(hf_loss, abs=1e-5), name
            assert f"initialized the weights from Hugging Face {name} model {directory}" in got[f"console_{name}"]
    # byte-level data ships a byte-level tokenizer: text <-> its UTF-8 bytes, generation stops at byte 0 (EOT)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "llama" / "hf"))
    text = "héllo  wörld\n\tĀ 🙂"
    assert tok(text)["input_ids"] == list(text.encode()) and tok.decode(list(text.encode())) == text
    assert json.loads((tmp_path / "llama" / "hf" / "config.json").read_text())["eos_token_id"] == 0

    # the export command: one summary line, no warnings (README's runner runs it as a user would, too)
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        argv = ["export", str(tmp_path / "llama/checkpoints"), "--format", "hf", "--out", str(tmp_path / "cli")]
        assert _tool().main(argv) == 0
    assert [str(w.message) for w in caught] == []
    out, err = capsys.readouterr()
    assert err == "" and out.splitlines() == [
        f"wrote a Hugging Face llama model (step 3: 21 tensors, 47,264 parameters, float32, byte-level tokenizer "
        f"files) to {tmp_path / 'cli'}"
    ]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "cli" / name).read_bytes() == (tmp_path / "llama" / "hf" / name).read_bytes()
        # readable by whoever may read the folder (safetensors itself creates its file 0600)
        assert (tmp_path / "cli" / name).stat().st_mode & 0o777 == 0o666 & ~_umask(), name

    # an unmappable model: one line, exit 2, nothing written
    argv = ["export", str(tmp_path / "unmappable/checkpoints"), "--format", "hf", "--out", str(tmp_path / "no")]
    assert _tool().main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "tpframe: model.norm=rmsnorm with model.position=learned has no Hugging Face equivalent: GPT-2 is "
        "layernorm + learned, Llama is rmsnorm + rotary"
    ]
    assert not (tmp_path / "no").exists()

    # a config.json that does not match the model section: one line, exit 2, before any process group
    sys.path.insert(0, REPO)
    import train

    argv = merge_overrides(
        ["--config", os.path.join(REPO, "configs", "llama_hf_cpu.yaml")],
        TINY,
        ARCHS["llama"][1],
        [
            "model.hidden=64",
            "model.ffn_hidden=128",
            "parallel.tp=1",
            f"checkpoint.init_from={tmp_path / 'llama/hf'}",
            f"train.run_dir={tmp_path / 'mismatch'}",
        ],
    )
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"tpframe: config error: checkpoint.init_from={str(tmp_path / 'llama/hf')!r}: its config.json "
        "describes another model: model.hidden=64 but it needs 32 (set these model.* values in the config "
        "or as overrides)"
    ]
    assert not (tmp_path / "mismatch").exists()


def test_each_option_with_no_hf_equivalent_is_named():
    from tpframe.checkpoint.hf import HFMappingError, hf_architecture
    from tpframe.models.config import ModelConfig

    for options, named in (
        (dict(name="examples.parallel_llama:build"), "model.name="),
        (dict(activation="swiglu"), "model.activation=swiglu has no GPT-2"),
        (dict(bias=False), "model.bias=false has no GPT-2"),
        (dict(kv_heads=2), "model.kv_heads=2"),
        (dict(norm="rmsnorm", position="rotary"), "model.activation=gelu has no Llama"),
        (dict(position="rotary"), "model.norm=layernorm with model.position=rotary"),
        (
            dict(norm="rmsnorm", position="rotary", activation="swiglu", bias=False, moe_experts=4, moe_shared_ffn=64),
            "model.moe_shared_ffn=64 has no Mixtral",
        ),
        (
            dict(
                norm="rmsnorm", position="rotary", activation="swiglu", bias=False, moe_experts=4, moe_expert_bias=True
            ),
            "model.moe_router_score=sigmoid and model.moe_expert_bias",
        ),
        (dict(qkv_bias=False), "model.qkv_bias=false has no GPT-2"),
        (
            dict(norm="rmsnorm", position="rotary", activation="swiglu", bias=True, qkv_bias=False),
            "model.bias=true with model.qkv_bias=false has no Hugging Face equivalent",
        ),
        (
            dict(norm="rmsnorm", position="rotary", activation="swiglu", bias=False, qkv_bias=True, moe_experts=4),
            "model.qkv_bias=true has no Mixtral",
        ),
        (dict(sliding_window=8), "model.sliding_window=8 has no GPT-2"),
        (
            dict(norm="rmsnorm", position="rotary", activation="swiglu", sliding_window=8),
            "model.sliding_window=8 with model.bias=true has no Hugging Face equivalent",
        ),
        (
            dict(
                norm="rmsnorm",
                position="rotary",
                activation="swiglu",
                bias=False,
                sliding_window=8,
                rope_scaling_factor=8.0,
            ),
            "model.rope_scaling_factor=8.0 has no Mistral",
        ),
        (dict(head_dim=16), "model.head_dim=16 has no GPT-2"),
        (dict(qk_norm=True), "model.qk_norm=true has no GPT-2"),
        (
            dict(norm="rmsnorm", position="rotary", activation="swiglu", qk_norm=True),
            "model.qk_norm=true maps to Qwen3, which has no biases",
        ),
        # query/key norms with experts are Qwen3-MoE: no biases, no shared expert, no llama3 rotary
        (
            dict(norm="rmsnorm", position="rotary", activation="swiglu", qk_norm=True, moe_experts=4),
            "model.bias=true has no Qwen3-MoE equivalent",
        ),
        (
            dict(
                norm="rmsnorm",
                position="rotary",
                activation="swiglu",
                bias=False,
                qk_norm=True,
                moe_experts=4,
                moe_shared_ffn=64,
            ),
            "model.moe_shared_ffn=64 has no Qwen3-MoE",
        ),
        (
            dict(
                norm="rmsnorm",
                position="rotary",
                activation="swiglu",
                bias=False,
                qk_norm=True,
                moe_experts=4,
                rope_scaling_factor=8.0,
            ),
            "model.rope_scaling_factor=8.0 has no Qwen3-MoE",
        ),
    ):
        with pytest.raises(HFMappingError) as e:
            hf_architecture(ModelConfig(**options))
        assert str(e.value).startswith(named) and "\n" not in str(e.value), str(e.value)


def test_the_runs_tokenizer_ships_with_the_export(tmp_path):
    """A run whose token file was made with a `tokenizers` JSON exports it: AutoTokenizer reads it, same ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from tpframe.checkpoint.hf_export import tokenizer_record, write_tokenizer
    from tpframe.data.tokenizer import write_token_file

    text = "the cat sat on the mat . the dog sat on the log ."
    vocab = {"<unk>": 0, "<|endoftext|>": 1, **{w: i + 2 for i, w in enumerate(sorted(set(text.split())))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    (tmp_path / "a.txt").write_text(text)
    write_token_file([tmp_path / "a.txt"], tmp_path / "data.bin", tokenizer=tmp_path / "tok.json")
    warnings = []
    record = tokenizer_record({"data": {"source": "tokens", "path": str(tmp_path / "data.bin")}}, warnings.append)
    assert record["eot_token"] == "<|endoftext|>" and record["eot_id"] == 1 and warnings == []
    blend = {"data": {"source": "tokens", "path": [str(tmp_path / "data.bin"), "b.bin"]}}  # a blend: its first file's
    assert tokenizer_record(blend, warnings.append) == record
    (tmp_path / "hf").mkdir()
    write_tokenizer(tmp_path / "hf", record, model_max_length=32)
    loaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert loaded("the dog sat")["input_ids"] == tok.encode("the dog sat").ids
    assert loaded.eos_token == "<|endoftext|>" and loaded.model_max_length == 32
    # byte-level data (an embedded corpus, a byte-level token file) has the byte-level tokenizer; a tokenizer file
    # changed since the data was made is not shipped
    assert tokenizer_record({"data": {"source": "synthetic"}}, warnings.append)["kind"] == "bytes" and warnings == []
    write_token_file([tmp_path / "a.txt"], tmp_path / "bytes.bin")
    assert tokenizer_record({"data": {"source": "tokens", "path": str(tmp_path / "bytes.bin")}}, warnings.append) == {
        "kind": "bytes",
        "eot_id": 0,
    }
    (tmp_path / "tok.json").write_text((tmp_path / "tok.json").read_text().replace("mat", "rug"))
    assert tokenizer_record({"data": {"source": "tokens", "path": str(tmp_path / "data.bin")}}, warnings.append) is None
    assert len(warnings) == 1 and "has changed since the data was made" in warnings[0]


def test_init_from_is_checked_before_anything_starts(tmp_path):
    """A consolidated export of another model, a directory that is neither export nor HF model: one clear error."""
    from safetensors.torch import save_file

    from tpframe.checkpoint.files import CheckpointError
    from tpframe.checkpoint.init_from import check_init_from
    from tpframe.training.config import load_config

    cfg = load_config(
        os.path.join(REPO, "configs", "tiny_cpu.yaml"), [f"checkpoint.init_from={tmp_path / 'm.safetensors'}"]
    )
    other = dict(cfg.to_dict()["model"], hidden=64)
    save_file(
        {"x": torch.zeros(1)},
        str(tmp_path / "m.safetensors"),
        metadata={"format": "tpframe", "model_config": json.dumps(other)},
    )
    with pytest.raises(
        CheckpointError,
        match="holds another model: model.ffn_hidden=512 but the file has 256; model.hidden=128 but the file has 64",
    ):
        check_init_from(cfg)
    cfg.checkpoint.init_from = str(tmp_path)
    with pytest.raises(CheckpointError, match="a directory without config.json"):
        check_init_from(cfg)
    cfg.checkpoint.init_from = str(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="does not exist"):
        check_init_from(cfg)


def _hf_models(tmp: Path) -> dict[str, Path]:
    """HF model directories as from the hub, random weights: GPT-2 with tpframe's byte-level tokenizer.json, a GQA
    Llama (Llama 3.1's rotary scaling) with a word-level tokenizer.json whose end-of-text token tokenizer_config.json
    names, a Mixtral, a Qwen2 (random q/k/v biases; transformers starts them at zero), a Qwen3 (heads of 12, random
    q/k norms), a Qwen3-MoE (likewise; 4 experts top 2, weights that steer the tokens; untied) and a Mistral, of
    vocabulary 256 and no tokenizer files (byte-level)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from tpframe.data.tokenizer import ByteTokenizer

    torch.manual_seed(3)
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=64, eos_token_id=0, bos_token_id=0
        )
    )
    gpt2.save_pretrained(tmp / "gpt2")
    (tmp / "gpt2" / "tokenizer.json").write_text(json.dumps(ByteTokenizer.hf_json()))
    llama3_rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }  # Llama 3.1's scaling, at a context where it shows
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=300,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            rope_theta=500.0,
            rope_scaling=llama3_rope,
            eos_token_id=1,
        )
    )
    with torch.no_grad():  # queries and keys large enough that the positions (and their scaling) steer the tokens
        for name, p in llama.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.normal_(0, 0.5)
    llama.save_pretrained(tmp / "llama")
    words = {"<unk>": 0, "<|endoftext|>": 1, **{f"w{i}": i + 2 for i in range(298)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp / "llama" / "tokenizer.json"))
    (tmp / "llama" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    mixtral = transformers.MixtralForCausalLM(
        transformers.MixtralConfig(
            vocab_size=256,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=64,
            sliding_window=None,
            eos_token_id=0,
        )
    )
    with torch.no_grad():  # router and experts large enough that a swapped expert tensor changes the tokens
        for name, p in mixtral.named_parameters():
            if ".experts." in name or name.endswith("gate.weight"):
                p.normal_(0, 0.3)
    mixtral.save_pretrained(tmp / "mixtral")  # no tokenizer.json: vocabulary 256 is byte-level
    qwen2 = transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(
            vocab_size=256,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=True,
            use_sliding_window=False,
            rope_theta=1e6,
            eos_token_id=0,
        )
    )
    with torch.no_grad():
        for name, p in qwen2.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    qwen2.save_pretrained(tmp / "qwen2")
    qwen3 = transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(
            vocab_size=256,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=12,
            max_position_embeddings=64,
            tie_word_embeddings=True,
            eos_token_id=0,
        )
    )
    with torch.no_grad():
        for name, p in qwen3.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):  # transformers starts them at one
                p.normal_(1, 0.5)
    qwen3.save_pretrained(tmp / "qwen3")
    qwen3_moe = transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(
            vocab_size=256,
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=12,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            eos_token_id=0,
        )
    )
    with torch.no_grad():
        for name, p in qwen3_moe.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.normal_(1, 0.5)
            elif ".mlp." in name:  # the router and experts: at transformers' 0.02 they hardly move the greedy tokens
                p.normal_(0, 0.3)
    qwen3_moe.save_pretrained(tmp / "qwen3_moe")  # the experts one tensor each, config.json's num_local_experts=4
    mistral = transformers.MistralForCausalLM(
        transformers.MistralConfig(
            vocab_size=256,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            sliding_window=6,
            eos_token_id=0,
        )
    )
    with torch.no_grad():  # queries and keys large enough that what the window hides steers the tokens
        for name, p in mistral.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.normal_(0, 0.5)
    mistral.save_pretrained(tmp / "mistral")  # Mistral 7B v0.1's sliding window (6 here): generation goes past it
    phi3 = transformers.Phi3ForCausalLM(
        transformers.Phi3Config(
            vocab_size=256,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            sliding_window=None,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
    )
    with torch.no_grad():  # fused q/k/v and gate/up tensors, weights large enough that a swapped part shows
        for name, p in phi3.named_parameters():
            if name.endswith(("qkv_proj.weight", "gate_up_proj.weight")):
                p.normal_(0, 0.3)
    phi3.save_pretrained(tmp / "phi3")
    return {name: tmp / name for name in ("gpt2", "llama", "mixtral", "qwen2", "qwen3", "qwen3_moe", "mistral", "phi3")}


def _generate_from_hf_dirs(dirs: dict, prompts: dict):
    sys.path.insert(0, REPO)
    import generate as cli

    out = {}
    for name, path in dirs.items():
        plan = cli.prepare(
            ["--checkpoint", str(path), "--prompt", prompts[name], "--max-new-tokens", "10", "--greedy", "--ignore-eos"]
        )
        out[name] = (
            plan.source.kind,
            type(plan.tokenizer).__name__,
            plan.tokenizer.eot_id,
            plan.prompt_ids,
            cli.run(plan)[0]["token_ids"],
        )
    return out


def test_generate_reads_a_hugging_face_model_directory_at_tp1_and_tp2(hf_dirs):
    """generate.py --checkpoint <HF dir>: the greedy tokens transformers' own generate gives, at TP 1 and 2, with the
    directory's tokenizer (tpframe's byte-level tokenizer.json is the built-in one; another names its EOT)."""
    dirs = hf_dirs
    prompts = {
        "gpt2": "héllo wörld",
        "llama": "w5 w17 w200 w3",
        "mixtral": "experts",
        "qwen2": "biased",
        "qwen3": "normed",
        "qwen3_moe": "routed",
        "mistral": "wind",
        "phi3": "fused",
    }
    tp2 = run_distributed(_generate_from_hf_dirs, 2, dirs, prompts, timeout=120)[0]
    tp1 = run_distributed(_generate_from_hf_dirs, 1, dirs, prompts, timeout=120)[0]
    for name, path in dirs.items():
        kind, tokenizer, eot, ids, generated = tp2[name]
        assert kind == "hf" and tp1[name][4] == generated, name
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()
        model.generation_config.eos_token_id = None  # --ignore-eos
        with torch.no_grad():
            reference = model.generate(torch.tensor([ids[0]]), max_new_tokens=10, do_sample=False)[0, len(ids[0]) :]
        assert generated == reference.tolist(), name
    assert tp2["gpt2"][1:4] == ("ByteTokenizer", 0, [list("héllo wörld".encode())])
    assert tp2["llama"][1:4] == ("HFTokenizer", 1, [[7, 19, 202, 5]])
    assert all(
        tp2[name][1:3] == ("ByteTokenizer", 0) for name in ("mixtral", "qwen2", "qwen3", "qwen3_moe", "mistral", "phi3")
    )


def test_a_hugging_face_directory_generate_cannot_use_is_one_line(hf_dirs, tmp_path, capsys):
    sys.path.insert(0, REPO)
    import generate as cli

    dirs = _hf_copies(hf_dirs, tmp_path)
    (dirs["llama"] / "tokenizer.json").unlink()
    capsys.readouterr()  # transformers' save_pretrained progress bars
    assert cli.main(["--checkpoint", str(dirs["llama"]), "--prompt", "w1"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"tpframe: error: {str(dirs['llama'])!r} has no tokenizer.json and its vocabulary is 300, not byte-level "
        "(256); pass --tokenizer FILE"
    ]
    config = json.loads((dirs["gpt2"] / "config.json").read_text())
    (dirs["gpt2"] / "config.json").write_text(json.dumps({**config, "n_layer": 3}))
    assert cli.main(["--checkpoint", str(dirs["gpt2"]), "--prompt", "a"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"tpframe: error: --checkpoint {str(dirs['gpt2'])!r}: no tensor 'transformer.h.2.ln_1.weight' in its safetensors "  # noqa: E501
        "(12 missing); it does not hold the model its config.json describes"
    ]


def _init_from_inspected(dirs: dict, tmp: str):
    """checkpoint.init_from=<HF dir> with the model.* overrides `tools/checkpoint.py inspect` printed for it."""
    out = {}
    for name, path in dirs.items():
        model = next(line for line in _tool().inspected(str(path)).splitlines() if line.startswith("model "))
        history = train_in_process(
            [
                *model.split()[1:],
                "train.steps=1",
                "train.seq_len=16",
                "train.micro_batch_size=2",
                "train.global_batch_size=2",
                f"checkpoint.init_from={path}",
                f"train.run_dir={tmp}/{name}",
            ]
            + ([] if "model.max_seq_len" in model else ["model.max_seq_len=16"])
        )
        out[name] = history[0]["loss"]
    return out


def test_inspect_names_the_model_an_hf_directory_needs(hf_dirs, tmp_path):
    """`tools/checkpoint.py inspect <HF dir>`: the model.* overrides (pasted, they start a run from it), the context a
    rotary model may use, the tokenizer, every tensor."""
    dirs = hf_dirs
    text = {name: _tool().inspected(str(path)).splitlines() for name, path in dirs.items()}
    assert text["gpt2"][1] == (
        "model       model.vocab_size=256 model.hidden=32 model.layers=2 model.heads=4 "
        "model.kv_heads=4 model.ffn_hidden=128 model.max_seq_len=64 model.norm=layernorm "
        "model.norm_eps=1e-05 model.position=learned model.activation=gelu model.bias=true "
        "model.tie_embeddings=true"
    )
    assert text["llama"][2:4] == [
        "context     model.max_seq_len up to 64 (max_position_embeddings)",
        "tokenizer   tokenizer.json, end-of-text '<|endoftext|>'",
    ]
    assert text["mixtral"][3] == "tokenizer   none: byte-level (vocabulary 256)"
    assert text["qwen2"][0].endswith("(qwen2, Qwen2ForCausalLM)") and "model.bias=false" in text["qwen2"][1]
    assert text["qwen2"][1].endswith("model.qkv_bias=true") and "qkv_bias" not in text["mistral"][1]
    assert text["mistral"][1].endswith("model.tie_embeddings=false model.sliding_window=6")
    assert text["mistral"][2] == "context     model.max_seq_len up to 64 (max_position_embeddings)"
    assert text["phi3"][0].endswith(
        "(phi3, Phi3ForCausalLM)"
    ) and "  model.layers.0.mlp.gate_up_proj.weight" in " ".join(text["phi3"])
    assert text["qwen3"][1].endswith("model.head_dim=12 model.qk_norm=true")
    assert (
        text["qwen3_moe"][0].endswith("(qwen3_moe, Qwen3MoeForCausalLM)")
        and text["qwen3_moe"][1].endswith(
            "model.tie_embeddings=false model.head_dim=12 model.qk_norm=true model.moe_experts=4 model.moe_top_k=2 "
            "model.moe_ffn_hidden=48"
        )
        and "ffn_hidden=64" not in text["qwen3_moe"][1]
    )
    assert "model.rope_theta=500.0" in text["llama"][1] and text["llama"][1].endswith(
        "model.rope_scaling_factor=8.0 model.rope_low_freq_factor=1.0 model.rope_high_freq_factor=4.0 "
        "model.rope_original_max_seq_len=16"
    )
    assert sum(line.startswith("  model.layers.") for line in text["llama"]) == 18
    losses = run_distributed(_init_from_inspected, 2, dirs, str(tmp_path / "runs"), timeout=120)[0]  # at TP=2
    assert all(4.0 < loss < 7.0 for loss in losses.values()), losses  # random HF weights: about ln(vocab)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """_hf_models built once for the module: tests that only read them take these; a test that changes one works on
    its own copy (_hf_copies)."""
    return _hf_models(tmp_path_factory.mktemp("hf"))


def _hf_copies(hf_dirs: dict, tmp: Path) -> dict[str, Path]:
    """The module's HF directories copied under `tmp`, for a test to change."""
    import shutil

    for name, path in hf_dirs.items():
        shutil.copytree(path, tmp / name)
    return {name: tmp / name for name in hf_dirs}


def _config(**changes):
    """A mutation of an HF directory: config.json with `changes`."""

    def edit(d: Path):
        config = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**config, **changes}))

    return edit


def _without(*keys):
    """A mutation of an HF directory: config.json without `keys` (transformers' defaults apply)."""

    def edit(d: Path):
        config = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k not in keys}))

    return edit


def _tensors(fn):
    """A mutation of an HF directory: model.safetensors rewritten by `fn` (tensors -> tensors)."""

    def edit(d: Path):
        from safetensors.torch import load_file, save_file

        save_file(fn(load_file(str(d / "model.safetensors"))), str(d / "model.safetensors"))

    return edit


def _write(name, text):
    def edit(d: Path):
        (d / name).write_bytes(text if isinstance(text, bytes) else text.encode())

    return edit


SHARD = "model-00001-of-00001.safetensors"


def _index(weight_map=None, text=None):
    """model.safetensors.index.json: `text`, or a weight_map naming the shard model.safetensors becomes (or
    `weight_map(names)`)."""

    def edit(d: Path):
        from safetensors import safe_open

        with safe_open(str(d / "model.safetensors"), framework="pt") as f:
            names = list(f.keys())
        (d / "model.safetensors").rename(d / SHARD)
        body = text if text is not None else json.dumps({"weight_map": weight_map(names)})
        (d / "model.safetensors.index.json").write_text(body)

    return edit


BROKEN = {  # name: (directory, mutation, what the one line says)
    "config_not_utf8": ("gpt2", _write("config.json", b"\xff\xfe{"), "config.json is not valid JSON"),
    "rope_parameters_string": ("llama", _config(rope_parameters="yes"), "rope_parameters='yes' must be an object"),
    "heads_zero": ("llama", _config(num_attention_heads=0, head_dim=None), "num_attention_heads=0 must be a positive"),
    "n_embd_null": ("gpt2", _config(n_embd=None), "n_embd=None must be a positive integer"),
    "vocab_string": ("gpt2", _config(vocab_size="256"), "vocab_size='256' must be a positive integer"),
    "vocab_zero": ("gpt2", _config(vocab_size=0), "vocab_size=0 must be a positive integer"),
    "heads_not_dividing": ("gpt2", _config(n_head=3), "n_head=3 does not divide n_embd=32"),
    "kv_heads_not_dividing": ("llama", _config(num_key_value_heads=3), "num_key_value_heads=3 does not divide"),
    "top_k_over_experts": ("mixtral", _config(num_experts_per_tok=9), "num_experts_per_tok=9 exceeds"),
    "sliding_window_string": (
        "mixtral",
        _config(sliding_window="4096"),
        "its config.json: sliding_window='4096' must be a positive integer",
    ),
    "qwen3_attention_bias": ("qwen3", _config(attention_bias=True), "attention_bias=True in a Qwen3 has no tpframe"),
    "head_dim_odd": ("llama", _config(head_dim=7), "head_dim=7 gives an odd head dim, 7"),
    "rope_yarn": (
        "llama",
        _config(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 500.0}),
        "rope scaling 'yarn' has no tpframe equivalent",
    ),
    "rope_llama3_in_qwen2": (
        "qwen2",
        _config(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e6}),
        "rope scaling 'llama3' has no tpframe equivalent",
    ),
    "rope_llama3_no_factor": (
        "llama",
        _config(rope_parameters={"rope_type": "llama3", "rope_theta": 500.0}),
        "rope_parameters: the llama3 scaling's factor=None must be a positive number",
    ),
    "rope_llama3_bands": (
        "llama",
        _config(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500.0,
                "factor": 8.0,
                "low_freq_factor": 4.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        ),
        "the llama3 scaling's high_freq_factor=4.0 must exceed its low_freq_factor=4.0",
    ),
    "partial_rotary": (
        "phi3",
        _config(partial_rotary_factor=0.75),
        "its config.json: partial_rotary_factor=0.75 has no tpframe equivalent",
    ),
    "sliding_window_zero": (
        "mistral",
        _config(sliding_window=0),
        "its config.json: sliding_window=0 must be a positive",
    ),
    "sliding_window_qwen2_sizeless": (
        "qwen2",
        _config(use_sliding_window=True, sliding_window=None),
        "its config.json: use_sliding_window=true without a sliding_window size",
    ),
    "sliding_window_qwen3_moe_string": (
        "qwen3_moe",
        _config(use_sliding_window="yes"),
        "its config.json: use_sliding_window='yes' must be true or false",
    ),
    "qwen3_moe_not_renormalized": (
        "qwen3_moe",
        _config(norm_topk_prob=False),
        "norm_topk_prob=False has no tpframe equivalent (tpframe's softmax router renormalizes",
    ),
    "qwen3_moe_renormalization_unsaid": (
        "qwen3_moe",
        _without("norm_topk_prob"),  # transformers' default: false
        "norm_topk_prob=False has no tpframe equivalent",
    ),
    "qwen3_moe_sparse_step": (
        "qwen3_moe",
        _config(decoder_sparse_step=2),
        "decoder_sparse_step=2 makes some layers dense MLPs",
    ),
    "qwen3_moe_mlp_only_layers": (
        "qwen3_moe",
        _config(mlp_only_layers=[0]),
        "mlp_only_layers=[0] makes those layers dense MLPs",
    ),
    "qwen3_moe_experts_twice": (
        "qwen3_moe",
        _config(num_experts=8),
        "num_experts=8 with num_local_experts=4: transformers names one count both ways",
    ),
    "index_not_json": ("gpt2", _index(text="{{"), "index.json is not valid JSON"),
    "index_no_weight_map": ("gpt2", _index(text="[]"), 'has no "weight_map" object'),
    "index_wrong_file": (
        "gpt2",
        _index(lambda names: dict.fromkeys([*names, "x"], SHARD)),
        f"puts 'x' in {SHARD}, which does not hold it",
    ),
    "weights_truncated": (
        "gpt2",
        _write("model.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{}"),
        "model.safetensors is not a readable safetensors file",
    ),
    "weights_fp8": (
        "gpt2",
        _tensors(lambda t: {k: v.to(torch.float8_e4m3fn) for k, v in t.items()}),
        "is F8_E4M3; tpframe reads F32, BF16, F16, F64 weights",
    ),
    "tokenizer_not_one": ("llama", _write("tokenizer.json", '{"a": 1}'), "tokenizer.json' could not be loaded"),
    "tokenizer_config_garbage": (
        "llama",
        _write("tokenizer_config.json", "garbage"),
        "tokenizer_config.json' is not valid JSON",
    ),
    "eos_token_unknown": (
        "llama",
        _write("tokenizer_config.json", '{"eos_token": "</nope>"}'),
        "eos_token='</nope>' is not a token of tokenizer.json",
    ),
    "eos_token_id_unknown": (
        "llama",
        lambda d: (_config(eos_token_id=99999)(d), (d / "tokenizer_config.json").unlink()),
        "eos_token_id=99999 is not a token of tokenizer.json (vocabulary 300)",
    ),
    "eos_token_id_not_a_byte": ("mixtral", _config(eos_token_id=50256), "eos_token_id=50256 is not a byte (0..255)"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_hugging_face_directory_is_one_line_for_generate_and_inspect(case, hf_dirs, tmp_path, capsys):
    """config.json, the weights, the tokenizer files: each mistake one `tpframe:` line (exit 2) naming it, from
    generate.py and from tools/checkpoint.py inspect alike; never a traceback, never a model built on it."""
    import shutil

    sys.path.insert(0, REPO)
    import generate as cli
    from tpframe.errors import ConfigError

    base, mutate, says = BROKEN[case]
    d = tmp_path / base
    shutil.copytree(hf_dirs[base], d)
    mutate(d)
    with pytest.raises(ConfigError) as e:
        cli.prepare(["--checkpoint", str(d), "--prompt", "w1", "--max-new-tokens", "2"], world_size=1)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)
    capsys.readouterr()
    assert _tool().main(["inspect", str(d)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("tpframe: ") and says in err[0], err


def test_model_safetensors_wins_over_a_stale_index_beside_it_as_in_transformers(hf_dirs, tmp_path):
    """export --format hf --force onto a sharded model keeps its index and shards: generate.py and inspect read those
    stale weights while transformers reads the new model.safetensors."""
    import shutil

    from safetensors.torch import load_file, save_file

    from tpframe.checkpoint.hf import weight_files

    d = tmp_path / "gpt2"
    shutil.copytree(hf_dirs["gpt2"], d)
    stale = {k: v * 2 for k, v in load_file(str(d / "model.safetensors")).items()}
    save_file(stale, str(d / SHARD))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(stale, SHARD)}))
    assert set(weight_files(d).values()) == {d / "model.safetensors"}
    model = transformers.AutoModelForCausalLM.from_pretrained(str(d))
    fresh = load_file(str(d / "model.safetensors"))
    assert all(torch.equal(v, fresh[k]) for k, v in model.state_dict().items() if k in fresh)


def test_what_generate_takes_from_an_unusual_hugging_face_directory(hf_dirs, tmp_path):
    """A context of 10**9 builds a rotary table of just the generation's length; config.json's eos_token_id is the
    end-of-text (the first of a list, as Llama 3's; a byte for a byte-level model); a TP size must divide each
    expert's FFN; --eot-token names a --tokenizer's end-of-text; a file of the directory names the directory; NULs
    dropped by the byte-level tokenizer.json too."""
    import dataclasses

    from tokenizers import Tokenizer, models

    sys.path.insert(0, REPO)
    import generate as cli
    from tpframe.checkpoint.hf import is_hf_dir
    from tpframe.data.tokenizer import ByteTokenizer
    from tpframe.errors import ConfigError

    d = _hf_copies(hf_dirs, tmp_path)
    _config(max_position_embeddings=10**9, eos_token_id=[1, 0])(d["llama"])
    (d["llama"] / "tokenizer_config.json").unlink()
    plan = cli.prepare(["--checkpoint", str(d["llama"]), "--prompt", "w1 w2", "--max-new-tokens", "4"], world_size=1)
    assert plan.source.model.max_seq_len == 10**9 and plan.model.max_seq_len == 16 and plan.tokenizer.eot_id == 1
    _config(eos_token_id=5)(d["mixtral"])
    plan = cli.prepare(["--checkpoint", str(d["mixtral"]), "--prompt", "", "--max-new-tokens", "4"], world_size=1)
    assert plan.tokenizer.eot_id == 5 and plan.prompt_ids == [[5]]
    with pytest.raises(ConfigError, match="size 2 does not divide each expert's FFN size = 49"):
        cli.check_tp(dataclasses.replace(plan.source.model, moe_ffn_hidden=49), 2)
    Tokenizer(models.WordLevel({"<unk>": 0, "w1": 1, "w2": 2}, unk_token="<unk>")).save(str(tmp_path / "tok.json"))
    argv = ["--checkpoint", str(d["llama"]), "--prompt", "w1", "--tokenizer", str(tmp_path / "tok.json")]
    with pytest.raises(ConfigError, match="has no end-of-text token among .*; pass --eot-token"):
        cli.prepare(argv, world_size=1)
    assert cli.prepare([*argv, "--eot-token", "w2"], world_size=1).tokenizer.eot_id == 2  # generate.py has it too
    with pytest.raises(ConfigError, match="is a file of the Hugging Face model directory .*; pass the directory"):
        cli.prepare(["--checkpoint", str(d["gpt2"] / "config.json"), "--prompt", "a"], world_size=1)
    (d["gpt2"] / "meta.json").write_text("{}")  # a tpframe checkpoint's file: generate, inspect, init_from agree
    assert not is_hf_dir(d["gpt2"])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(ByteTokenizer.hf_json())))
    assert tok("a\0b")["input_ids"] == list(ByteTokenizer().encode("a\0b")) == [97, 98]


def _greedy(path: str, *extra):
    sys.path.insert(0, REPO)
    import generate as cli

    plan = cli.prepare(
        ["--checkpoint", path, "--prompt", "w5 w17 w200 w3", "--max-new-tokens", "10", "--greedy", *extra]
    )
    return plan.stop_ids, cli.run(plan)[0]["token_ids"]


def test_generation_stops_at_any_of_config_jsons_eos_ids(hf_dirs, tmp_path):
    """Llama 3 names several end tokens (config.json's eos_token_id list): generation stops at the first of any, as
    transformers' does; the output ends before it."""
    path = _hf_copies(hf_dirs, tmp_path)["llama"]
    _, free = run_distributed(_greedy, 1, str(path), "--ignore-eos", timeout=60)[0]
    stop = free[3]  # a token greedy decoding reaches at the 4th step
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "eos_token_id": [1, stop]}))
    stops, tokens = run_distributed(_greedy, 1, str(path), timeout=60)[0]
    assert stops == sorted({1, stop}) and tokens == free[: free.index(stop)]


def test_prepare_data_takes_an_hf_model_directorys_tokenizer(hf_dirs, tmp_path, capsys):
    """tools/prepare_data.py --tokenizer <HF dir>: its tokenizer.json and end-of-text token (tpframe's byte-level
    tokenizer.json is the built-in one); a directory without one is one line, exit 2."""
    spec = importlib.util.spec_from_file_location("prepare_data", os.path.join(REPO, "tools", "prepare_data.py"))
    prepare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare)
    dirs = hf_dirs
    (tmp_path / "c.txt").write_text("w5 w17 w200 w3")
    assert (
        prepare.main([str(tmp_path / "c.txt"), "--tokenizer", str(dirs["llama"]), "--out", str(tmp_path / "l.bin")])
        == 0
    )
    meta = json.loads((tmp_path / "l.bin.json").read_text())
    assert meta["tokenizer"]["file"] == str(dirs["llama"] / "tokenizer.json") and meta["eot_id"] == 1
    assert meta["num_tokens"] == 5 and meta["vocab_size"] == 300
    assert (
        prepare.main([str(tmp_path / "c.txt"), "--tokenizer", str(dirs["gpt2"]), "--out", str(tmp_path / "b.bin")]) == 0
    )
    assert json.loads((tmp_path / "b.bin.json").read_text())["tokenizer"]["kind"] == "bytes"
    capsys.readouterr()
    assert (
        prepare.main([str(tmp_path / "c.txt"), "--tokenizer", str(dirs["mixtral"]), "--out", str(tmp_path / "m.bin")])
        == 2
    )
    assert capsys.readouterr().err.strip().splitlines() == [
        f"prepare_data.py: error: --tokenizer {str(dirs['mixtral'])!r} is a directory without a tokenizer.json; pass a "
        "model directory that has one, or the tokenizer.json file"
    ]
    assert not (tmp_path / "m.bin").exists()


def test_eot_token_overrides_what_an_hf_directory_says(hf_dirs, tmp_path, capsys):
    """--tokenizer with --eot-token replaces an HF directory's own end-of-text detection (generate.py and
    prepare_data.py): a tokenizer.json whose end token has an unusual name, and config.json's eos_token_id outside
    the vocabulary, do not stand in the way of a user who names the token; a name that is not a token is one line."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    sys.path.insert(0, REPO)
    import generate as cli
    from tpframe.errors import ConfigError

    path = _hf_copies(hf_dirs, tmp_path)["llama"]
    words = {"<unk>": 0, "<END>": 1, **{f"w{i}": i + 2 for i in range(298)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").unlink()
    _config(eos_token_id=50256)(path)  # GPT2Config's default, outside this vocabulary of 300
    argv = ["--checkpoint", str(path), "--prompt", "w1 w2", "--max-new-tokens", "4"]
    with pytest.raises(ConfigError, match="eos_token_id=50256 is not a token of tokenizer.json"):
        cli.prepare(argv, world_size=1)
    plan = cli.prepare([*argv, "--tokenizer", str(path / "tokenizer.json"), "--eot-token", "<END>"], world_size=1)
    assert plan.tokenizer.eot_id == 1 and plan.stop_ids == [1]

    spec = importlib.util.spec_from_file_location("prepare_data", os.path.join(REPO, "tools", "prepare_data.py"))
    prepare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare)
    (tmp_path / "c.txt").write_text("w5 w17 w200 w3")
    out = ["--out", str(tmp_path / "l.bin")]
    assert prepare.main([str(tmp_path / "c.txt"), "--tokenizer", str(path), "--eot-token", "<END>", *out]) == 0
    assert json.loads((tmp_path / "l.bin.json").read_text())["eot_id"] == 1
    capsys.readouterr()
    bad = ["--out", str(tmp_path / "x.bin")]
    assert prepare.main([str(tmp_path / "c.txt"), "--tokenizer", str(path), "--eot-token", "<EOS>", *bad]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"prepare_data.py: error: --eot-token '<EOS>' is not a token of {str(path / 'tokenizer.json')!r}; name one of "
        "its tokens"
    ]
    assert not (tmp_path / "x.bin").exists()


def test_a_rotary_scaling_that_differs_from_config_json_is_named(hf_dirs):
    """checkpoint.init_from=<HF dir>: Llama 3.1's rotary scaling is part of the model the directory describes."""
    from tpframe.checkpoint.hf import HFMappingError, check_model_matches, read_config
    from tpframe.models.config import ModelConfig

    shape = dict(
        vocab_size=300,
        hidden=32,
        layers=2,
        heads=4,
        kv_heads=2,
        ffn_hidden=64,
        norm="rmsnorm",
        norm_eps=1e-6,
        position="rotary",
        activation="swiglu",
        bias=False,
        tie_embeddings=False,
        rope_theta=500.0,
        max_seq_len=32,
    )
    config = read_config(hf_dirs["llama"])
    check_model_matches(ModelConfig(**shape, rope_scaling_factor=8.0, rope_original_max_seq_len=16), config, "x")
    with pytest.raises(
        HFMappingError,
        match=r"model.rope_scaling_factor=null but it needs 8.0; "
        r"model.rope_original_max_seq_len=8192 but it needs 16 \(set these",
    ):
        check_model_matches(ModelConfig(**shape), config, "x")
    with pytest.raises(HFMappingError, match="model.rope_scaling_factor=8.0 but it needs null"):
        check_model_matches(ModelConfig(**shape, rope_scaling_factor=8.0), read_config(hf_dirs["mistral"]), "x")


def test_experts_that_differ_from_config_json_are_named():
    """A dense directory needs a dense model; a Mixtral or Qwen3-MoE directory needs their router, without a shared
    expert: each difference named before anything starts (not a missing tensor, or an export's refusal, later)."""
    from tpframe.checkpoint.hf import HFMappingError, check_model_matches, hf_config
    from tpframe.models.config import ModelConfig

    shape = dict(
        vocab_size=256,
        hidden=32,
        layers=2,
        heads=4,
        kv_heads=2,
        norm="rmsnorm",
        position="rotary",
        activation="swiglu",
        bias=False,
        tie_embeddings=False,
        max_seq_len=64,
    )
    dense = hf_config(ModelConfig(**shape, ffn_hidden=64))
    with pytest.raises(HFMappingError, match="model.moe_experts=4 but it needs 0"):
        check_model_matches(ModelConfig(**shape, ffn_hidden=64, moe_experts=4), dense, "x")
    for qk_norm in (False, True):  # Mixtral, Qwen3-MoE
        moe = dict(shape, moe_experts=4, moe_ffn_hidden=48, qk_norm=qk_norm)
        config = hf_config(ModelConfig(**moe))
        check_model_matches(ModelConfig(**moe), config, "x")
        for extra, named in (
            (dict(moe_shared_ffn=32), "model.moe_shared_ffn=32 but it needs 0"),
            (dict(moe_router_score="sigmoid"), "model.moe_router_score=sigmoid but it needs softmax"),
            (dict(moe_expert_bias=True), "model.moe_expert_bias=true but it needs false"),
        ):
            with pytest.raises(HFMappingError, match=named):
                check_model_matches(ModelConfig(**moe, **extra), config, "x")


def test_a_phi3_directory_reads_as_llama_with_fused_tensors(hf_dirs):
    """Phi-3's qkv_proj (q, k, v of their own sizes: grouped-query) and gate_up_proj (gate, then up), read into
    tpframe's logical tensors and written back as a Llama, give transformers' Phi-3 logits."""
    from tpframe.checkpoint.hf import hf_config, to_hf
    from tpframe.inference.loading import hf_source, read_weights

    source = hf_source(hf_dirs["phi3"])
    tensors = read_weights(source)
    assert tuple(tensors["blocks.0.attn.qkv.k.weight"].shape) == (16, 32)  # 2 key/value heads of 8
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config(source.model))).eval()
    llama.load_state_dict(to_hf(tensors, source.model))
    phi3 = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dirs["phi3"])).eval()
    with torch.no_grad():
        torch.testing.assert_close(llama(IDS).logits, phi3(IDS).logits, atol=1e-5, rtol=0)


def test_sliding_windows_read_as_transformers_reads_them(hf_dirs):
    """Mistral's window is 4096 when config.json gives none; a Qwen's only with use_sliding_window, and in Qwen2/Qwen3
    only from max_window_layers on (or as layer_types say): in every layer or none, else one line. A model without
    the directory's window is refused naming it."""
    from tpframe.checkpoint.hf import HFMappingError, check_model_matches, read_config
    from tpframe.models.config import ModelConfig
    from tpframe.models.hf.llama import hf_window

    mistral = read_config(hf_dirs["mistral"])
    assert hf_window(mistral, "x") == 6
    assert hf_window({k: v for k, v in mistral.items() if k != "sliding_window"}, "x") == 4096
    assert hf_window({**mistral, "sliding_window": None}, "x") is None  # Mistral 7B v0.2 and later
    qwen2 = read_config(hf_dirs["qwen2"])  # use_sliding_window=false: its sliding_window is unused
    assert hf_window(qwen2, "x") is None
    every = {**qwen2, "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0, "layer_types": None}
    assert hf_window(every, "x") == 16
    assert hf_window({**every, "max_window_layers": 2}, "x") is None  # from layer 2 of 2: none
    assert hf_window({**every, "layer_types": ["sliding_attention"] * 2, "max_window_layers": 2}, "x") == 16
    with pytest.raises(
        HFMappingError,
        match=r"^x: use_sliding_window=true gives a window of 16 to 1 of 2 layers "
        r"\(max_window_layers / layer_types\), which tpframe has no equivalent "
        r"for \(model.sliding_window is every layer's\)$",
    ):
        hf_window({**every, "max_window_layers": 1}, "x")
    assert hf_window({**every, "model_type": "qwen3_moe", "max_window_layers": 1}, "x") == 16  # every layer's
    with pytest.raises(HFMappingError, match=r"^x: layer_types='sliding_attention' must list one type per layer "):
        hf_window({**every, "layer_types": "sliding_attention"}, "x")
    shape = dict(
        vocab_size=256,
        hidden=32,
        layers=2,
        heads=4,
        kv_heads=2,
        ffn_hidden=64,
        norm="rmsnorm",
        norm_eps=1e-6,
        position="rotary",
        activation="swiglu",
        bias=False,
        tie_embeddings=False,
        max_seq_len=64,
    )
    check_model_matches(ModelConfig(**shape, sliding_window=6), mistral, "x")
    with pytest.raises(HFMappingError, match=r"^x describes another model: model.sliding_window=null but it needs 6"):
        check_model_matches(ModelConfig(**shape), mistral, "x")


# config.json of models users fine-tune, as the hub has them (the keys model_fields reads and some it ignores)
HUB_CONFIGS = {
    "Phi-3-mini-4k": (
        {
            "architectures": ["Phi3ForCausalLM"],
            "model_type": "phi3",
            "attention_dropout": 0.0,
            "bos_token_id": 1,
            "embd_pdrop": 0.0,
            "eos_token_id": 32000,
            "hidden_act": "silu",
            "hidden_size": 3072,
            "intermediate_size": 8192,
            "max_position_embeddings": 4096,
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            "num_key_value_heads": 32,
            "original_max_position_embeddings": 4096,
            "pad_token_id": 32000,
            "resid_pdrop": 0.0,
            "rms_norm_eps": 1e-05,
            "rope_scaling": None,
            "rope_theta": 10000.0,
            "sliding_window": 2047,
            "tie_word_embeddings": False,
            "vocab_size": 32064,
        },
        dict(hidden=3072, heads=32, kv_heads=32, ffn_hidden=8192, tie_embeddings=False, sliding_window=2047),
    ),
    "Mistral-7B-v0.1": (
        {
            "architectures": ["MistralForCausalLM"],
            "bos_token_id": 1,
            "eos_token_id": 2,
            "hidden_act": "silu",
            "hidden_size": 4096,
            "initializer_range": 0.02,
            "intermediate_size": 14336,
            "max_position_embeddings": 32768,
            "model_type": "mistral",
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-05,
            "rope_theta": 10000.0,
            "sliding_window": 4096,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "vocab_size": 32000,
        },
        dict(hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, sliding_window=4096),
    ),
    "Llama-3.2-1B": (
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "attention_bias": False,
            "mlp_bias": False,
            "head_dim": 64,
            "hidden_act": "silu",
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "max_position_embeddings": 131072,
            "num_attention_heads": 32,
            "num_hidden_layers": 16,
            "num_key_value_heads": 8,
            "pretraining_tp": 1,
            "rms_norm_eps": 1e-05,
            "rope_scaling": {
                "factor": 32.0,
                "high_freq_factor": 4.0,
                "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
            },
            "rope_theta": 500000.0,
            "tie_word_embeddings": True,
            "vocab_size": 128256,
            "bos_token_id": 128000,
            "eos_token_id": 128001,
        },
        dict(hidden=2048, heads=32, kv_heads=8, rope_scaling_factor=32.0, tie_embeddings=True),
    ),
    "Qwen2.5-0.5B": (
        {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "hidden_act": "silu",
            "hidden_size": 896,
            "intermediate_size": 4864,
            "max_position_embeddings": 32768,
            "max_window_layers": 24,
            "num_attention_heads": 14,
            "num_hidden_layers": 24,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-06,
            "rope_theta": 1000000.0,
            "sliding_window": 32768,
            "use_sliding_window": False,
            "tie_word_embeddings": True,
            "vocab_size": 151936,
        },
        dict(hidden=896, heads=14, kv_heads=2, bias=False, qkv_bias=True),
    ),
    "Qwen3-0.6B": (
        {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "attention_bias": False,
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "max_position_embeddings": 40960,
            "max_window_layers": 28,
            "num_attention_heads": 16,
            "num_hidden_layers": 28,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-06,
            "rope_scaling": None,
            "rope_theta": 1000000,
            "sliding_window": None,
            "tie_word_embeddings": True,
            "use_sliding_window": False,
            "vocab_size": 151936,
        },
        dict(hidden=1024, heads=16, head_dim=128, qk_norm=True, rope_theta=1000000),
    ),
    "Mistral-Nemo": (
        {
            "architectures": ["MistralForCausalLM"],
            "model_type": "mistral",
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 5120,
            "intermediate_size": 14336,
            "max_position_embeddings": 1024000,
            "num_attention_heads": 32,
            "num_hidden_layers": 40,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-05,
            "rope_theta": 1000000.0,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "vocab_size": 131072,
        },
        dict(hidden=5120, heads=32, head_dim=128, tie_embeddings=False),
    ),
    "Qwen3-30B-A3B": (
        {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 151643,
            "decoder_sparse_step": 1,
            "eos_token_id": 151645,
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 2048,
            "initializer_range": 0.02,
            "intermediate_size": 6144,
            "max_position_embeddings": 40960,
            "max_window_layers": 48,
            "mlp_only_layers": [],
            "moe_intermediate_size": 768,
            "norm_topk_prob": True,
            "num_attention_heads": 32,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "num_hidden_layers": 48,
            "num_key_value_heads": 4,
            "output_router_logits": False,
            "rms_norm_eps": 1e-06,
            "rope_scaling": None,
            "rope_theta": 1000000.0,
            "router_aux_loss_coef": 0.001,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": 151936,
        },
        dict(
            hidden=2048,
            layers=48,
            heads=32,
            kv_heads=4,
            head_dim=128,
            qk_norm=True,
            ffn_hidden=None,
            moe_experts=128,
            moe_top_k=8,
            moe_ffn_hidden=768,
            tie_embeddings=False,
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(HUB_CONFIGS))
def test_hub_configs_of_models_users_fine_tune_map(name):
    """Each maps to tpframe's model (the fields named here among them), passes train.py's checks at TP=2 with those
    model.* values, and exports back to its own architecture, whose config.json describes the same model."""
    from tpframe.checkpoint.hf import hf_architecture, hf_config, model_fields
    from tpframe.models.config import ModelConfig
    from tpframe.training.config import load_config, validate

    config, expected = HUB_CONFIGS[name]
    fields = model_fields(config, name)
    assert {k: fields[k] for k in expected} == expected
    m = ModelConfig(**{k: v for k, v in fields.items() if k != "name"})
    # Mistral and Phi-3 are written as Mistral with a sliding window, else as Llama
    windowed = fields.get("sliding_window") is not None
    assert hf_architecture(m) == (
        "mistral" if windowed else config["model_type"].replace("mistral", "llama").replace("phi3", "llama")
    )
    assert model_fields(hf_config(m), name) == fields
    # written with the hub's keys, those transformers 4 reads (num_experts, ...)
    if config["model_type"] != "phi3" and (config["model_type"] != "mistral" or windowed):
        assert set(config) <= set(hf_config(m)), sorted(set(config) - set(hf_config(m)))
    overrides = [
        f"model.{k}={'null' if v is None else str(v).lower() if isinstance(v, bool) else v}"
        for k, v in fields.items()
        if k != "name"
    ]
    validate(load_config(None, [*overrides, "parallel.tp=2", "train.seq_len=128", "model.max_seq_len=4096"]), 2)
