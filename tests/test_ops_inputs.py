"""Every mistake is one line and exit code 2, with nothing written: 162 bad inputs through train.main in this
process, 29 through the tools, a few through the README's launcher (and torchrun) with 2 processes."""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.training_utils import REPO, TINY, merge_overrides, torchrun_env, train_in_process, with_overrides

BASE = merge_overrides(["--config", "configs/tiny_cpu.yaml"], TINY, ["parallel.tp=1", "train.steps=2"])
ENV_KEYS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TPFRAME_COMM_BACKEND",
    "TPFRAME_FAULT_NAN",
    "TPFRAME_SYMM_BUFFER_MB",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_ERROR_FILE",
)


def _file(tmp: Path, name: str, content) -> str:
    path = tmp / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(path)


def _token_file(tmp: Path, bad_id: int | None = None) -> str:
    from tpframe.data.tokenizer import content_record, sidecar_path, write_token_file

    tmp.mkdir(exist_ok=True)
    text = tmp / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    out = tmp / "tokens.bin"
    write_token_file([text], out)
    if bad_id is not None:  # a file whose sidecar vouches for it (checksums included) but holds an id too large
        ids = bytearray(out.read_bytes())
        ids[100:102] = int(bad_id).to_bytes(2, "little")
        out.write_bytes(bytes(ids))
        side = sidecar_path(out)
        meta = {**json.loads(side.read_text()), **content_record(out), "sha256": hashlib.sha256(ids).hexdigest()}
        side.write_text(json.dumps(meta))
    return str(out)


def _safetensors(tmp: Path, wrong_shape: bool, bad_value: float | None = None, hf: bool = False) -> str:
    """BASE's weights (zeros) as a safetensors file, or (`hf`) a Hugging Face GPT-2 directory; `bad_value` in one
    of them."""
    from safetensors.torch import save_file

    from tpframe.checkpoint import hf as hf_format
    from tpframe.parallel.sharding import param_shards
    from tpframe.run import preflight
    from tpframe.training.config import load_config

    cfg = load_config(os.path.join(REPO, "configs/tiny_cpu.yaml"), [*TINY, "parallel.tp=1"])
    model = preflight.dry_build(cfg)
    tensors = {
        s.name: torch.zeros(s.global_shape) for n, p in model.named_parameters() for s in param_shards(n, p, 0, 1)
    }
    if wrong_shape:
        tensors["blocks.0.attn.proj.weight"] = torch.zeros(3, 3)
    if bad_value is not None:
        tensors["blocks.1.mlp.fc2.weight"][3, 5] = bad_value
    if hf:
        (tmp / "hf").mkdir()
        (tmp / "hf" / hf_format.CONFIG).write_text(json.dumps(hf_format.hf_config(cfg.model)))
        save_file(hf_format.to_hf(tensors, cfg.model), str(tmp / "hf" / hf_format.WEIGHTS))
        return str(tmp / "hf")
    save_file(tensors, str(tmp / "w.safetensors"))
    return str(tmp / "w.safetensors")


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A finished 2-step run (world of one) with its checkpoint, config.yaml and metrics.jsonl."""
    root = tmp_path_factory.mktemp("saved")
    run_distributed(
        train_in_process, 1, ["parallel.tp=1", "train.steps=2", "checkpoint.save_at_end=true", f"train.run_dir={root}"]
    )
    return root


def _meta_without(saved: Path, tmp: Path, key: str) -> str:
    step = tmp / "step_00000002"
    shutil.copytree(saved / "checkpoints" / "step_00000002", step)
    meta = json.loads((step / "meta.json").read_text())
    del meta[key]
    (step / "meta.json").write_text(json.dumps(meta))
    return str(step)


def _meta_with(saved: Path, tmp: Path, key: str, value) -> str:
    """A copy of the saved step whose meta.json has `key` set to `value` (bytes: the whole file)."""
    step = tmp / "step_00000002"
    shutil.copytree(saved / "checkpoints" / "step_00000002", step)
    if isinstance(value, bytes):
        (step / "meta.json").write_bytes(value)
        return str(step)
    meta = json.loads((step / "meta.json").read_text())
    meta[key] = value
    (step / "meta.json").write_text(json.dumps(meta))
    return str(step)


def _root_with_latest(tmp: Path, latest) -> str:
    """A checkpoints root whose `latest` is `latest` (bytes) or, for None, a directory."""
    root = tmp / "ckpts"
    root.mkdir()
    if latest is None:
        (root / "latest").mkdir()
    else:
        (root / "latest").write_bytes(latest)
    return str(root)


def _run_dir_holding(tmp: Path, name: str, content) -> str:
    """A run directory holding `name`: a file with `content`, or a directory for None."""
    run = tmp / "other_run"
    run.mkdir()
    if content is None:
        (run / name).mkdir()
    else:
        (run / name).write_text(content)
    return str(run)


# 360 bytes of YAML aliases, each list ten of the one before: a list of 10^7 strings, whose repr is 58 MB
ALIAS_BOMB = "model:\n  bias:\n" + "".join(
    f"    - &l{i} [{','.join(['x'] * 10 if i == 0 else [f'*l{i - 1}'] * 10)}]\n" for i in range(7)
)


def _dangling(tmp: Path) -> str:
    """A symbolic link to a folder that does not exist."""
    (tmp / "dangling").symlink_to("/nonexistent/deeper")
    return str(tmp / "dangling")


def _user_step_folder(tmp: Path) -> str:
    """A run directory whose checkpoints/ holds a user's folder named like a checkpoint (no meta.json)."""
    step = tmp / "u4" / "checkpoints" / "step_00000001"
    step.mkdir(parents=True)
    (step / "data.txt").write_text("my data")
    return str(tmp / "u4")


def _checkpoints_copy(saved: Path, tmp: Path) -> str:
    """A copy of the saved run's checkpoints folder (latest, step_00000002)."""
    shutil.copytree(saved / "checkpoints", tmp / "ckpts")
    return str(tmp / "ckpts")


def _flip(file: Path) -> None:
    """Byte 0 of `file` flipped: the recorded size, another CRC32."""
    data = bytearray(file.read_bytes())
    data[0] ^= 0xFF
    file.write_bytes(bytes(data))


def _flipped(saved: Path, tmp: Path, name: str) -> str:
    """A copy of the saved step with byte 0 of its file `name` flipped (`_flip`)."""
    step = tmp / "step_00000002"
    shutil.copytree(saved / "checkpoints" / "step_00000002", step)
    _flip(step / name)
    return str(step)


