"""Token files made by tools/prepare_data.py: round trips (bytes, JSONL, HF tokenizers) and clear errors."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tpframe.data.loader import build_data
from tpframe.data.tokenizer import open_token_file, sidecar_path, write_token_file
from tpframe.training.config import ConfigError, DataConfig

ROOT = Path(__file__).resolve().parents[1]
TEXT = "The quick brown fox jumps over the lazy dog.\nPack my box with five dozen liquor jugs.\n" * 40


def _inputs(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text(TEXT)
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text(json.dumps({"text": "first doc \u00e9", "id": 1}) + "\n\n" + json.dumps({"text": "second"}) + "\n")
    return txt, jsonl


def test_byte_level_round_trip_of_txt_and_jsonl(tmp_path):
    txt, jsonl = _inputs(tmp_path)
    out = tmp_path / "data" / "c.bin"
    meta = write_token_file([txt, jsonl], out)
    expected = TEXT.encode() + b"\0" + "first doc \u00e9".encode() + b"\0" + b"second\0"
    assert meta["num_tokens"] == len(expected) and meta["dtype"] == "uint16" and meta["vocab_size"] == 256
    assert meta["num_documents"] == 3  # the text file, and the jsonl's two (its empty line is none)
    assert json.loads(sidecar_path(out).read_text()) == meta
    stream, _ = open_token_file(out)
    assert bytes(np.asarray(stream.tokens, dtype=np.uint8)) == expected
    assert not list(out.parent.glob("*.tmp*"))
    train, valid, vocab = build_data(DataConfig(source="tokens", path=str(out), valid_fraction=0.1), 32, 4, 0, 1)
    x, y = train.next()
    assert vocab == 256 and x.shape == (4, 32) and torch.equal(x[:, 1:], y[:, :-1])
    assert bytes(x[0].to(torch.uint8).numpy()) in expected
    assert len(train.streams[0].tokens) + len(valid.streams[0].tokens) == len(expected)


def test_separate_validation_file(tmp_path):
    txt, jsonl = _inputs(tmp_path)
    write_token_file([txt], tmp_path / "train.bin")
    write_token_file([txt], tmp_path / "valid.bin")
    cfg = DataConfig(source="tokens", path=str(tmp_path / "train.bin"), valid_path=str(tmp_path / "valid.bin"))
    train, valid, _ = build_data(cfg, 32, 2, 0, 1)
    assert len(train.streams[0].tokens) == len(valid.streams[0].tokens) == len(TEXT) + 1
    write_token_file([jsonl], tmp_path / "short.bin")
    with pytest.raises(ConfigError, match=r"data.valid_path=.*short.bin.*fewer than one window"):
        build_data(DataConfig(source="tokens", path=cfg.path, valid_path=str(tmp_path / "short.bin")), 32, 2, 0, 1)


def _tiny_hf_tokenizer(path, extra_words=0):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    words = sorted(set(TEXT.replace(".", " . ").split())) + [f"w{i}" for i in range(extra_words)]
    vocab = {"<unk>": 0, "<|endoftext|>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return tok


def test_hf_tokenizer_round_trip(tmp_path):
    tok = _tiny_hf_tokenizer(tmp_path / "tok.json")
    txt, jsonl = _inputs(tmp_path)
    out = tmp_path / "hf.bin"
    meta = write_token_file([txt], out, tokenizer=tmp_path / "tok.json")
    expected = tok.encode(TEXT).ids + [1]
    assert meta["tokenizer"]["kind"] == "huggingface" and meta["eot_id"] == 1 and meta["dtype"] == "uint16"
    stream, _ = open_token_file(out)
    assert stream.vocab_size == tok.get_vocab_size() and np.asarray(stream.tokens).tolist() == expected
    # a validation file made with another tokenizer is refused
    write_token_file([txt], tmp_path / "bytes.bin")
    cfg = DataConfig(source="tokens", path=str(out), valid_path=str(tmp_path / "bytes.bin"))
    with pytest.raises(ConfigError, match="same --tokenizer"):
        build_data(cfg, 8, 1, 0, 1)


def test_vocab_above_65535_is_stored_as_uint32(tmp_path):
    _tiny_hf_tokenizer(tmp_path / "big.json", extra_words=70_000)
    txt, _ = _inputs(tmp_path)
    meta = write_token_file([txt], tmp_path / "big.bin", tokenizer=tmp_path / "big.json")
    assert meta["dtype"] == "uint32" and meta["vocab_size"] > 65535
    assert (tmp_path / "big.bin").stat().st_size == 4 * meta["num_tokens"]


def test_hf_tokenizer_eot_token_must_exist(tmp_path):
    tok = _tiny_hf_tokenizer(tmp_path / "tok.json")
    txt, _ = _inputs(tmp_path)
    with pytest.raises(ValueError, match="--eot-token"):
        write_token_file([txt], tmp_path / "x.bin", tokenizer=tmp_path / "tok.json", eot_token="<eos>")
    meta = write_token_file([txt], tmp_path / "x.bin", tokenizer=tmp_path / "tok.json", eot_token=".")
    assert meta["eot_id"] == tok.token_to_id(".") and meta["tokenizer"]["eot_token"] == "."


def test_bad_token_files_name_the_path_and_the_fix(tmp_path):
    txt, _ = _inputs(tmp_path)
    out = tmp_path / "c.bin"

    def fails(match, path=out):
        with pytest.raises(ValueError, match=match):
            build_data(DataConfig(source="tokens", path=str(path)), 32, 2, 0, 1)

    fails(r"data.path=.*missing.bin.*does not exist.*prepare_data.py", tmp_path / "missing.bin")
    write_token_file([txt], out)
    good = sidecar_path(out).read_text()
    sidecar_path(out).write_text("{not json")
    fails(r"c.bin.json.*not valid JSON.*prepare_data.py")
    sidecar_path(out).write_text(json.dumps({**json.loads(good), "vocab_size": 70000}))
    fails(r"dtype 'uint16' for vocab_size 70000")
    sidecar_path(out).write_text(json.dumps({k: v for k, v in json.loads(good).items() if k != "num_tokens"}))
    fails(r"lacks or mistypes num_tokens")
    sidecar_path(out).write_text(json.dumps({**json.loads(good), "tokenizer": {"kind": "huggingface"}}))
    fails(r"malformed tokenizer record .*'huggingface' with its 'file'")  # generate.py raised KeyError: 'file'
    sidecar_path(out).write_text(json.dumps({**json.loads(good), "vocab_size": 0}))
    fails(r"says vocab_size 0; it must be at least 1")
    sidecar_path(out).unlink()
    fails(r"sidecar .*c.bin.json.* is missing")
    sidecar_path(out).write_text(good)
    with open(out, "r+b") as f:
        f.truncate(out.stat().st_size - 2)
    fails(r"truncated")
    write_token_file([txt], out)
    sidecar_path(out).write_text(json.dumps({**json.loads(good), "vocab_size": 60}))
    train, _, _ = build_data(DataConfig(source="tokens", path=str(out)), 32, 2, 0, 1)
    with pytest.raises(ValueError, match="token id .* >= vocab_size 60"):
        train.next()


@pytest.mark.parametrize(
    "text_file,out",
    [("a.txt", "a.txt"), ("a.json", "a"), ("a.txt", ".")],
    ids=["out-is-the-input", "sidecar-is-the-input", "out-is-a-directory"],
)
def test_an_output_that_would_destroy_an_input_or_is_a_directory_is_refused(tmp_path, monkeypatch, text_file, out):
    (tmp_path / text_file).write_text(TEXT)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="is also the output|is a directory"):
        write_token_file([text_file], out)
    assert [(p.name, p.read_text()) for p in tmp_path.iterdir()] == [(text_file, TEXT)]


def test_bad_jsonl_names_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": 3}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: 'text' holds int"):
        write_token_file([bad], tmp_path / "x.bin")
    bad.write_text('{"text": "ok"}\n\n{"body": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3: no key 'text' \(keys: 'body'\); pass --jsonl-key"):
        write_token_file([bad], tmp_path / "x.bin")
    for record in ('{"messages": []}', '{"prompt": "a", "completion": "b"}'):  # chat data without --seq-len
        bad.write_text(record + "\n")
        with pytest.raises(ValueError, match=r"bad.jsonl:1: no key 'text' .*; instruction data: pass --seq-len N"):
            write_token_file([bad], tmp_path / "x.bin")
    assert not (tmp_path / "x.bin").exists() and not list(tmp_path.glob("*.tmp*"))


def _cli(*args, cwd):
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "prepare_data.py"), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=60,
    )


def _tool_main(argv, capsys) -> tuple[int, str, str]:
    """tools/prepare_data.py's main(argv) in this process: (exit code, stdout, stderr)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("prepare_data", ROOT / "tools" / "prepare_data.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    capsys.readouterr()
    code = tool.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_prepare_data_cli_writes_a_file_or_exits_2_with_one_line(tmp_path, capsys, monkeypatch):
    txt, jsonl = _inputs(tmp_path)
    monkeypatch.chdir(tmp_path)  # relative paths, as the real process below is given them
    code, out, err = _tool_main([txt, jsonl, "--out", "out/c.bin"], capsys)
    assert code == 0, err
    assert "data.source=tokens data.path=out/c.bin" in out and (tmp_path / "out/c.bin.json").is_file()
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": \n')
    for args, message, real_process in (
        (["bad.jsonl", "--out", "x.bin"], "bad.jsonl:2: not valid JSON", True),
        (["nope.txt", "--out", "x.bin"], "input file 'nope.txt' does not exist", False),
        (["a.txt", "--out", "x.bin", "--tokenizer", "nope.json"], "tokenizer file 'nope.json' does not exist", False),
    ):
        if real_process:  # one through the script itself: its exit code and streams as a shell sees them
            result = _cli(*args, cwd=tmp_path)
            code, out, err = result.returncode, result.stdout, result.stderr
        else:
            code, out, err = _tool_main(args, capsys)
        assert code == 2 and out == ""
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"prepare_data.py: error: {message}"), err
    assert not (tmp_path / "x.bin").exists()


