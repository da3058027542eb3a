"""Generation on CPU (gloo): TP=2 equals TP=1 from one checkpoint, the KV cache equals recomputing the
whole sequence, seeded sampling repeats, a mixed-length batch equals its prompts one at a time, and bad
input to generate.py is one clear line with exit code 2."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.training_utils import LLAMA_SHAPE, REPO, torchrun_env, train_in_process

# A small model with every decode-relevant option on: rotary positions, GQA, SwiGLU, RMSNorm, untied head.
ARCH = [*LLAMA_SHAPE, "model.kv_heads=2"]
PROMPTS = ["1 2 3 ", "The cat", "a", "x = 17 + "]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny model trained for 20 steps at TP=2, its checkpoint root and a safetensors export."""
    from tpframe.checkpoint.export import export_consolidated

    run = tmp_path_factory.mktemp("gen")
    run_distributed(
        train_in_process,
        2,
        [*ARCH, "parallel.tp=2", "train.steps=20", "checkpoint.save_at_end=true", f"train.run_dir={run}"],
    )
    export_consolidated(run / "checkpoints" / "step_00000020", run / "model.safetensors")
    return run


def _generate_at_tp1_and_tp2(root: str, exported: str):
    """generate.py's own prepare + run, at TP=2 and (on each rank's own group of one) at TP=1."""
    sys.path.insert(0, REPO)
    import generate as cli

    def both(argv):
        plan = cli.prepare(argv)
        return cli.run(dataclasses.replace(plan, tp=1)), cli.run(plan)

    prompt_args = [a for p in PROMPTS for a in ("--prompt", p)]
    greedy = both(["--checkpoint", root, *prompt_args, "--max-new-tokens", "12", "--greedy", "--ignore-eos"])
    compiled = cli.run(
        cli.prepare(
            ["--checkpoint", root, *prompt_args, "--max-new-tokens", "12", "--greedy", "--ignore-eos", "--compile"]
        )
    )
    from_export = cli.run(
        cli.prepare(["--checkpoint", exported, *prompt_args, "--max-new-tokens", "12", "--greedy", "--ignore-eos"])
    )
    sample = [
        "--checkpoint",
        root,
        *prompt_args,
        "--max-new-tokens",
        "12",
        "--temperature",
        "0.9",
        "--top-k",
        "40",
        "--top-p",
        "0.95",
        "--ignore-eos",
    ]
    seeded = both([*sample, "--seed", "3"])
    again = cli.run(cli.prepare([*sample, "--seed", "3"]))
    other = cli.run(cli.prepare([*sample, "--seed", "4"]))
    top_p_only = both(
        ["--checkpoint", root, *prompt_args, "--max-new-tokens", "8", "--top-p", "0.8", "--seed", "5", "--ignore-eos"]
    )
    return greedy, from_export, seeded, again, other, top_p_only, compiled


def test_tp2_generates_the_tokens_of_tp1_and_seeded_sampling_repeats(checkpoint):
    ids = lambda records: [r["token_ids"] for r in records]  # noqa: E731
    results = run_distributed(
        _generate_at_tp1_and_tp2, 2, str(checkpoint / "checkpoints"), str(checkpoint / "model.safetensors"), timeout=240
    )
    assert ids(results[0][0][0]) == ids(results[1][0][0]), "TP=1 ranks must agree"
    (tp1, tp2), from_export, (s_tp1, s_tp2), again, other, (p_tp1, p_tp2), compiled = results[0]
    assert all(len(r["token_ids"]) == 12 for r in tp2)
    assert ids(tp2) == ids(tp1), "greedy at TP=2 must give exactly TP=1's tokens"
    assert ids(from_export) == ids(tp2), "a safetensors export must generate what its checkpoint does"
    assert ids(compiled) == ids(tp2), "--compile (compiled blocks, fp32) must generate the eager tokens"
    assert ids(again) == ids(s_tp2), "the same seed must sample the same tokens"
    assert ids(s_tp1) == ids(s_tp2), "the sampling noise does not depend on the TP size"
    assert ids(other) != ids(s_tp2), "another seed should sample differently"
    assert ids(p_tp1) == ids(p_tp2), "top-p alone (gathered vocabulary) at TP=2 equals TP=1"
    assert [r["text"] for r in tp2] == [bytes(r["token_ids"]).decode("utf-8", "replace") for r in tp2]