# (id, builder(tmp, saved) -> (extra args, env), expected text in the one line)
CASES = [
    # YAML files
    (
        "dup-key",
        lambda t, s: (["--config", _file(t, "c.yaml", "model:\n  hidden: 32\n  hidden: 64\n")], {}),
        "key 'hidden' appears twice in one mapping (lines 2 and 3)",
    ),
    (
        "dup-section",
        lambda t, s: (
            ["--config", _file(t, "c.yaml", "optim:\n  lr: 1.0e-3\ntrain:\n  steps: 2\noptim:\n  min_lr: 0\n")],
            {},
        ),
        "key 'optim' appears twice in one mapping (lines 1 and 5)",
    ),
    ("empty-file", lambda t, s: (["--config", _file(t, "c.yaml", "")], {}), "is empty"),
    ("comments-only", lambda t, s: (["--config", _file(t, "c.yaml", "# nothing\n")], {}), "is empty"),
    (
        "not-utf8",
        lambda t, s: (["--config", _file(t, "c.yaml", b"model:\n  name: caf\xe9\n")], {}),
        "is not UTF-8 text",
    ),
    (
        "top-level-list",
        lambda t, s: (["--config", _file(t, "c.yaml", "- model\n- train\n")], {}),
        "must hold a mapping of sections",
    ),
    ("int-section", lambda t, s: (["--config", _file(t, "c.yaml", "1: 2\n")], {}), "config section names are words"),
    (
        "int-key",
        lambda t, s: (["--config", _file(t, "c.yaml", "model:\n  1: 2\n")], {}),
        "keys of config section 'model' are words",
    ),
    (
        "scalar-section",
        lambda t, s: (["--config", _file(t, "c.yaml", "model: 3\n")], {}),
        "config section 'model' must be a mapping",
    ),
    (
        "scalar-section-override",
        lambda t, s: (["--config", _file(t, "c.yaml", "model: 3\n"), "model.hidden=8"], {}),
        "config section 'model' must be a mapping",
    ),
    ("bad-yaml", lambda t, s: (["--config", _file(t, "c.yaml", "model: [1, 2\n")], {}), "is not valid YAML"),
    (
        "list-key",
        lambda t, s: (["--config", _file(t, "c.yaml", "? [a, b]\n: 1\n")], {}),
        "a mapping key must be a name",
    ),
    (
        "alias-bomb",
        lambda t, s: (["--config", _file(t, "c.yaml", ALIAS_BOMB)], {}),
        "model.bias=[['x', 'x', 'x', 'x', 'x', 'x', ...], [[...], [...], [...], [...], [...], [...], ...], [[...], [...], ",  # noqa: E501
    ),
    (
        "alias-bomb-key",
        lambda t, s: (
            [
                "--config",
                _file(
                    t, "c.yaml", ALIAS_BOMB.replace("model:\n", "train:\n").replace("  bias:\n", "  ?\n") + "  : 1\n"
                ),
            ],
            {},
        ),
        "a mapping key must be a name, got [['x', 'x', 'x', 'x', 'x', 'x', ...], [[...], [...], [...], [...], [...],",
    ),
    ("config-is-dir", lambda t, s: (["--config", str(t)], {}), "is not a file"),
    ("config-missing", lambda t, s: (["--config", str(t / "nope.yaml")], {}), "does not exist"),
    # overrides and arguments
    (
        "override-unparsable",
        lambda t, s: (["model.hidden=="], {}),
        "override 'model.hidden==': the value '=' is not valid YAML",
    ),
    ("override-open-bracket", lambda t, s: (["train.run_dir=[x"], {}), "is not valid YAML"),
    (
        "override-python-tag",
        lambda t, s: (["train.run_dir=!!python/object/apply:os.system ['true']"], {}),
        "is not valid YAML",
    ),
    ("override-no-equals", lambda t, s: (["train.steps"], {}), "must look like section.key=value"),
    ("override-three-parts", lambda t, s: (["train.steps.x=1"], {}), "must be section.key"),
    (
        "config-twice",
        lambda t, s: (["--config", "configs/tiny_cpu.yaml", "--config", _file(t, "c.yaml", "train:\n")], {}),
        "argument --config: given twice (--config configs/tiny_cpu.yaml and --config "
        "{tmp}/c.yaml); give it once (usage: train.py",
    ),
    (
        "override-twice",
        lambda t, s: (["optim.lr=1e-3", "optim.lr=2e-3"], {}),
        "override optim.lr is given twice ('optim.lr=1e-3' and 'optim.lr=2e-3'); give it once",
    ),
    (
        "override-twice-same-value",
        lambda t, s: (["train.steps=3", "model.hidden=64", " train.steps =3"], {}),
        "override train.steps is given twice ('train.steps=3' and ' train.steps =3')",
    ),
    (
        "unknown-key",
        lambda t, s: (["model.hiden=64"], {}),
        "unknown config key 'model.hiden' (did you mean 'model.hidden'?)",
    ),
    ("unknown-section", lambda t, s: (["modle.hidden=64"], {}), "unknown config section 'modle'"),
    ("wrong-type", lambda t, s: (["train.steps=ten"], {}), "train.steps='ten' must be an integer"),
    ("bad-flag", lambda t, s: (["--confg", "x.yaml"], {}), "unrecognized arguments: --confg"),
    ("bad-literal", lambda t, s: (["model.norm=batchnorm"], {}), "model.norm='batchnorm' is not allowed"),
    # numbers
    ("lr-inf", lambda t, s: (["optim.lr=.inf"], {}), "optim.lr=inf must be a finite number"),
    (
        "lr-beyond-float32",
        lambda t, s: (["optim.lr=1e39", "optim.min_lr=0"], {}),
        "optim.lr=1e+39 is beyond float32's range",
    ),
    (
        "aux-loss-beyond-float32",
        lambda t, s: (["model.moe_experts=4", "model.moe_aux_loss=1e308"], {}),
        "model.moe_aux_loss=1e+308 is beyond float32's range",
    ),
    (
        "bucket-beyond-float32",
        lambda t, s: (["parallel.grad_bucket_mb=1e308"], {}),
        "parallel.grad_bucket_mb=1e+308 is beyond float32's range",
    ),
    ("timeout-huge", lambda t, s: (["comm.timeout_s=1e10"], {}), "comm.timeout_s=1e+10 must be > 0 and < 1e+06"),
    (
        "seed-beyond-64-bits",
        lambda t, s: (["train.seed=18446744073709551615"], {}),
        "train.seed=18446744073709551615 must be below 2**63",
    ),
    ("ffn-hidden-zero", lambda t, s: (["model.ffn_hidden=0"], {}), "model.ffn_hidden=0 must be at least 1"),
    ("ffn-hidden-negative", lambda t, s: (["model.ffn_hidden=-128"], {}), "model.ffn_hidden=-128 must be at least 1"),
    (
        "moe-ffn-hidden-zero",
        lambda t, s: (["model.moe_experts=4", "model.moe_ffn_hidden=0"], {}),
        "model.moe_ffn_hidden=0 must be at least 1",
    ),
    ("lr-nan", lambda t, s: (["optim.lr=nan"], {}), "optim.lr=nan must be a finite number"),
    ("wd-nan", lambda t, s: (["optim.weight_decay=nan"], {}), "optim.weight_decay=nan must be a finite number"),
    ("norm-eps-nan", lambda t, s: (["model.norm_eps=.nan"], {}), "model.norm_eps=nan must be a finite number"),
    ("grad-clip-nan", lambda t, s: (["optim.grad_clip=nan"], {}), "optim.grad_clip=nan must be a finite number"),
    ("eps-negative", lambda t, s: (["optim.eps=-1e-8"], {}), "optim.eps=-1e-08 must be > 0"),
    ("init-std-negative", lambda t, s: (["model.init_std=-0.02"], {}), "model.init_std=-0.02 must be > 0"),
    (
        "rope-theta-zero",
        lambda t, s: (["model.position=rotary", "model.rope_theta=0"], {}),
        "model.rope_theta=0 must be > 0",
    ),
    ("timeout-zero", lambda t, s: (["comm.timeout_s=0"], {}), "comm.timeout_s=0 must be > 0"),
    ("dropout-range", lambda t, s: (["model.dropout=1.5"], {}), "model.dropout=1.5 must be in [0, 1)"),
    ("beta-range", lambda t, s: (["optim.beta2=1.0"], {}), "must be in [0, 1)"),
    (
        "skips-negative",
        lambda t, s: (["train.max_skipped_steps=-1"], {}),
        "train.max_skipped_steps=-1 must not be negative",
    ),
    # generated in every rank's pre-flight: it hung there, its memory growing
    (
        "synthetic-tokens-1e10",
        lambda t, s: (["data.synthetic_tokens=1e10"], {}),
        "data.synthetic_tokens=10,000,000,000 is more than the synthetic corpus takes (500,000,000 at most",
    ),
    (
        "synthetic-tokens-1e30",
        lambda t, s: (["data.synthetic_tokens=1e30"], {}),
        "data.synthetic_tokens=1e+30 is more than the synthetic corpus takes",
    ),
    # models and layouts
    (
        "not-a-builder",
        lambda t, s: (["model.name=json:dumps"], {}),
        "model.name='json:dumps': building the model failed",
    ),
    ("no-module", lambda t, s: (["model.name=nosuchmodule:build"], {}), "cannot import 'nosuchmodule'"),
    (
        "plugin-own-check",
        lambda t, s: (["model.name=examples.parallel_llama:build"], {}),
        "examples.parallel_llama needs",
    ),
    (
        "tp-divides-nothing",
        lambda t, s: (["parallel.tp=3"], {"WORLD_SIZE": "3"}),
        "parallel.tp=3 does not divide model.heads=4",
    ),
    (
        "world-not-divisible",
        lambda t, s: (["parallel.tp=2"], {"WORLD_SIZE": "3"}),
        "world size 3 is not divisible by parallel.tp*parallel.pp = 2*1",
    ),
    (
        "batch-not-divisible",
        lambda t, s: (["train.global_batch_size=10"], {}),
        "train.global_batch_size=10 is not divisible",
    ),
    ("cuda-graph-on-cpu", lambda t, s: (["train.cuda_graph=true"], {}), "train.cuda_graph needs a CUDA device"),
    (
        "cuda-graph-dropout",
        lambda t, s: (["train.cuda_graph=true", "model.attention_dropout=0.1"], {}),
        "needs model.dropout=0 and model.attention_dropout=0 (got 0 and 0.1)",
    ),
    (
        "cuda-graph-fsdp",
        lambda t, s: (["train.cuda_graph=true", "parallel.dp_strategy=fsdp"], {}),
        "train.cuda_graph cannot capture FSDP",
    ),
    (
        "cuda-graph-pipeline",
        lambda t, s: (["train.cuda_graph=true", "parallel.pp=2"], {"WORLD_SIZE": "2"}),
        "train.cuda_graph graphs the non-pipelined step",
    ),
    ("fp8-fp32", lambda t, s: (["train.fp8=true"], {}), "train.fp8 computes in float8 with bf16"),
    (
        "async-tp-word",
        lambda t, s: (["parallel.async_tp=nccl"], {}),
        "choose true, false or one of 'copy_engine', 'auto'",
    ),
    (
        "fp8-async-tp",
        lambda t, s: (
            ["train.fp8=true", "train.dtype=bfloat16", "parallel.sequence_parallel=true", "parallel.async_tp=true"],
            {"WORLD_SIZE": "2"},
        ),
        "train.fp8 and parallel.async_tp",
    ),
    ("fp8-recipe", lambda t, s: (["train.fp8=fast", "train.dtype=bfloat16"], {}), "'tensorwise', 'rowwise'"),
    (
        "fp8-tokens",
        lambda t, s: (["train.fp8=true", "train.dtype=bfloat16", "train.seq_len=30"], {}),
        "micro_batch_size*train.seq_len/parallel.cp = 120 to be a multiple of 16",
    ),
    (
        "fp8-hidden",
        lambda t, s: (
            ["train.fp8=true", "train.dtype=bfloat16", "model.hidden=48", "model.heads=4", "parallel.tp=2"],
            {"WORLD_SIZE": "2"},
        ),
        "train.fp8=tensorwise needs model.hidden = 48 divisible by 16*parallel.tp = 32",
    ),
    (
        "recompute-word",
        lambda t, s: (["parallel.activation_checkpointing=partial"], {}),
        "choose true, false or one of 'full', 'selective'",
    ),
    (
        "recompute-layers-without-full",
        lambda t, s: (["parallel.recompute_layers=1"], {}),
        "needs parallel.activation_checkpointing=full (got false)",  # YAML's word, not Python's False
    ),
    (
        "recompute-layers-too-many",
        lambda t, s: (["parallel.activation_checkpointing=full", "parallel.recompute_layers=3"], {}),
        "must be in 1..model.layers=2",
    ),
    (
        "selective-async-tp",
        lambda t, s: (
            [
                "parallel.activation_checkpointing=selective",
                "parallel.tp=2",
                "parallel.sequence_parallel=true",
                "parallel.async_tp=true",
            ],
            {"WORLD_SIZE": "2"},
        ),
        "selective re-gathers the norm outputs",
    ),
    (
        "selective-user-model",
        lambda t, s: (["parallel.activation_checkpointing=selective", "model.name=examples.parallel_llama:build"], {}),
        "does not implement selective recompute",
    ),
    (
        "document-user-model",
        lambda t, s: (
            [
                "model.attention_mask=document",
                "data.source=stdlib",
                "model.name=tests.test_documents:build_without_documents",
            ],
            {},
        ),
        "does not implement model.attention_mask=document, so its attention would cross document ends",
    ),
    (
        "window-user-model",
        lambda t, s: (["model.sliding_window=8", "model.name=tests.test_sliding_window:build_without_window"], {}),
        "model.sliding_window=8: model.name='tests.test_sliding_window:build_without_window' built attention without "
        "that window (blocks.0.attn, blocks.1.attn); pass window=cfg.sliding_window to ParallelAttention",
    ),
    (
        "moe-user-model",
        lambda t, s: (["--config", "configs/tiny_llama_cpu.yaml", "parallel.tp=1", "model.moe_experts=4"], {}),
        "model.moe_experts=4: model.name='examples.parallel_llama:build' built no mixture-of-experts layer",
    ),
    (
        "document-cuda-graph",
        lambda t, s: (["model.attention_mask=document", "train.cuda_graph=true"], {}),
        "train.cuda_graph cannot replay model.attention_mask=document",
    ),
    (
        "document-no-ends",
        lambda t, s: (["model.attention_mask=document"], {}),
        "data.source=synthetic marks no document ends; set model.eod_id",
    ),
    (
        "eod-mask-loss-cuda-graph",
        lambda t, s: (["data.eod_mask_loss=true", "train.cuda_graph=true"], {}),
        "train.cuda_graph replays a fixed loss scale, and data.eod_mask_loss scales each step",
    ),
    (
        "eod-mask-loss-no-ends",
        lambda t, s: (["data.eod_mask_loss=true"], {}),
        "data.eod_mask_loss=true: data.source=synthetic marks no document ends; set model.eod_id",
    ),
    (
        "eod-id-beyond-vocab",
        lambda t, s: (["model.eod_id=256"], {}),
        "model.eod_id=256 is not a token id of model.vocab_size=256",
    ),
    (
        "attention-mask-unknown",
        lambda t, s: (["model.attention_mask=packed"], {}),
        "model.attention_mask='packed' is not allowed; choose one of 'causal', 'document'",
    ),
    ("cp-zero", lambda t, s: (["parallel.cp=0"], {}), "parallel.cp=0 must be at least 1"),
    (
        "cp-world",
        lambda t, s: (["parallel.cp=2", "parallel.tp=2"], {"WORLD_SIZE": "2"}),
        "not divisible by parallel.tp*parallel.cp*parallel.pp = 2*2*1; launch a multiple of 4",
    ),
    (
        "cp-seq-len",
        lambda t, s: (["parallel.cp=2", "train.seq_len=30"], {"WORLD_SIZE": "2"}),
        "train.seq_len=30 is not divisible by 4",
    ),
    (
        "cp-sequence-parallel",
        lambda t, s: (
            ["parallel.cp=2", "parallel.tp=4", "parallel.sequence_parallel=true", "train.seq_len=12"],
            {"WORLD_SIZE": "8"},
        ),
        "train.seq_len/parallel.cp = 6 tokens over parallel.tp=4; make train.seq_len a multiple of 8",
    ),
    (
        "cp-comm-heads",
        lambda t, s: (["parallel.cp=4", "parallel.tp=2", "parallel.cp_comm=all_to_all"], {"WORLD_SIZE": "8"}),
        "parallel.cp_comm=all_to_all splits each TP rank's model.heads/parallel.tp = 4/2 = 2 query heads over "
        "parallel.cp=4, which does not divide them; use parallel.cp_comm=all_gather or a parallel.cp that divides 2",
    ),
    (
        "cp-comm-unknown",
        lambda t, s: (["parallel.cp=2", "parallel.cp_comm=ring"], {"WORLD_SIZE": "2"}),
        "parallel.cp_comm='ring' is not allowed; choose one of 'all_gather', 'all_to_all'",
    ),
    (
        "cp-cuda-graph",
        lambda t, s: (["parallel.cp=2", "train.cuda_graph=true"], {"WORLD_SIZE": "2"}),
        "train.cuda_graph is not supported with parallel.cp > 1",
    ),
    (
        "cp-user-model",
        lambda t, s: (["parallel.cp=2", "model.name=examples.parallel_llama:build"], {"WORLD_SIZE": "2"}),
        "does not implement context parallelism",
    ),
    # mixture of experts (parallel.ep: experts split over ranks of dp x cp)
    ("moe-negative", lambda t, s: (["model.moe_experts=-1"], {}), "model.moe_experts=-1 must not be negative"),
    (
        "moe-top-k",
        lambda t, s: (["model.moe_experts=4", "model.moe_top_k=5"], {}),
        "model.moe_top_k=5 must be in 1..model.moe_experts=4",
    ),
    (
        "moe-ffn-tp",
        lambda t, s: (["model.moe_experts=4", "model.moe_ffn_hidden=33", "parallel.tp=2"], {"WORLD_SIZE": "2"}),
        "parallel.tp=2 must divide each expert's hidden size model.moe_ffn_hidden=33",
    ),
    ("ep-dense", lambda t, s: (["parallel.ep=2"], {"WORLD_SIZE": "2"}), "set model.moe_experts"),
    ("moe-shared-dense", lambda t, s: (["model.moe_shared_ffn=64"], {}), "model.moe_shared_ffn=64 belongs to a"),
    (
        "moe-shared-tp",
        lambda t, s: (["model.moe_experts=4", "model.moe_shared_ffn=33", "parallel.tp=2"], {"WORLD_SIZE": "2"}),
        "must be a non-negative multiple of parallel.tp=2",
    ),
    (
        "ep-world",
        lambda t, s: (["model.moe_experts=4", "parallel.ep=4"], {"WORLD_SIZE": "2"}),
        "parallel.ep=4 must divide dp*cp = 2*1 = 2",
    ),
    (
        "ep-experts",
        lambda t, s: (["model.moe_experts=3", "model.moe_top_k=1", "parallel.ep=2"], {"WORLD_SIZE": "2"}),
        "parallel.ep=2 must divide model.moe_experts=3",
    ),
    (
        "moe-ep-compile",
        lambda t, s: (["model.moe_experts=4", "parallel.ep=2", "train.compile=true"], {"WORLD_SIZE": "2"}),
        "train.compile is not supported with parallel.ep > 1",
    ),
    (
        "moe-cuda-graph-fp32",
        lambda t, s: (["model.moe_experts=4", "train.cuda_graph=true"], {}),
        "train.cuda_graph captures MoE experts only as grouped GEMMs",
    ),
    (
        "eval-steps-zero",
        lambda t, s: (["train.eval_interval=1", "train.eval_steps=0"], {}),  # no evaluation ran
        "train.eval_interval=1 evaluates on train.eval_steps=0 held-out micro-batches: no evaluation would run",
    ),
    ("wsd-fraction", lambda t, s: (["optim.decay_fraction=1.5"], {}), "optim.decay_fraction=1.5 must be in (0, 1]"),
    (
        "wsd-constant",
        lambda t, s: (["optim.decay_fraction=0.2", "optim.decay=constant"], {}),
        "optim.decay=constant has none",
    ),
    ("profile-negative", lambda t, s: (["profile.start_step=-1"], {}), "need start_step >= 0"),
    ("profile-no-steps", lambda t, s: (["profile.start_step=2", "profile.steps=0"], {}), "and steps >= 1"),
    ("profile-after-the-run", lambda t, s: (["profile.start_step=500"], {}), "is after the last step"),
    (
        "profile-rank-outside",
        lambda t, s: (["profile.start_step=2", "profile.ranks=[0, 2]"], {"WORLD_SIZE": "2"}),
        "each in 0..1",
    ),
    (
        "profile-memory-on-cpu",
        lambda t, s: (["profile.start_step=2", "profile.memory=true"], {}),
        "profile.memory records the CUDA allocator",
    ),
    # sizes that cannot fit
    ("hidden-65536", lambda t, s: (["model.hidden=65536", "model.heads=64"], {}), "this run needs about"),
    ("vocab-1e10", lambda t, s: (["model.vocab_size=1e10"], {}), "this run needs about"),
    (
        "micro-batch-1e9",
        lambda t, s: (["train.micro_batch_size=1e9", "train.global_batch_size=1e9"], {}),
        "this run needs about",
    ),
    ("max-seq-1e11", lambda t, s: (["model.max_seq_len=1e11"], {}), "this run needs about"),
    # its weights' bytes pass 2^63: the meta build itself overflows
    ("hidden-1e9", lambda t, s: (["model.hidden=1e9"], {}), "model.* makes a tensor too large for any memory"),
    # estimated from builds of 1 and 2 layers: building them all on the meta device took ~3 ms a layer, in silence
    ("layers-1e7", lambda t, s: (["model.layers=1e7"], {}), "this run needs about"),
    # environment
    ("env-comm-backend", lambda t, s: ([], {"TPFRAME_COMM_BACKEND": "bogus"}), "env var TPFRAME_COMM_BACKEND='bogus'"),
    ("env-world-size", lambda t, s: ([], {"WORLD_SIZE": "two"}), "env var WORLD_SIZE='two' must be an integer"),
    ("env-world-size-zero", lambda t, s: ([], {"WORLD_SIZE": "0"}), "env var WORLD_SIZE='0' must be at least 1"),
    (
        "env-rank-beyond-world",
        lambda t, s: (["parallel.tp=2"], {**torchrun_env(2), "RANK": "5"}),
        "env var RANK=5 must be below WORLD_SIZE=2 (launch with python -m tpframe.launch --nproc-per-node N)",
    ),
    ("env-rank-word", lambda t, s: ([], {"RANK": "first"}), "env var RANK='first' must be an integer"),
    (
        "env-no-master",
        lambda t, s: (["parallel.tp=2"], {"WORLD_SIZE": "2", "RANK": "0"}),
        "env var WORLD_SIZE=2 needs MASTER_ADDR, MASTER_PORT set too",
    ),
    (
        "env-no-rank",
        lambda t, s: (["parallel.tp=2"], {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}),
        "WORLD_SIZE=2 needs RANK set too",
    ),
    (
        "env-port-beyond-range",
        lambda t, s: (["parallel.tp=2"], {**torchrun_env(2), "MASTER_PORT": "99999"}),
        "env var MASTER_PORT='99999' must be a TCP port, an integer in 1..65535",
    ),
    ("env-fault-spec", lambda t, s: ([], {"TPFRAME_FAULT_NAN": "soon"}), "env var TPFRAME_FAULT_NAN='soon'"),
    ("env-symm-buffer", lambda t, s: ([], {"TPFRAME_SYMM_BUFFER_MB": "-4"}), "TPFRAME_SYMM_BUFFER_MB='-4'"),
    # the run directory
    ("run-dir-is-file", lambda t, s: ([f"train.run_dir={_file(t, 'taken', 'x')}"], {}), "is a file, not a directory"),
    ("run-dir-empty", lambda t, s: (['train.run_dir=""'], {}), "train.run_dir is empty"),
    *[
        (f"{key}-empty", lambda t, s, key=key: ([f"{key}=''"], {}), f"{key} is empty; give")
        for key in ("checkpoint.dir", "checkpoint.load", "checkpoint.init_from", "data.valid_path")
    ],
    (
        "data-path-empty-in-blend",
        lambda t, s: (["data.source=tokens", "data.path=[a.bin, ' ']"], {}),
        "data.path[1] is empty; give a token file made by tools/prepare_data.py",
    ),
    (
        "run-dir-checkpoints-is-file",
        lambda t, s: ([f"train.run_dir={_run_dir_holding(t, 'checkpoints', 'x')}"], {}),
        "holds a file named checkpoints",
    ),
    (
        "run-dir-metrics-is-dir",
        lambda t, s: ([f"train.run_dir={_run_dir_holding(t, 'metrics.jsonl', None)}"], {}),
        "holds a directory named metrics.jsonl",
    ),
    (
        "run-dir-metrics-not-ours",
        lambda t, s: (["train.run_dir=" + _run_dir_holding(t, "metrics.jsonl", "hello world\n")], {}),
        "holds a metrics.jsonl that tpframe did not write (its first line is not a tpframe metrics record: 'hello world')",  # noqa: E501
    ),
    (
        "run-dir-config-section-not-mapping",
        lambda t, s: ([f"train.run_dir={_run_dir_holding(t, 'config.yaml', 'model: [1]')}"], {}),
        "holds a config.yaml that cannot be read (not a mapping of sections)",
    ),
    ("run-dir-under-file", lambda t, s: ([f"train.run_dir={_file(t, 'taken', 'x')}/run"], {}), "cannot be created"),
    (
        "run-dir-dangling-link",
        lambda t, s: ([f"train.run_dir={_dangling(t)}"], {}),
        "train.run_dir='{tmp}/dangling' is a symbolic link to '/nonexistent/deeper', which does not exist: create it or "  # noqa: E501
        "remove the link",
    ),
    (
        "run-dir-under-dangling-link",
        lambda t, s: ([f"train.run_dir={_dangling(t)}/run"], {}),
        "train.run_dir='{tmp}/dangling/run' cannot be created: '{tmp}/dangling' is a symbolic link to '/nonexistent/deeper'",  # noqa: E501
    ),
    (
        "ckpt-dir-dangling-link",
        lambda t, s: ([f"checkpoint.dir={_dangling(t)}"], {}),
        "checkpoint.dir='{tmp}/dangling' is a symbolic link to '/nonexistent/deeper', which does not exist",
    ),
    # root may write anywhere by os.access, yet nothing can be created in /proc or /sys: the probe finds out
    (
        "run-dir-under-proc",
        lambda t, s: (["train.run_dir=/proc/tpframe_run"], {}),
        "train.run_dir='/proc/tpframe_run' cannot be created: writing in '/proc' failed",
    ),
    (
        "run-dir-under-sys",
        lambda t, s: (["train.run_dir=/sys/kernel/tpframe_run/x"], {}),
        "cannot be created: writing in '/sys/kernel' failed",
    ),
    (
        "ckpt-dir-under-proc",
        lambda t, s: (["checkpoint.dir=/proc/tpframe_checkpoints"], {}),
        "checkpoint.dir='/proc/tpframe_checkpoints' cannot be created: writing in '/proc' failed",
    ),
    ("ckpt-dir-is-file", lambda t, s: ([f"checkpoint.dir={_file(t, 'taken', 'x')}"], {}), "checkpoint.dir="),
    (
        "run-dir-of-another-run",
        lambda t, s: ([f"train.run_dir={s}", "model.hidden=64"], {}),
        "holds another run (model.ffn_hidden is 128 there but 256 now; model.hidden is 32 there but 64 now)",
    ),
    (
        "auto-resume-other-data",
        lambda t, s: ([f"train.run_dir={s}", "checkpoint.auto_resume=true", "data.source=stdlib"], {}),
        "data.source is 'synthetic' in the checkpoint but 'stdlib' now",
    ),
    # host-memory snapshots: for a restart of the launcher, on one node
    (
        "snapshot-negative",
        lambda t, s: (["checkpoint.snapshot_interval=-1"], {}),
        "checkpoint.snapshot_interval=-1 must not be negative",
    ),
    (
        "snapshot-no-restarts",
        lambda t, s: (["checkpoint.snapshot_interval=2"], {}),
        "checkpoint.snapshot_interval=2 serves only a restart within the launch: launch with python -m "
        "tpframe.launch --max-restarts K, or set it to 0",
    ),
    (
        "snapshot-nodes",
        lambda t, s: (
            ["checkpoint.snapshot_interval=2", "parallel.tp=1"],
            {**torchrun_env(2), "LOCAL_WORLD_SIZE": "1", "TORCHELASTIC_MAX_RESTARTS": "1"},
        ),
        "checkpoint.snapshot_interval=2 keeps snapshots in each node's host memory, which the other nodes cannot",
    ),
    # a folder the run saves into: its saves (and checkpoint.keep_last) would replace what it did not resume from
    (
        "ckpt-dir-of-another-run",
        lambda t, s: ([f"checkpoint.dir={s}/checkpoints", "model.hidden=64", "checkpoint.interval=1"], {}),
        "/checkpoints' already holds checkpoints (newest step_00000002) that this run does not resume from "
        "(checkpoint.auto_resume=false); its saves would replace them: resume from them (checkpoint.auto_resume=true), or "  # noqa: E501
        "pick an empty checkpoint.dir",
    ),
    (
        "run-dir-started-over",
        lambda t, s: ([f"train.run_dir={s}"], {}),
        "already holds checkpoints (newest checkpoints/step_00000002) that this run does not resume from "
        "(checkpoint.auto_resume=false)",
    ),
    (
        "ckpt-dir-loading-another",
        lambda t, s: ([f"checkpoint.dir={_checkpoints_copy(s, t)}", f"checkpoint.load={s}/checkpoints"], {}),
        "checkpoint.dir='{tmp}/ckpts' already holds checkpoints (newest step_00000002) that this run does not resume from "  # noqa: E501
        "(it loads checkpoint.load=",
    ),
    (
        "ckpt-dir-user-folder",
        lambda t, s: ([f"train.run_dir={_user_step_folder(t)}", "checkpoint.interval=1", "checkpoint.keep_last=1"], {}),
        "train.run_dir='{tmp}/u4' holds 'checkpoints/step_00000001', which is not a tpframe checkpoint (no meta.json): "
        "a save of that step would replace it; move it away or pick another train.run_dir",
    ),
    # data
    ("tokens-without-path", lambda t, s: (["data.source=tokens"], {}), "data.source=tokens needs data.path"),
    (
        "valid-path-without-tokens",
        lambda t, s: ([f"data.valid_path={t}/v.bin"], {}),
        "data.valid_path is a held-out token file for data.source=tokens",
    ),
    (
        "tokens-missing",
        lambda t, s: (["data.source=tokens", f"data.path={t}/none.bin"], {}),
        "the token file does not exist",
    ),
    (
        "tokens-path-is-dir",
        lambda t, s: (["data.source=tokens", f"data.path={t}"], {}),
        "data.path='{tmp}': the token file is a directory, not a file; name the token file itself",
    ),
    (
        "token-id-beyond-sidecar",
        lambda t, s: (["data.source=tokens", f"data.path={_token_file(t, 300)}"], {}),
        "holds token id 300 but its sidecar declares vocab_size 256",
    ),
    (
        "blend-token-id-beyond-sidecar",
        lambda t, s: (["data.source=tokens", f"data.path=[{_token_file(t)},{_token_file(t / 'x', 300)}]"], {}),
        "data.path[1]=",
    ),
    ("vocab-smaller-than-data", lambda t, s: (["model.vocab_size=100"], {}), "the data has token ids up to 255"),
    # checkpoints
    ("load-missing", lambda t, s: ([f"checkpoint.load={t}/nope"], {}), "does not exist"),
    ("meta-missing-key", lambda t, s: ([f"checkpoint.load={_meta_without(s, t, 'data')}"], {}), "meta.json lacks data"),
    *[
        (
            f"meta-{key}-{value!r}",
            lambda t, s, key=key, value=value: ([f"checkpoint.load={_meta_with(s, t, key, value)}"], {}),
            f"is malformed (wrong type or missing fields in: {key})",
        )
        for key, value in (
            ("architecture", 5),
            ("vocab", {}),
            ("train", {}),
            ("step", "x"),
            ("layout", 5),
            ("config", {"model": {}}),
        )
    ],
    (
        "meta-not-an-object",
        lambda t, s: (["checkpoint.load=" + _meta_with(s, t, "", b"[]")], {}),
        "step_00000002/meta.json holds a JSON array, not an object: it is not a tpframe checkpoint's meta.json",
    ),
    # checkpoint.verify=size lets a flipped byte through: the small files are read in the pre-flight
    (
        "rng-corrupt-size-verified",
        lambda t, s: ([f"checkpoint.load={_flipped(s, t, 'rng_0.pt')}", "checkpoint.verify=size"], {}),
        "checkpoint file {tmp}/step_00000002/rng_0.pt cannot be read (UnpicklingError: invalid load key, '\\xaf'.): it is "  # noqa: E501
        "corrupt; no older checkpoint is beside it to resume from instead; checkpoint.verify=crc (the default) finds",
    ),
    (
        "metadata-corrupt-size-verified",
        lambda t, s: ([f"checkpoint.load={_flipped(s, t, '.metadata')}", "checkpoint.verify=size"], {}),
        "checkpoint file {tmp}/step_00000002/.metadata cannot be read (UnpicklingError: ",
    ),
    (
        "meta-not-utf8",
        lambda t, s: (["checkpoint.load=" + _meta_with(s, t, "", b"{\xff}")], {}),
        "meta.json is corrupt ('utf-8' codec can't decode",
    ),
    (
        "latest-not-utf8",
        lambda t, s: (["checkpoint.load=" + _root_with_latest(t, b"step_\xff")], {}),
        "latest cannot be read ('utf-8' codec can't decode",
    ),
    (
        "latest-is-dir",
        lambda t, s: ([f"checkpoint.load={_root_with_latest(t, None)}"], {}),
        "latest cannot be read ([Errno 21] Is a directory",
    ),
    ("latest-empty", lambda t, s: ([f"checkpoint.load={_root_with_latest(t, b'')}"], {}), "latest is empty"),
    (
        "resume-other-seed",
        lambda t, s: ([f"checkpoint.load={s}/checkpoints", "data.seed=7"], {}),
        "data.seed is 1234 in the checkpoint but 7 now",
    ),
    (
        "resume-other-seq-len",
        lambda t, s: ([f"checkpoint.load={s}/checkpoints", "train.seq_len=16"], {}),
        "train.seq_len is 32 in the checkpoint but 16 now",
    ),
    (
        "resume-other-model",
        lambda t, s: ([f"checkpoint.load={s}/checkpoints", "model.layers=3"], {}),
        "model.layers: checkpoint 2, config 3",
    ),
    (
        "init-from-not-safetensors",
        lambda t, s: ([f"checkpoint.init_from={_file(t, 'w.safetensors', 'not weights')}"], {}),
        "is not a safetensors file",
    ),
    (
        "init-from-wrong-shape",
        lambda t, s: ([f"checkpoint.init_from={_safetensors(t, True)}"], {}),
        "blocks.0.attn.proj.weight (3, 3)",
    ),
    # every step was skipped, the loss NaN, exit 0
    (
        "init-from-nan",
        lambda t, s: ([f"checkpoint.init_from={_safetensors(t, False, float('nan'))}"], {}),
        "w.safetensors': tensor blocks.1.mlp.fc2.weight holds 1 NaN (of 4,096 values): weights that are not finite",
    ),
    (
        "init-from-inf",
        lambda t, s: ([f"checkpoint.init_from={_safetensors(t, False, float('-inf'))}"], {}),
        "tensor blocks.1.mlp.fc2.weight holds 1 inf (of 4,096 values)",
    ),
    (
        "init-from-hf-nan",
        lambda t, s: ([f"checkpoint.init_from={_safetensors(t, False, float('nan'), hf=True)}"], {}),
        "hf': tensor transformer.h.1.mlp.c_proj.weight holds 1 NaN (of 4,096 values)",
    ),
    (
        "init-from-checkpoint-of-other-model",
        lambda t, s: ([f"checkpoint.init_from={s}/checkpoints", "model.layers=3"], {}),
        "checkpoints' holds another model: model.layers=3 but the checkpoint has 2",
    ),
    (
        "init-from-dir-of-nothing",
        lambda t, s: ([f"checkpoint.init_from={t}"], {}),
        "is a directory without config.json and not a tpframe checkpoint (no meta.json or latest)",
    ),
]