def test_text_files_are_read_in_chunks_and_joined_exactly(tmp_path, monkeypatch):
    from tpframe.data import tokenizer as tokenize

    monkeypatch.setattr(tokenize, "_TEXT_CHUNK", 100)  # force many chunks on a small file
    txt, _ = _inputs(tmp_path)
    *chunks, end = tokenize.iter_text(txt)
    assert end is None and len(chunks) > 10 and "".join(chunks) == TEXT
    meta = write_token_file([txt], tmp_path / "c.bin")
    stream, _ = open_token_file(tmp_path / "c.bin")
    assert meta["num_tokens"] == len(TEXT) + 1 and bytes(np.asarray(stream.tokens, np.uint8)) == TEXT.encode() + b"\0"


# -- nothing silently changed: the token file under a run, and input that is not UTF-8 --------------------------


def _train(data: Path, run_dir: Path, capsys, *extra) -> tuple[int, list[str]]:
    """train.py in this process, one rank, on token file `data`: (exit code, its stderr lines)."""
    import train

    capsys.readouterr()
    args = ["--config", str(ROOT / "configs/tiny_cpu.yaml"), "parallel.tp=1", "model.vocab_size=256"]
    args += ["model.hidden=32", "model.layers=1", "model.heads=4", "train.seq_len=16", "train.micro_batch_size=2"]
    args += ["train.global_batch_size=2", "train.eval_interval=0", "checkpoint.interval=2"]
    args += [*extra] if any(x.startswith("train.steps=") for x in extra) else [*extra, "train.steps=2"]
    code = train.main([*args, "data.source=tokens", f"data.path={data}", f"train.run_dir={run_dir}"])
    return code, [x for x in capsys.readouterr().err.splitlines() if x.strip()]