def _cache_and_batch_checks(arch: dict):
    """Per step of a mixed-length batch: cached logits vs recomputing each row's whole sequence; and the
    batch's greedy tokens vs each prompt alone."""
    from tpframe.inference import Generator, KVCache, SamplingConfig
    from tpframe.models import BuildContext
    from tpframe.models.config import ModelConfig
    from tpframe.models.gpt import GPT
    from tpframe.parallel import initialize_parallel

    state = initialize_parallel(tp=2)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=256, hidden=64, layers=2, heads=4, max_seq_len=48, init_std=0.2, **arch)
    model = GPT(cfg, BuildContext(state.tp_comm, seed=11)).eval()
    prompts = [[5, 9, 200, 3, 77, 12, 1], [44], [7, 7, 8, 250]]
    attn = model.blocks["0"].attn
    cache = KVCache(
        model.blocks.keys(),
        batch=3,
        kv_heads=attn.kv_local,
        head_dim=attn.head_dim,
        max_len=32,
        dtype=torch.float32,
        device="cpu",
    )
    longest = max(map(len, prompts))
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    cache.reset(torch.tensor([longest - len(p) for p in prompts]))
    seqs = [list(p) for p in prompts]
    worst = 0.0
    with torch.no_grad():
        step_input = ids
        for _step in range(6):
            cache.begin(step_input.shape[1])
            cached = model(step_input, cache=cache)  # [b, V/tp]
            cache.advance(step_input.shape[1])
            for row, seq in enumerate(seqs):
                full = model(torch.tensor([seq]))[0, -1]  # recompute the row's whole sequence, no padding
                worst = max(worst, (cached[row] - full).abs().max().item())
            nxt = [int(t) for t in torch.randint(0, 256, (3,))]  # any next tokens (the same on both ranks)
            for seq, t in zip(seqs, nxt):
                seq.append(t)
            step_input = torch.tensor(nxt).view(3, 1)
        gen = Generator(model, state.tp_comm, sampling=SamplingConfig(greedy=True), vocab_size=256)
        batch = gen.generate(prompts, max_new_tokens=10).tokens
        alone = [gen.generate([p], max_new_tokens=10).tokens[0] for p in prompts]
    return worst, batch, alone


@pytest.mark.parametrize(
    "arch",
    [
        {},
        {"position": "rotary", "kv_heads": 2, "activation": "swiglu", "norm": "rmsnorm", "tie_embeddings": False},
        {"position": "rotary", "activation": "swiglu", "moe_experts": 4, "moe_top_k": 2},
        {"position": "rotary", "kv_heads": 2, "sliding_window": 4},
    ],
    ids=["learned-mha", "rotary-gqa", "moe", "sliding-window"],
)
def test_kv_cache_equals_recompute_and_mixed_batch_equals_one_at_a_time(arch):
    for worst, batch, alone in run_distributed(_cache_and_batch_checks, 2, arch, timeout=120):
        assert worst < 1e-5, f"cached logits differ from the full recompute by {worst}"
        assert batch == alone, "a prompt's tokens must not depend on the other prompts in its batch"
        assert all(len(t) == 10 for t in batch)


def _cli(argv, capsys):
    sys.path.insert(0, REPO)
    import generate as cli

    code = cli.main(argv)
    err = capsys.readouterr().err.strip()
    return code, err