def _snapshot(path: Path) -> dict:
    if path.is_file():
        return {path: path.read_bytes()}
    return {p: p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()} if path.exists() else {}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(case, tmp_path, saved_run, capsys, monkeypatch):
    import train

    name, build, expected = case
    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(train, "run", lambda *a, **k: pytest.fail("pre-flight passed a bad input"))
    extra, env = build(tmp_path, saved_run)
    if set(env) == {"WORLD_SIZE"} and env["WORLD_SIZE"].isdigit():  # a layout's world: the rest of torchrun's env
        env = {**torchrun_env(int(env["WORLD_SIZE"])), **env}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    run_dir = tmp_path / "run"
    before = {p: _snapshot(p) for p in (saved_run, *(tmp_path.iterdir()))}
    code = train.main(with_overrides([*BASE, f"train.run_dir={run_dir}"], extra))  # extra's keys replace BASE's
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and "Traceback" not in err, (code, out, err[:2000])
    assert len(lines[0]) < 1000, lines[0][:2000]  # a line to read, whatever the value
    expected = expected.replace("{tmp}", str(tmp_path))
    assert lines[0].startswith("tpframe: config error: ") and expected in lines[0], lines[0]
    assert not run_dir.exists(), "nothing may be written before pre-flight passed"
    assert {p: _snapshot(p) for p in before} == before, "an existing file or run was modified"