def _edit_in_place(path: Path, offset: int, keep_mtime: bool) -> None:
    """Change one token at `offset` (bytes), the file's size unchanged; optionally its mtime too."""
    before = path.stat()
    data = bytearray(path.read_bytes())
    data[offset] = (data[offset] + 1) % 200 + 1
    path.write_bytes(bytes(data))
    if keep_mtime:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_a_token_file_edited_in_place_is_refused_at_resume_and_at_start_naming_it(tmp_path, capsys):
    data = tmp_path / "c.bin"
    write_token_file([_inputs(tmp_path)[0]], data)
    assert _train(data, tmp_path / "run", capsys)[0] == 0
    _edit_in_place(data, 1000, keep_mtime=True)  # a small file is sampled whole: the mtime is not needed
    for run_dir in ("run", "fresh"):  # resume, and a new run
        code, lines = _train(data, tmp_path / run_dir, capsys, "train.steps=4")
        assert code == 2 and len(lines) == 1, lines
        assert (
            f"data.path={str(data)!r} was changed after tools/prepare_data.py made it: its content no longer "
            in (lines[0])
            and "re-make it (python tools/prepare_data.py INPUT... --out" in lines[0]
        ), lines
    assert not (tmp_path / "fresh").exists() and (tmp_path / "run/checkpoints/latest").read_text() == "step_00000002"