def test_bad_input_is_one_clear_line_with_exit_code_2(checkpoint, tmp_path, capsys):
    root = str(checkpoint / "checkpoints")
    cases = {
        "does not exist": ["--checkpoint", str(tmp_path / "nope"), "--prompt", "hi"],
        "model's context is 32": ["--checkpoint", root, "--prompt", "y" * 40],
        "use --max-new-tokens 22 or less": ["--checkpoint", root, "--prompt", "0123456789", "--max-new-tokens", "30"],
        "--top-p must be in (0, 1]": ["--checkpoint", root, "--prompt", "hi", "--top-p", "1.5"],
        "--tp 4 but 1 process": ["--checkpoint", root, "--prompt", "hi", "--tp", "4"],
        "no prompts": ["--checkpoint", root],
        "--prompts": ["--checkpoint", root, "--prompts", str(tmp_path / "missing.txt")],
        "not a .safetensors export": ["--checkpoint", str(checkpoint / "checkpoints" / "latest"), "--prompt", "hi"],
        # a run directory, a folder of step directories without `latest`: which path to pass instead
        f"(no 'latest'); pass its checkpoints folder, {str(checkpoint / 'checkpoints')!r}": [
            "--checkpoint",
            str(checkpoint),
            "--prompt",
            "hi",
        ],
        f"(no 'latest'); pass one of its step directories, e.g. {str(tmp_path / 'steps' / 'step_00000009')!r}": [
            "--checkpoint",
            str(tmp_path / "steps"),
            "--prompt",
            "hi",
        ],
    }
    for step in ("step_00000002", "step_00000009"):
        (tmp_path / "steps" / step).mkdir(parents=True)
        (tmp_path / "steps" / step / "meta.json").write_text("{}")
    (tmp_path / "steps" / "step_00000010").mkdir()  # no meta.json: an unfinished save
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    tok = tokenizers.Tokenizer(models.WordLevel({"<unk>": 0, "<|endoftext|>": 1, "hello": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    cases["vocabulary of 3 but data.source=synthetic is byte-level"] = [
        "--checkpoint",
        root,
        "--prompt",
        "hello",
        "--tokenizer",
        str(tmp_path / "tok.json"),
    ]
    for needle, argv in cases.items():
        code, err = _cli(argv, capsys)
        assert code == 2, (needle, code, err)
        assert needle in err and len(err.splitlines()) == 1, (needle, err)
    # and through a real process
    out = subprocess.run(
        [sys.executable, "generate.py", "--checkpoint", str(tmp_path / "nope"), "--prompt", "hi"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and "does not exist" in out.stderr


def _export_with_header(tmp_path, tensors=None, **header) -> str:
    """A tiny .safetensors file (of `tensors`) whose tpframe header fields are `header` (a string, or a dict updating
    model_config)."""
    from safetensors.torch import save_file

    from tpframe.models.config import ModelConfig

    meta = {"format": "tpframe", "step": "1", "model_config": json.dumps(dataclasses.asdict(ModelConfig()))}
    for key, value in header.items():
        meta[key] = json.dumps({**json.loads(meta[key]), **value}) if isinstance(value, dict) else value
    save_file(tensors or {"x": torch.zeros(1)}, str(tmp_path / "m.safetensors"), metadata=meta)
    return str(tmp_path / "m.safetensors")


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--prompt", "hi"], "the following arguments are required: --checkpoint (see generate.py --help)"),
        (["--checkpoint", "x", "--prompt", "hi", "--temprature", "1"], "unrecognized arguments: --temprature 1"),
        (["--checkpoint", "x", "--prompt", "hi", "--seed", str(2**70)], "--seed 1180591620717411303424 does not fit"),
        (["--checkpoint", "{export}", "--prompts", "{tmp}"], "--prompts '{tmp}' is not a file"),
        (["--checkpoint", "{export}", "--prompts", "{tmp}/latin1.txt"], "is not UTF-8 text (byte 0 is 0xe9)"),
        (["--checkpoint", "{export:model_config=not json}", "--prompt", "hi"], "has a corrupt header (Expecting value"),
        (["--checkpoint", "{export:step=x}", "--prompt", "hi"], "has a corrupt header (invalid literal for int()"),
        (["--checkpoint", "{export:hidden=big}", "--prompt", "hi"], "model.hidden='big' must be an integer"),
        (["--checkpoint", "{export:heads=0}", "--prompt", "hi"], "model config cannot be built (model.heads=0)"),
        (["--checkpoint", "{export:norm=batchnorm}", "--prompt", "hi"], "model.norm='batchnorm' is not allowed"),
        *[
            (["--checkpoint", "x", "--prompt", "hi", *flags], needle)
            for flags, needle in (
                (
                    ["--temperature", "inf"],
                    "--temperature must be a finite number > 0 within float32's range (1.18e-38 to "
                    "3.4e+38; use --greedy for argmax), got inf",
                ),
                (["--temperature", "nan"], "--temperature must be a finite number > 0 within float32's range"),
                (["--temperature", "-0.5"], "got -0.5"),
                (["--temperature", "1e-40"], "got 1e-40"),  # 0 in float32: logits / 0
                (["--temperature", "1e39"], "got 1e+39"),  # inf in float32
                (["--greedy", "--temperature", "nan"], "got nan"),  # ignored by --greedy, still a mistake
                (["--greedy", "--top-k", "0"], "--top-k must be >= 1, got 0"),
                (["--top-k", "-5"], "--top-k must be >= 1, got -5"),
                (["--top-p", "nan"], "--top-p must be in (0, 1], got nan"),
                (["--top-p", "inf"], "--top-p must be in (0, 1], got inf"),
                (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
                (
                    ["--top-p", "1e-300"],
                    "--top-p must be at least 1.18e-38, float32's smallest normal number (below it is 0 "
                    "in float32 and no token would be kept; use --greedy for the most likely token), got "
                    "1e-300",
                ),  # generated nothing: the nucleus kept no token
                (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
                (["--tp", "0"], "--tp must be >= 1 (the tensor-parallel size: one process per rank), got 0"),
                (["--tp", "-1"], "--tp must be >= 1 (the tensor-parallel size: one process per rank), got -1"),
                (["--max-new-tokens", "-3"], "--max-new-tokens must be >= 1, got -3"),
                (["--top-k", "inf"], "argument --top-k: invalid int value: 'inf'"),
                (
                    ["--temperature", "0.5", "--temp", "0.8"],  # argparse kept the last one (--temp: its abbreviation)
                    "argument --temperature: given twice (--temperature 0.5 and --temperature 0.8); give it once (see generate.py "  # noqa: E501
                    "--help)",
                ),
                (
                    ["--cuda-graph", "--no-cuda-graph"],
                    "argument --cuda-graph/--no-cuda-graph: given twice (--cuda-graph and --no-cuda-graph)",
                ),
            )
        ],
    ],
    ids=[
        "no-checkpoint",
        "unknown-flag",
        "seed-beyond-64-bits",
        "prompts-dir",
        "prompts-not-utf8",
        "header-not-json",
        "header-step",
        "header-type",
        "header-heads-0",
        "header-literal",
        "temperature-inf",
        "temperature-nan",
        "temperature-negative",
        "temperature-below-float32",
        "temperature-beyond-float32",
        "greedy-temperature-nan",
        "greedy-top-k-0",
        "top-k-negative",
        "top-p-nan",
        "top-p-inf",
        "top-p-0",
        "top-p-below-float32",
        "max-new-tokens-0",
        "tp-0",
        "tp-negative",
        "max-new-tokens-negative",
        "top-k-inf",
        "temperature-twice",
        "cuda-graph-twice",
    ],
)
def test_more_bad_input_is_one_line_with_exit_code_2(argv, needle, tmp_path, capsys):
    """Arguments, prompt files and export headers that gave a traceback or argparse's usage block."""
    (tmp_path / "latin1.txt").write_bytes("\u00e9t\u00e9\n".encode("latin-1"))

    def fill(arg):
        if arg == "{export}":
            return _export_with_header(tmp_path)
        if arg.startswith("{export:"):
            key, value = arg[len("{export:") : -1].split("=", 1)
            if key in ("model_config", "step"):
                return _export_with_header(tmp_path, **{key: value})
            return _export_with_header(tmp_path, model_config={key: int(value) if value.isdigit() else value})
        return arg.replace("{tmp}", str(tmp_path))

    code, err = _cli([fill(a) for a in argv], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("tpframe: error: "), (code, err)
    assert needle.replace("{tmp}", str(tmp_path)) in err, err


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_weights_that_are_not_finite_are_one_line_with_exit_code_2(bad, tmp_path, capsys, monkeypatch):
    """They generated nothing (every logit NaN: token 0, the end of text) and exited 0."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    weights = {"embedding.weight": torch.zeros(4, 2), "blocks.0.attn.proj.weight": torch.tensor([[0.5, bad]])}
    code, err = _cli(
        ["--checkpoint", _export_with_header(tmp_path, weights), "--prompt", "a", "--max-new-tokens", "2"], capsys
    )
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err == (
        f"tpframe: error: --checkpoint '{tmp_path}/m.safetensors': tensor blocks.0.attn.proj.weight holds "
        f"1 {'NaN' if bad != bad else 'inf'} (of 2 values): weights that are not finite cannot be trained or "
        "generated from; use weights saved before they diverged"
    ), err


@pytest.mark.parametrize(
    "env,needle",
    [
        ({"WORLD_SIZE": "two"}, "env var WORLD_SIZE='two' must be an integer"),
        ({"WORLD_SIZE": "0"}, "env var WORLD_SIZE='0' must be at least 1"),
        (
            {**torchrun_env(2), "RANK": "5"},
            "env var RANK=5 must be below WORLD_SIZE=2 (launch with python -m tpframe.launch",
        ),
        ({"WORLD_SIZE": "2", "RANK": "0"}, "env var WORLD_SIZE=2 needs MASTER_ADDR, MASTER_PORT set too"),
    ],
    ids=["world-word", "world-zero", "rank-beyond-world", "no-master"],
)
def test_a_bad_launch_environment_is_one_line_with_exit_code_2(env, needle, monkeypatch, capsys):
    """The torchrun env is checked before the checkpoint is read (it gave int()'s ValueError, a ZeroDivisionError,
    or nothing at all from a rank that is not 0)."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    code, err = _cli(["--checkpoint", "x", "--prompt", "hi"], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("tpframe: error: ") and needle in err, err


@pytest.mark.parametrize(
    "name,body", [("p.txt", "The\r\n1 2 3 \r\n"), ("p.jsonl", '{"prompt": "The"}\n"1 2 3 "\n')], ids=["txt", "jsonl"]
)
def test_a_prompt_file_saved_with_a_byte_order_mark_reads_as_without(name, body, tmp_path):
    """Notepad's UTF-8 BOM went into the first prompt as 3 bytes of U+FEFF (a .jsonl file: 'not valid JSON')."""
    from tpframe.inference.text import read_prompts

    (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + body.encode())
    assert read_prompts([], str(tmp_path / name)) == ["The", "1 2 3 "]


def _stdin(data: bytes, *, tty: bool = False) -> io.TextIOWrapper:
    """A standard input holding `data` (a pipe's), or a terminal's (`tty`, which must not be read)."""
    stdin = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8")
    if tty:
        stdin.isatty = lambda: True
        stdin.buffer.read = lambda *a: pytest.fail("a terminal on stdin was read")
    return stdin


# a JSON line from stdin is a prompt as written; a BOM and CRLF line ends are dropped, blank lines skipped
STDIN_PROMPTS = b'\xef\xbb\xbf1 2 3 \r\n\n{"prompt": "The"}\r\nThe cat\n'


def test_prompts_piped_on_stdin_generate_what_the_same_file_does(checkpoint, tmp_path, capsys, monkeypatch):
    sys.path.insert(0, REPO)
    import generate as cli

    (tmp_path / "p.txt").write_bytes(STDIN_PROMPTS)
    args = ["--checkpoint", str(checkpoint / "checkpoints"), "--max-new-tokens", "4", "--greedy", "--ignore-eos"]
    capsys.readouterr()
    assert cli.main([*args, "--prompts", str(tmp_path / "p.txt")]) == 0
    from_file = capsys.readouterr().out
    assert from_file.startswith("=== prompt 1/3: '1 2 3 '\n") and '=== prompt 2/3: \'{"prompt": "The"}\'' in from_file
    monkeypatch.setattr(sys, "stdin", _stdin(STDIN_PROMPTS))
    assert cli.main([*args, "--prompts", "-"]) == 0
    assert capsys.readouterr().out == from_file
    # and through a real pipe
    out = subprocess.run(
        [sys.executable, "generate.py", *args, "--prompts", "-"],
        cwd=REPO,
        input=STDIN_PROMPTS,
        capture_output=True,
        timeout=60,
    )
    assert out.returncode == 0 and out.stdout.decode() == from_file, out.stderr.decode()


@pytest.mark.parametrize(
    "data,tty,env,needle",
    [
        (b"", False, {}, "--prompts - (standard input) held no prompts: pipe in one prompt per line"),
        (b"\n  \r\n", False, {}, "--prompts - (standard input) held no prompts"),
        (b"The\n\xe9t\xe9\n", False, {}, "--prompts - (standard input) is not UTF-8 text (byte 4 is 0xe9)"),
        (b"", True, {}, "which is a terminal; pipe the prompts in (e.g. cat prompts.txt | python generate.py"),
        (b"", True, torchrun_env(2), "not 2 process(es) of a launcher; write the prompts to a file and pass"),
    ],
    ids=["empty", "blank-lines", "not-utf8", "terminal", "two-processes"],
)
def test_bad_stdin_is_one_line_with_exit_code_2_and_no_output(data, tty, env, needle, checkpoint, capsys, monkeypatch):
    """`--prompts -`: what a pipe (or its absence) can get wrong; a terminal and the ranks of a launch are not read."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(sys, "stdin", _stdin(data, tty=tty))
    sys.path.insert(0, REPO)
    import generate as cli

    capsys.readouterr()
    code = cli.main(["--checkpoint", str(checkpoint / "checkpoints"), "--prompt", "a", "--prompts", "-"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (code, out, err)
    assert err.startswith("tpframe: error: ") and needle in err, err


def test_tpframe_launch_refuses_prompts_from_stdin_before_reading_it():
    """Its pre-flight would consume the pipe, leaving the worker none: refused at any process count."""
    sys.path.insert(0, REPO)
    import generate as cli
    from tpframe.errors import ConfigError

    with pytest.raises(ConfigError, match=r"not 1 process\(es\) of a launcher"):
        cli.prepare(["--checkpoint", "x", "--prompts", "-"], world_size=1)


def test_cli_prints_one_json_object_per_prompt(checkpoint, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1 2 3 "}\n"The cat"\n\n{"text": ""}\n')
    out = subprocess.run(
        [
            sys.executable,
            "generate.py",
            "--checkpoint",
            str(checkpoint / "checkpoints"),
            "--prompts",
            str(prompts),
            "--prompt",
            "a",
            "--max-new-tokens",
            "5",
            "--json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["prompt"] for r in records] == ["a", "1 2 3 ", "The cat", ""]
    for r in records:
        assert set(r) == {"prompt", "text", "token_ids", "tokens_per_s"} and len(r["token_ids"]) <= 5
        assert 0 not in r["token_ids"] and r["tokens_per_s"] >= 0  # stops before the end-of-text byte


def test_cli_text_output_names_each_prompt_when_there_are_several(checkpoint, capsys):
    import generate as cli

    capsys.readouterr()
    args = ["--checkpoint", str(checkpoint / "checkpoints"), "--max-new-tokens", "6", "--greedy", "--ignore-eos"]
    assert cli.main([*args, "--prompt", "1 2 3 ", "--prompt", "The"]) == 0
    lines = capsys.readouterr().out.split("\n")
    assert lines[0] == "=== prompt 1/2: '1 2 3 '"
    second = lines.index("=== prompt 2/2: 'The'")
    assert second >= 2 and lines[-1] == ""  # each completion (newlines and all) under its prompt's line
    assert cli.main([*args, "--prompt", "The"]) == 0  # one prompt: the completion alone, as a pipe wants it
    assert capsys.readouterr().out == "\n".join(lines[second + 1 :])


def test_help_keeps_its_usage_lines_and_describes_every_option(capsys):
    sys.path.insert(0, REPO)
    import generate as cli

    with pytest.raises(SystemExit):
        cli.parse_args(["--help"])
    out = capsys.readouterr().out
    assert "[--prompt ...] \\\n        [--prompts FILE]" in out, out  # the usage's continuation line stays a line
    options = out.split("\noptions:\n", 1)[1]
    for flag in ("--max-new-tokens", "--temperature", "--top-k", "--top-p"):
        line = next(line for line in options.splitlines() if line.strip().startswith(flag))
        assert "default" in line or "default" in options.split(line, 1)[1].split("\n  --", 1)[0], (flag, options)


@pytest.mark.slow
def test_tpframe_launch_runs_generate_and_checks_it_first(checkpoint, tmp_path):
    """`python -m tpframe.launch --nproc-per-node 2 generate.py ...`, the launcher train.py uses: the parent runs
    generate.py's pre-flight for the whole world (a mistake is one line, exit 2, no worker), then TP=2 generates."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)

    def launch(*args):
        return subprocess.run(
            [sys.executable, "-m", "tpframe.launch", "--nproc-per-node", "2", "generate.py", *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )

    bad = launch("--checkpoint", str(tmp_path / "nope"), "--prompt", "hi")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "does not exist" in bad.stderr, bad.stderr
    out = launch(
        "--checkpoint",
        str(checkpoint / "checkpoints"),
        "--tp",
        "2",
        "--prompt",
        "1 2 3 ",
        "--max-new-tokens",
        "4",
        "--greedy",
        "--ignore-eos",
        "--json",
    )
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    records = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(records) == 1 and len(records[0]["token_ids"]) == 4, out.stdout


def test_tokenizer_comes_from_the_token_file_sidecar(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    from tpframe.data.tokenizer import HFTokenizer, write_token_file
    from tpframe.errors import ConfigError
    from tpframe.inference.loading import ModelSource
    from tpframe.inference.text import resolve_tokenizer
    from tpframe.models.config import ModelConfig

    vocab = {"<unk>": 0, "<|endoftext|>": 1, "hello": 2, "world": 3}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    (tmp_path / "a.txt").write_text("hello world hello")
    write_token_file([tmp_path / "a.txt"], tmp_path / "d.bin", tokenizer=tmp_path / "tok.json")
    source = ModelSource(
        tmp_path, "checkpoint", ModelConfig(vocab_size=8), data={"source": "tokens", "path": str(tmp_path / "d.bin")}
    )
    found = resolve_tokenizer(source)
    assert isinstance(found, HFTokenizer) and found.eot_id == 1
    assert found.decode(found.encode("hello world")) == "hello world"
    blend = dataclasses.replace(source, data={"source": "tokens", "path": [str(tmp_path / "d.bin"), "other.bin"]})
    assert resolve_tokenizer(blend).eot_id == 1  # a blend's files share its first file's tokenizer
    with pytest.raises(ConfigError, match="vocabulary of 4 but the model only 2"):
        resolve_tokenizer(dataclasses.replace(source, model=ModelConfig(vocab_size=2)))
    (tmp_path / "d.bin.json").unlink()
    with pytest.raises(ConfigError, match="pass --tokenizer"):
        resolve_tokenizer(source)
    assert isinstance(resolve_tokenizer(source, str(tmp_path / "tok.json")), HFTokenizer)


def test_a_runs_relative_data_and_tokenizer_paths_resolve_from_any_folder(tmp_path, monkeypatch):
    """prepare_data.py and train.py ran in one folder with relative paths; generation (and the HF export's tokenizer)
    runs from another: the paths are taken from the folder the run was launched in (meta.json's cwd)."""
    tokenizers = pytest.importorskip("tokenizers")
    from pathlib import Path

    from tokenizers import models, pre_tokenizers

    from tpframe.checkpoint.hf_export import tokenizer_record
    from tpframe.data.tokenizer import HFTokenizer, write_token_file
    from tpframe.errors import ConfigError
    from tpframe.inference.loading import ModelSource
    from tpframe.inference.text import resolve_tokenizer
    from tpframe.models.config import ModelConfig

    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run.mkdir(), elsewhere.mkdir()
    tok = tokenizers.Tokenizer(models.WordLevel({"<unk>": 0, "<|endoftext|>": 1, "hi": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    monkeypatch.chdir(run)
    tok.save("tok.json")
    Path("a.txt").write_text("hi hi")
    write_token_file([Path("a.txt")], Path("d.bin"), tokenizer=Path("tok.json"))
    monkeypatch.chdir(elsewhere)
    data = {"source": "tokens", "path": "d.bin"}
    source = ModelSource(
        run / "checkpoints/step_00000001", "checkpoint", ModelConfig(vocab_size=8), data=data, cwd=str(run)
    )
    assert isinstance(resolve_tokenizer(source), HFTokenizer)
    record = tokenizer_record({"data": data}, warn=pytest.fail, cwd=str(run))
    assert record is not None and record["file"] == run / "tok.json"
    with pytest.raises(ConfigError, match="does not exist"):  # without the recorded folder: relative to this one
        resolve_tokenizer(dataclasses.replace(source, cwd=None))


@pytest.mark.slow
def test_decode_benchmark_runs_hugging_face_at_tp1_and_with_its_tp_plan_at_tp2(tmp_path):
    """benchmarks/decode.py on CPU (gloo, fp32, tiny shapes): its transformers rows, at TP=1 and with tp_plan="auto"
    at TP=2, run on the same weights as tpframe and produce the same greedy tokens."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers' tp_plan needs it
    results = tmp_path / "results.md"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "benchmarks/decode.py",
            "--layers",
            "2",
            "--hidden",
            "64",
            "--ffn",
            "128",
            "--heads",
            "4",
            "--vocab",
            "256",
            "--prompt-len",
            "8",
            "--new-tokens",
            "4",
            "--reps",
            "1",
            "--batches",
            "1,2",
            "--hf",
            "eager",
            "--hf-tp",
            "eager",
            "--modes",
            "nccl-eager",
            "--results",
            str(results),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    text = results.read_text()
    rows = [line for line in text.splitlines() if "tp_plan=auto" in line and line.startswith("| 2 |")]
    assert len(rows) == 2 and "failed" not in text, text
    agree = [line for line in text.splitlines() if line.startswith("- HF")]
    assert len(agree) == 4 and all(": 100% of greedy tokens" in line for line in agree), agree