def test_there_are_at_least_forty_bad_inputs():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


def test_a_run_saves_where_it_resumes_from_or_where_no_checkpoint_is(tmp_path, saved_run):
    """The folders a run may save into (the refusals are in CASES): the one it resumes from, one of its own older
    steps (going back replaces the later ones, as asked), or a folder without checkpoints; a run that never saves
    may use any."""
    from tpframe.checkpoint.files import preflight as resume_path
    from tpframe.errors import ConfigError
    from tpframe.run.preflight import check_checkpoint_dir
    from tpframe.training.config import load_config

    ckpts = saved_run / "checkpoints"

    def check(*overrides):
        cfg = load_config(
            os.path.join(REPO, "configs/tiny_cpu.yaml"), merge_overrides(TINY, ["parallel.tp=1"], overrides)
        )
        check_checkpoint_dir(cfg, resume_path(cfg)[0])

    check(f"train.run_dir={saved_run}", "checkpoint.auto_resume=true")
    check(f"train.run_dir={saved_run}", f"checkpoint.load={ckpts}/step_00000002")
    check(f"train.run_dir={tmp_path}/new", f"checkpoint.load={ckpts}")
    (tmp_path / "empty").mkdir()
    check(f"train.run_dir={tmp_path}/new", f"checkpoint.dir={tmp_path}/empty", f"checkpoint.load={ckpts}")
    check(f"train.run_dir={saved_run}", "checkpoint.save_on_signal=false")  # interval=0, save_at_end=false: no save
    with pytest.raises(ConfigError, match="no 'latest' file names one to resume"):
        (tmp_path / "nolatest").mkdir()
        shutil.copytree(ckpts / "step_00000002", tmp_path / "nolatest" / "step_00000002")
        check(f"train.run_dir={tmp_path}/new", f"checkpoint.dir={tmp_path}/nolatest", "checkpoint.auto_resume=true")