def test_a_large_token_file_is_checked_by_sampled_blocks_then_whole_when_its_mtime_changed(tmp_path, monkeypatch):
    """A file larger than the sample: an edit between the sampled blocks passes while the mtime is the sidecar's,
    and is found by hashing the whole file once the mtime differs (any ordinary edit changes it)."""
    from tpframe.data import tokenizer

    monkeypatch.setattr(tokenizer, "SAMPLE_BLOCKS", 4)
    monkeypatch.setattr(tokenizer, "SAMPLE_BLOCK", 16)  # 64 of ~3,400 bytes sampled
    data = tmp_path / "c.bin"
    write_token_file([_inputs(tmp_path)[0]], data)
    reads = []
    monkeypatch.setattr(tokenizer.hashlib, "sha256", lambda *a, _f=tokenizer.hashlib.sha256: reads.append(1) or _f(*a))
    open_token_file(data)
    assert len(reads) == 1, "an unchanged file: the sampled checksum only"
    _edit_in_place(data, 500, keep_mtime=True)  # between the sampled blocks (0, ~1100, ~2250, the last 16 bytes)
    open_token_file(data)
    _edit_in_place(data, data.stat().st_size - 5, keep_mtime=True)  # in the last sampled block
    with pytest.raises(ValueError, match="was changed after tools/prepare_data.py made it: its content no longer"):
        open_token_file(data)
    write_token_file([_inputs(tmp_path)[0]], data)  # made again, then edited between the blocks, its mtime changed
    _edit_in_place(data, 501, keep_mtime=False)
    with pytest.raises(ValueError, match=r"was changed after tools/prepare_data.py made it \(modified since; the sha"):
        open_token_file(data)


def test_a_resume_on_re_made_data_names_the_file(tmp_path, capsys):
    data = tmp_path / "c.bin"
    write_token_file([_inputs(tmp_path)[0]], data)
    assert _train(data, tmp_path / "run", capsys)[0] == 0
    other = tmp_path / "other.txt"
    other.write_text(TEXT.replace("fox", "cat"))
    write_token_file([other], data)  # re-made: same size, other tokens
    code, lines = _train(data, tmp_path / "run", capsys, "train.steps=4")
    assert code == 2 and len(lines) == 1, lines
    assert (
        f"data.path={str(data)!r} holds other tokens than the file this checkpoint was trained on (re-made"
        in (lines[0])
        and "tokens-" not in lines[0]
    ), lines


@pytest.mark.parametrize(
    "content, kind",
    [
        (gzip.compress(TEXT.encode()), "gzip-compressed); decompress it first"),
        (bytes(range(256)) * 4, "binary, not text"),
        ("Caf\u00e9 na\u00efve \u00e0 la carte\n".encode("latin-1") * 10, "not UTF-8: Latin-1 or another"),
    ],
    ids=["gzip", "binary", "latin-1"],
)
def test_prepare_data_refuses_input_that_is_not_utf8_or_counts_it_with_replace_invalid(
    tmp_path, content, kind, capsys, monkeypatch
):
    """tools/prepare_data.py's main (in this process: its process start-up is tested above)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("prepare_data", ROOT / "tools" / "prepare_data.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.txt").write_bytes(content)
    code, (out, err) = tool.main(["in.txt", "--out", "x.bin"]), capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and out == "", err
    assert lines[0].startswith(f"prepare_data.py: error: input 'in.txt' is not UTF-8 text ({kind}"), lines
    assert "--replace-invalid" in lines[0] and not list(tmp_path.glob("x.bin*"))
    code, (out, err) = tool.main(["in.txt", "--out", "x.bin", "--replace-invalid"]), capsys.readouterr()
    bad = len(content) - len(content.decode("utf-8", errors="ignore").encode())  # the bytes that are not UTF-8
    assert code == 0 and f"replaced {bad:,} byte(s) that were not UTF-8 in in.txt by U+FFFD" in out, (out, err)
    assert json.loads((tmp_path / "x.bin.json").read_text())["replaced_invalid_bytes"] == {"in.txt": bad}