def test_a_metrics_file_is_appended_to_only_when_tpframe_wrote_it(tmp_path, saved_run):
    from tpframe.observe.logger import foreign_metrics

    assert foreign_metrics(saved_run / "metrics.jsonl") is None
    for text, why in (
        ("", None),
        ('{"step": 3, "kind": "start", "time": 1.0}\n', None),
        ("hello world\n", "'hello world'"),
        ('{"step": 1}\n', "'{\"step\": 1}'"),
        ("[1, 2]\n", "'[1, 2]'"),
        ('{"step": true, "kind": "train"}\n', '\'{"step": true'),
        ("x" * 100, "'" + "x" * 60 + "'..."),
    ):
        (tmp_path / "m.jsonl").write_text(text)
        found = foreign_metrics(tmp_path / "m.jsonl")
        assert found == why if why is None else why in found, (text, found)


def test_a_shard_that_cannot_be_read_when_loading_is_one_line_exit_2_and_writes_nothing(
    tmp_path, saved_run, monkeypatch, capsys
):
    """checkpoint.verify=size passes a flipped byte in a shard, which only loading reads: every rank stops with one
    line naming the file (found by its CRC32), before config.yaml or metrics.jsonl is written."""
    import train
    from tests.test_ops_faults import _one_process_world

    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    shard = run / "checkpoints" / "step_00000002" / "__0_0.distcp"
    _flip(shard)
    before = {p: b for p, b in _snapshot(run).items() if p.name != ".lock"}
    monkeypatch.chdir(REPO)
    _one_process_world(monkeypatch)
    code = train.main(
        with_overrides(
            BASE, [f"train.run_dir={run}", "train.steps=3", "checkpoint.auto_resume=true", "checkpoint.verify=size"]
        )
    )
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"tpframe: config error: checkpoint file {shard} cannot be read (rank 0: "), lines[0]
    assert "it is corrupt (it fails its CRC32 check); no older checkpoint is beside it" in lines[0], lines[0]
    assert {p: b for p, b in _snapshot(run).items() if p.name != ".lock"} == before, "the run wrote a file"


def _main_restoring_rng_files(args):
    """train.main in this rank, restoring RNG files whatever the layout: loading a world-of-one checkpoint at world
    2, rank 1's read of rng_1.pt fails (there is none) while rank 0's succeeds."""
    import contextlib
    import io

    import train
    from tpframe.checkpoint import checkpointer

    checkpointer.restores_rng = lambda saved, layout: True
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = train.main(args)
    return code, err.getvalue()


def test_a_checkpoint_file_one_rank_cannot_read_stops_every_rank_alike(tmp_path, saved_run):
    """No rank waits in a collective for a rank whose read failed: every rank exits 2, rank 0 prints the line."""
    step = saved_run / "checkpoints" / "step_00000002"
    args = merge_overrides(
        ["--config", os.path.join(REPO, "configs/tiny_cpu.yaml")],
        TINY,
        ["parallel.tp=1", "train.steps=3", f"train.run_dir={tmp_path}/run", f"checkpoint.load={step}"],
    )
    (code0, err0), (code1, err1) = run_distributed(_main_restoring_rng_files, 2, args)
    assert code0 == code1 == 2 and err1 == "", (err0, err1)
    assert err0 == (
        f"tpframe: config error: checkpoint {str(step)!r} cannot be loaded (rank 1: FileNotFoundError: "
        f"[Errno 2] No such file or directory: '{step}/rng_1.pt') although its files pass their CRC32 "
        "check\n"
    ), err0
    assert not (tmp_path / "run" / "config.yaml").exists()


# -- the same through the README's launcher, with 2 processes ---------------------------------------------

# one override and one env var: every other mistake takes the same path (the parent's pre-flight), and each has its
# own case in this process above. The first through a real launcher process (its exit code and streams), the second
# through the launcher's main in this process (the same pre-flight, without another interpreter's start-up).
LAUNCH_CASES = [
    (["model.hiden=64"], {}, "unknown config key 'model.hiden'", True),
    ([], {"TPFRAME_COMM_BACKEND": "bogus"}, "env var TPFRAME_COMM_BACKEND='bogus'", False),
]


SCRIPT = ["train.py", "--config", "configs/tiny_cpu.yaml", *TINY]


def _launch(args, env=None, nproc=2, launcher=("-m", "tpframe.launch")):
    cmd = [sys.executable, *launcher, f"--nproc-per-node={nproc}", *args]
    full = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}
    full.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240, env=full)


def _launch_in_process(args, env, monkeypatch, capsys) -> subprocess.CompletedProcess:
    """tpframe.launch's main(args) in this process, with _launch's environment: its exit code and streams."""
    from tpframe import launch

    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    for key, value in {"OMP_NUM_THREADS": "1", **env}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(REPO)
    capsys.readouterr()
    code = launch.main(["--nproc-per-node=2", *args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


@pytest.mark.parametrize("overrides,env,expected,real_process", LAUNCH_CASES, ids=["key", "env"])
def test_launcher_reports_a_bad_config_in_one_line(
    overrides, env, expected, real_process, tmp_path, monkeypatch, capsys
):
    args = with_overrides([*SCRIPT, f"train.run_dir={tmp_path}/run"], overrides)
    out = _launch(args, env) if real_process else _launch_in_process(args, env, monkeypatch, capsys)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and expected in lines[0], out.stderr
    assert "Traceback" not in out.stderr + out.stdout and not (tmp_path / "run").exists()


def test_a_mistake_found_by_the_workers_is_still_one_line(tmp_path):
    """--no-check: the workers find it; rank 0 prints, rank 1 waits to be stopped, the launch exits 2."""
    out = _launch(["--no-check", *SCRIPT, f"train.run_dir={tmp_path}/run", "optim.weight_decay=nan"])
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "optim.weight_decay=nan" in lines[0], out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "run").exists()


def test_under_torchrun_every_rank_exits_2_and_the_line_is_printed_once(tmp_path):
    """torchrun still prints its own failure summary (documented in docs/operations.md); ours is the first line,
    once, and the summary's root cause is it, not a link. The other rank either exits 2 itself or is stopped by
    torchrun first (SIGTERM): which one is a race between the two ranks, so both are accepted."""
    out = _launch(
        ["--standalone", *SCRIPT, f"train.run_dir={tmp_path}/run", "model.hiden=64"],
        launcher=("-m", "torch.distributed.run"),
    )
    ours = [line for line in out.stderr.splitlines() if line.startswith("tpframe:")]
    assert out.returncode == 1 and len(ours) == 1 and "model.hiden" in ours[0], out.stderr
    codes = re.findall(r"exitcode  : (-?\d+)", out.stderr)
    assert sorted(codes) in (["2", "2"], ["-15", "2"]), out.stderr
    root = out.stderr.split("Root Cause")[1]
    assert "exitcode  : 2" in root and "traceback : tpframe: config error" in root, out.stderr
    assert out.stderr.count("traceback : tpframe: config error") == codes.count("2"), out.stderr


@pytest.mark.parametrize(
    "env",
    [{"WORLD_SIZE": "2"}, {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "1"}],
    ids=["two-ranks-one-gpu", "local-rank-past-the-gpus"],
)
def test_more_ranks_on_a_host_than_gpus_is_one_line(monkeypatch, env):
    """Two processes on a one-GPU host would otherwise fail deep in torch ("Invalid device id")."""
    import train
    from tpframe.errors import ConfigError

    for key, value in {**torchrun_env(2), **env}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"each rank needs its own GPU; launch at most 1 per host"):
        train.prepare(BASE)


# -- the tools, and the launcher with another script ------------------------------------------------------


def _tool(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"tools_{name}", os.path.join(REPO, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _metrics_file(tmp: Path, text: str) -> str:
    """A run directory whose metrics.jsonl holds `text`."""
    _file(tmp, "metrics.jsonl", text)
    return str(tmp)


def _garbled_metadata(saved: Path, tmp: Path) -> str:
    """A copy of the saved step whose DCP index is garbage of the recorded size (a size-only check passes)."""
    step = tmp / "step_00000002"
    shutil.copytree(saved / "checkpoints" / "step_00000002", step)
    (step / ".metadata").write_bytes(b"\x80" * (step / ".metadata").stat().st_size)
    return str(step)


def _foreign_safetensors(tmp: Path) -> str:
    """Somebody else's safetensors file (a Hugging Face save: format=pt, no tpframe header)."""
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp / "theirs.safetensors"), metadata={"format": "pt"})
    return str(tmp / "theirs.safetensors")


def _folder(tmp: Path, name: str, files: dict) -> str:
    """A folder `name` holding `files` (name -> text, or a callable(path) that writes it)."""
    (tmp / name).mkdir()
    for file, content in files.items():
        content(tmp / name / file) if callable(content) else (tmp / name / file).write_text(content)
    return str(tmp / name)


# (tool, argv with {ckpt} {tmp} {file} {run} in it or a builder(tmp, saved) -> argv, expected text)
TOOL_CASES = [
    ("checkpoint", [], "the following arguments are required: command (see checkpoint.py --help)"),
    # an out path generate.py would not recognise: a consolidated export is a .safetensors file, an HF one a folder;
    # refused before the (missing) checkpoint is read
    (
        "checkpoint",
        ["export", "{tmp}/none", "--format", "safetensors", "--out", "{tmp}/model.bin"],
        "is a .safetensors file",
    ),
    (
        "checkpoint",
        ["export", "{tmp}/none", "--format", "hf", "--out", "{tmp}/hf_model.safetensors"],
        "writes a directory",
    ),
    (
        "checkpoint",
        ["export", "{ckpt}"],
        "the following arguments are required: --out (see checkpoint.py export --help)",
    ),
    ("checkpoint", ["export", "{ckpt}", "--out", "{tmp}"], "is a directory; name the file"),
    # an export or an HF directory as the input: what it is, not "neither a checkpoint (no meta.json) nor ..."
    (
        "checkpoint",
        lambda t, s: ["export", _foreign_safetensors(t), "--out", f"{t}/o.safetensors"],
        "theirs.safetensors' is a .safetensors file, not a training checkpoint: export reads a step directory",
    ),
    (
        "checkpoint",
        lambda t, s: ["export", _folder(t, "hf", {"config.json": "{}"}), "--format", "hf", "--out", f"{t}/o"],
        "hf' is a Hugging Face model directory, not a training checkpoint",
    ),
    ("checkpoint", ["export", "{ckpt}", "--out", ""], "is a directory; name the file"),
    ("checkpoint", ["export", "{ckpt}", "--out", "{file}/model.safetensors"], "cannot be created: '{file}' is a file"),
    (
        "checkpoint",
        ["export", "{ckpt}", "--out", "{file}", "--format", "hf"],
        "is a file; --format hf writes a directory",
    ),
    ("checkpoint", lambda t, s: ["inspect", _garbled_metadata(s, t)], ".metadata cannot be read"),
    (
        "checkpoint",
        ["export", "{ckpt}", "--out", "/proc/tpframe/model.safetensors"],
        "--out '/proc/tpframe/model.safetensors' cannot be created: writing in '/proc' failed",
    ),
    (
        "checkpoint",
        ["export", "{ckpt}", "--format", "hf", "--out", "/sys/kernel/hf_model"],
        "--out '/sys/kernel/hf_model' cannot be created: writing in '/sys/kernel' failed",
    ),
    ("prepare_data", ["--out", "x.bin"], "the following arguments are required: INPUT (see prepare_data.py --help)"),
    (
        "prepare_data",
        ["{file}", "--out", "{tmp}/a.bin", "--out", "{tmp}/b.bin"],
        "argument --out: given twice (--out {tmp}/a.bin and --out {tmp}/b.bin); give it once (see prepare_data.py --help)",  # noqa: E501
    ),
    (
        "checkpoint",
        ["export", "{ckpt}", "--out", "{tmp}/m.safetensors", "--format", "hf", "--format", "safetensors"],
        "argument --format: given twice (--format hf and --format safetensors); give it once (see checkpoint.py export",
    ),
    ("plot_loss", ["{run}", "--force", "--out", "{tmp}/a.png", "--force"], "argument --force: given twice"),
    ("prepare_data", ["{file}", "--out", "/proc/tokens.bin"], "--out '/proc/tokens.bin' cannot be created"),
    # an --out holding what the tool did not write is kept (--force overwrites it)
    (
        "prepare_data",
        lambda t, s: [_file(t, "in.txt", "hello"), "--out", _file(t, "notes.txt", "my notes")],
        "--out '{tmp}/notes.txt' exists and is not a token file made by prepare_data.py (no sidecar "
        "'{tmp}/notes.txt.json' of format 'tpframe.tokens/1' beside it); pass --force to overwrite it",
    ),
    (
        "prepare_data",
        lambda t, s: [_file(t, "in.txt", "hello"), "--out", _file(t, "d.bin.json", "{}")[:-5]],
        "would replace '{tmp}/d.bin.json' (its sidecar's name), which is not a tpframe token sidecar; pass --force",
    ),
    (
        "checkpoint",
        lambda t, s: ["export", str(s / "checkpoints"), "--out", _foreign_safetensors(t)],
        "--out '{tmp}/theirs.safetensors' exists and is not a tpframe export (a .safetensors file whose header says "
        "format=tpframe); pass --force to overwrite it, or pick another path",
    ),
    (
        "checkpoint",
        lambda t, s: [
            "export",
            str(s / "checkpoints"),
            "--format",
            "hf",
            "--out",
            _folder(t, "mine", {"notes.md": "x", "config.json": "{}"}),
        ],
        "--out '{tmp}/mine' is a directory holding files a tpframe export does not write ('notes.md'); pass --force",
    ),
    (
        "checkpoint",
        lambda t, s: [
            "export",
            str(s / "checkpoints"),
            "--format",
            "hf",
            "--out",
            _folder(
                t, "hf", {"config.json": "{}", "model.safetensors": lambda p: shutil.copy(_foreign_safetensors(t), p)}
            ),
        ],
        "--out '{tmp}/hf' is a directory of model files without tpframe's tpframe_export.json: not a tpframe export; "
        "pass --force",
    ),
    ("plot_loss", [], "the following arguments are required: run_dir (see plot_loss.py --help)"),
    (
        "plot_loss",
        ["{run}/metrics.jsonl"],  # it said --out '{run}/metrics.jsonl/loss.png' cannot be created
        "'{run}/metrics.jsonl' is a file; pass the run directory that holds metrics.jsonl, e.g. '{run}'",
    ),
    (
        "prepare_data",
        ["{file}", "--out", "{tmp}/o.bin", "--eot-token", "<|nope|>"],  # ignored: exit 0
        "--eot-token is for --tokenizer FILE; the byte-level tokenizer ends documents with byte 0",
    ),
    (
        "prepare_data",
        ["{tmp}", "--out", "{tmp}/o.bin"],  # said "does not exist"
        "input file '{tmp}' is a directory, not a file; pass the files in it, e.g. {tmp}/*.txt",
    ),
    ("plot_loss", ["{run}", "--out", "{tmp}"], "is a directory; name the image"),
    ("plot_loss", ["{run}", "--out", "/proc/loss.png"], "--out '/proc/loss.png' cannot be created"),
    (
        "plot_loss",
        lambda t, s: [str(s), "--out", _file(t, "notes.txt", "my notes")],
        "--out '{tmp}/notes.txt' exists and is not a PNG plot_loss.py drew; pass --force",
    ),
    (
        "plot_loss",
        lambda t, s: [str(s), "--out", _file(t, "photo.png", b"\x89PNG\r\n\x1a\n" + bytes(64))],
        "--out '{tmp}/photo.png' exists and is not a PNG plot_loss.py drew; pass --force",
    ),
    ("plot_loss", lambda t, s: [_metrics_file(t, "[1, 2]\n")], "metrics.jsonl:1: not a metrics record"),
    (
        "plot_loss",
        lambda t, s: [_metrics_file(t, '{"kind": "train", "loss": 1}\n')],
        "metrics.jsonl:1: not a metrics record",
    ),
]


@pytest.mark.parametrize("case", TOOL_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(TOOL_CASES)])
def test_a_tool_given_bad_input_prints_one_line_exits_2_and_writes_nothing(case, tmp_path, saved_run, capsys):
    name, argv, expected = case
    subs = {
        "{ckpt}": str(saved_run / "checkpoints"),
        "{tmp}": str(tmp_path),
        "{run}": str(saved_run),
        "{file}": _file(tmp_path, "taken", "x"),
    }
    if callable(argv):
        argv = argv(tmp_path, saved_run)
    for key, value in subs.items():
        argv, expected = [a.replace(key, value) for a in argv], expected.replace(key, value)
    before = {p: _snapshot(p) for p in (saved_run, tmp_path)}
    code = _tool(name).main(argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and "Traceback" not in err, (code, out, err)
    assert expected in lines[0], lines[0]
    assert {p: _snapshot(p) for p in before} == before, "a tool given bad input wrote or changed a file"


def test_each_tool_replaces_its_own_earlier_output_and_anything_else_only_with_force(tmp_path, saved_run, capsys):
    from safetensors import safe_open

    from tpframe.data.tokenizer import is_token_sidecar

    prepare, plot, ckpt = _tool("prepare_data"), _tool("plot_loss"), _tool("checkpoint")
    text, out = _file(tmp_path, "in.txt", "hello world " * 50), tmp_path / "t.bin"
    assert prepare.main([text, "--out", str(out)]) == 0
    first = out.read_bytes()
    _file(tmp_path, "in.txt", "other words " * 20)
    assert prepare.main([text, "--out", str(out)]) == 0 and out.read_bytes() != first  # its own token file
    notes = _file(tmp_path, "notes.txt", "my notes")
    assert prepare.main([text, "--out", notes]) == 2 and Path(notes).read_text() == "my notes"
    assert prepare.main([text, "--out", notes, "--force"]) == 0 and is_token_sidecar(notes + ".json")

    png = tmp_path / "loss.png"
    assert plot.main([str(saved_run), "--out", str(png)]) == 0 and plot.main([str(saved_run), "--out", str(png)]) == 0
    photo = _file(tmp_path, "photo.png", b"\x89PNG\r\n\x1a\n" + bytes(64))
    assert plot.main([str(saved_run), "--out", photo]) == 2
    assert plot.main([str(saved_run), "--out", photo, "--force"]) == 0 and plot.is_plot(Path(photo))

    root = str(saved_run / "checkpoints")
    for target in (tmp_path / "m.safetensors", tmp_path / "m.safetensors", _foreign_safetensors(tmp_path)):
        force = ["--force"] if "theirs" in str(target) else []
        assert ckpt.main(["export", root, "--out", str(target), *force]) == 0
        with safe_open(str(target), "pt") as f:
            assert f.metadata()["format"] == "tpframe"

    (tmp_path / "link.safetensors").symlink_to(tmp_path / "m.safetensors")  # written through, as before the rename
    assert ckpt.main(["export", root, "--out", str(tmp_path / "link.safetensors")]) == 0
    assert (tmp_path / "link.safetensors").is_symlink()

    hf = tmp_path / "hf"
    assert ckpt.main(["export", root, "--format", "hf", "--out", str(hf)]) == 0
    (hf / "tokenizer.json").write_text("{}")  # an earlier export's tokenizer: replaced by this byte-level run's
    (hf / "tokenizer_config.json").unlink()
    assert ckpt.main(["export", root, "--format", "hf", "--out", str(hf)]) == 0
    assert sorted(p.name for p in hf.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "tpframe_export.json",
    ]
    assert (hf / "tokenizer.json").read_text() != "{}"
    (tmp_path / "empty").mkdir()
    assert ckpt.main(["export", root, "--format", "hf", "--out", str(tmp_path / "empty")]) == 0
    mine = Path(_folder(tmp_path, "mine", {"notes.md": "keep me", "config.json": "{}"}))
    assert ckpt.main(["export", root, "--format", "hf", "--out", str(mine)]) == 2
    assert ckpt.main(["export", root, "--format", "hf", "--out", str(mine), "--force"]) == 0
    assert (mine / "notes.md").read_text() == "keep me" and "model_type" in (mine / "config.json").read_text()
    assert json.loads((mine / "tpframe_export.json").read_text())["exported_by"] == "tpframe"
    assert not [p for p in tmp_path.rglob(".*")], "a temporary file or folder was left behind"
    capsys.readouterr()


def test_an_export_that_fails_half_way_leaves_the_earlier_export_as_it_was(tmp_path, saved_run, monkeypatch, capsys):
    """Written beside --out and renamed into place: a full disk mid-write costs the new export, never the old one."""
    import safetensors.torch

    ckpt, root = _tool("checkpoint"), str(saved_run / "checkpoints")
    assert ckpt.main(["export", root, "--out", str(tmp_path / "m.safetensors")]) == 0
    assert ckpt.main(["export", root, "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    before = _snapshot(tmp_path)

    def disk_full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 100)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    capsys.readouterr()
    for extra in ([], ["--format", "hf"]):
        out = str(tmp_path / ("hf" if extra else "m.safetensors"))
        assert ckpt.main(["export", root, *extra, "--out", out]) == 2
        line = capsys.readouterr().err.strip()
        assert line.startswith(f"tpframe: cannot write --out: {out!r} (No space left on device; ") and line.endswith(
            " free there); free space or write elsewhere (an earlier export there is intact)"
        ), line
    assert _snapshot(tmp_path) == before, "the earlier export was changed, or a temporary file left behind"


def test_the_write_probe_leaves_nothing_behind_and_finds_a_folder_that_takes_no_new_folders(tmp_path, monkeypatch):
    """check_creatable creates and removes a probe where the writer will write (os.access says yes to root even on
    /proc): nothing stays, whether the check passes or fails half-way (a file could be made, a folder not)."""
    from tpframe.errors import ConfigError
    from tpframe.paths import check_creatable

    (tmp_path / "run").mkdir()
    for path, directory in (
        (tmp_path / "run", True),
        (tmp_path / "new" / "deeper", True),
        (tmp_path / "x.bin", False),
        (tmp_path / "sub" / "x.bin", False),
    ):
        check_creatable(f"{str(path)!r}", path, directory=directory)
    assert [p.name for p in tmp_path.rglob("*")] == ["run"]

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "mkdir", refused)
    with pytest.raises(
        ConfigError, match=rf"^'x' cannot be created: writing in '{tmp_path}' failed \(Permission denied\)"
    ):
        check_creatable("'x'", tmp_path / "new_run", directory=True)
    check_creatable("'x'", tmp_path / "run", directory=True)  # an existing folder: only files are made in it
    assert [p.name for p in tmp_path.rglob("*")] == ["run"]


def test_the_launcher_says_a_directory_given_as_the_script_is_one(tmp_path, capsys):
    from tpframe.launch import main

    assert main(["--nproc-per-node", "1", str(tmp_path)]) == 2  # it said "does not exist"
    assert capsys.readouterr().err.splitlines() == [
        f"tpframe.launch: training script '{tmp_path}' is a directory, not a file (usage: python -m tpframe.launch "
        "--nproc-per-node N train.py ARGS...)"
    ]


def test_the_launcher_refuses_an_option_given_twice(capsys):
    from tpframe.launch import main

    assert main(["--nproc-per-node", "2", "--nproc-per-node", "4", "train.py"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "tpframe.launch: argument --nproc-per-node/--nproc_per_node: given twice (--nproc-per-node 2 and "
        "--nproc-per-node 4); give it once (usage: python -m tpframe.launch --nproc-per-node N train.py ARGS...)"
    ]


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--nproc-per-node", "2:"], "--nproc-per-node=2: must be a count N or a range MIN:MAX of counts of at least"),
        (["--nnodes", "2:", "--max-restarts", "1"], "--nnodes=2: must be a count N or a range MIN:MAX"),
        (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:notaport"], "--rdzv-endpoint=127.0.0.1:notaport must be"),
        (["--nnodes", "2", "--rdzv-endpoint", ":99999"], "--rdzv-endpoint=:99999 must be HOST:PORT"),
        (["--nnodes", "2", "--rdzv-endpoint", "[::1"], "--rdzv-endpoint=[::1 must be HOST:PORT: node 0's host name"),
    ],
)
def test_the_launcher_refuses_a_malformed_count_or_endpoint_in_one_line(argv, said, capsys):
    from tpframe.launch import main

    assert main([*argv, "train.py"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"tpframe.launch: {said}"), err


def test_ctrl_c_in_the_launchers_pre_flight_is_one_line_and_exit_130(monkeypatch, capsys):
    import tpframe.launch

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(tpframe.launch, "check_worlds", interrupted)
    assert tpframe.launch.main(["--nproc-per-node", "1", "train.py"]) == 130
    assert capsys.readouterr().err.splitlines() == [
        "tpframe.launch: stopped by SIGINT (Ctrl-C) before the workers started"
    ]


def test_the_launchers_pre_flight_runs_each_scripts_own_prepare(tmp_path, monkeypatch):
    """generate.py's `prepare` takes only world_size: the parent's pre-flight crashed importing it (its Plan
    dataclass, an unregistered module) and now runs it, as it runs train.py's."""
    from tpframe.errors import ConfigError
    from tpframe.launch import preflight

    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError, match="does not exist"):
        preflight(os.path.join(REPO, "generate.py"), ["--checkpoint", str(tmp_path / "nope"), "--prompt", "hi"], 2)
    with pytest.raises(ConfigError, match="world size 2 is not divisible by parallel.tp"):
        preflight(
            os.path.join(REPO, "train.py"), with_overrides(BASE, ["parallel.tp=4", f"train.run_dir={tmp_path}/run"]), 2
        )


def test_crc_check_names_the_first_corrupt_file_and_skips_only_what_the_launcher_verified(
    tmp_path, saved_run, monkeypatch
):
    """verify reads the files in threads and names the first corrupt one in meta.json's order; a step directory
    named by VERIFIED_ENV (tpframe.launch sets it once its own pre-flight has checked it) has its sizes checked
    only, and no other directory does."""
    from tpframe.checkpoint.files import VERIFIED_ENV, CheckpointError, verify

    step = Path(_flipped(saved_run, tmp_path, "rng_0.pt"))
    names = list(json.loads((step / "meta.json").read_text())["files"])
    later = names[-1] if names[-1] != "rng_0.pt" else names[-2]
    _flip(step / later)
    first = min(names.index("rng_0.pt"), names.index(later))
    monkeypatch.delenv(VERIFIED_ENV, raising=False)
    for env in (None, str(tmp_path / "elsewhere")):
        if env:
            monkeypatch.setenv(VERIFIED_ENV, env)
        with pytest.raises(CheckpointError, match=f"{step / names[first]} fails its CRC32 check"):
            verify(step, "crc")
    monkeypatch.setenv(VERIFIED_ENV, str(step.resolve()))
    assert verify(step, "crc")["train"]["step"] == 2


def test_the_launcher_reads_a_checkpoint_once_and_its_workers_check_sizes_only(tmp_path, saved_run, monkeypatch):
    """tpframe.launch's pre-flight at every world size of --nproc-per-node 1:2 reads each checkpoint file once (not
    once per world size), and hands the checked step directory to its workers (VERIFIED_ENV)."""
    from tpframe import launch
    from tpframe.checkpoint import files

    step = Path(_checkpoints_copy(saved_run, tmp_path)) / "step_00000002"
    read = []
    crc32 = files._crc32
    monkeypatch.setattr(files, "_crc32", lambda p: read.append(p.name) or crc32(p))
    monkeypatch.delenv(files.VERIFIED_ENV, raising=False)
    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(REPO)
    args = launch.parse_args(
        [
            "--nproc-per-node=1:2",
            "--max-restarts=1",
            *with_overrides(SCRIPT, ["parallel.tp=1", f"train.run_dir={tmp_path}/run", f"checkpoint.load={step}"]),
        ]
    )
    sizes, _, start = launch.check_worlds(args)
    assert sizes == [2, 1] and start == 2, (sizes, start)
    recorded = json.loads((step / "meta.json").read_text())["files"]
    assert sorted(read) == sorted(recorded), read  # each file once, over two pre-flights
    assert os.environ[files.VERIFIED_ENV] == str(step.resolve())
