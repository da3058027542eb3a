"""Text in and out of generation: the tokenizer a checkpoint's data was made with, and the prompts.

The tokenizer follows the run's data config: `synthetic` and `stdlib` are byte-level; `tokens` names a
token file whose sidecar records its tokenizer (byte-level, or a Hugging Face `tokenizers` JSON file with
its sha256). An HF model directory's is its tokenizer.json. `--tokenizer FILE` overrides it; a tokenizer whose
vocabulary differs from the one the data was made with, or exceeds the model's, is refused. A safetensors export records
no data: byte-level when the model's vocabulary is 256, else `--tokenizer` is required.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from tpframe.data.tokenizer import BYTE_SOURCES, EOT_CANDIDATES, ByteTokenizer, HFTokenizer, first_path, read_sidecar
from tpframe.errors import ConfigError
from tpframe.inference.loading import ModelSource
from tpframe.paths import recorded_path


def resolve_tokenizer(source: ModelSource, override: str | None = None, eot_token: str | None = None):
    """The tokenizer to encode prompts and decode generations with (ByteTokenizer or HFTokenizer); `eot_token`:
    the end-of-text token of `override` (default: detected)."""
    vocab = source.model.vocab_size
    recorded, expected, why = None, None, ""
    data = source.data
    if data is not None and data.get("source") in BYTE_SOURCES:
        recorded, expected = {"kind": "bytes"}, ByteTokenizer.vocab_size
        why = f"data.source={data['source']} is byte-level"
    elif source.kind == "hf" and override is None:  # --tokenizer replaces the directory's, end-of-text included
        recorded = hf_dir_tokenizer(source.path)
    elif data is not None and data.get("source") == "tokens":
        try:
            side = read_sidecar(
                recorded_path(first_path(data.get("path")), source.cwd), key="the checkpoint's data.path"
            )
            recorded, expected = side["tokenizer"], side["vocab_size"]
            why = f"the checkpoint's data {data.get('path')!r} was made with a tokenizer of vocabulary {expected}"
        except ValueError as e:
            if override is None:
                raise ConfigError(f"{e}; or pass --tokenizer FILE (the tokenizer the data was prepared with)") from None
    try:
        if override is not None:
            tok = HFTokenizer(override, eot_token)
        elif recorded is None:
            if vocab != ByteTokenizer.vocab_size:
                has = "has no tokenizer.json" if source.kind == "hf" else "records no tokenizer"
                raise ConfigError(
                    f"{str(source.path)!r} {has} and its vocabulary is {vocab}, not byte-level (256); "
                    "pass --tokenizer FILE"
                )
            tok = _byte_tokenizer(source)
        elif recorded.get("kind") == "bytes":
            tok = _byte_tokenizer(source)
        else:
            file = recorded_path(recorded["file"], source.cwd)
            tok = HFTokenizer(file, recorded.get("eot_token"))
            digest = hashlib.sha256(Path(file).read_bytes()).hexdigest()
            if recorded.get("sha256") and digest != recorded["sha256"]:
                raise ConfigError(
                    f"tokenizer {recorded['file']!r} changed since the data was prepared (sha256 differs); "
                    "pass --tokenizer with the original file"
                )
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if expected is not None and tok.vocab_size != expected:
        raise ConfigError(
            f"the tokenizer has a vocabulary of {tok.vocab_size} but {why}; pass the tokenizer "
            "the data was prepared with (or leave --tokenizer out)"
        )
    if tok.vocab_size > vocab:
        raise ConfigError(
            f"the tokenizer has a vocabulary of {tok.vocab_size} but the model only {vocab} "
            "(model.vocab_size); pass the tokenizer the model was trained with"
        )
    return tok


def _byte_tokenizer(source: ModelSource) -> ByteTokenizer:
    """The byte-level tokenizer; an HF directory's ends text where its config.json's eos_token_id says."""
    tok = ByteTokenizer()
    eos = hf_eos_id(source.path) if source.kind == "hf" else None
    if eos is not None:
        if eos >= ByteTokenizer.vocab_size:
            raise ConfigError(
                f"{str(source.path / 'config.json')!r}: eos_token_id={eos} is not a byte (0..255) of its "
                "byte-level tokenizer; set it to the end-of-text byte (tpframe's is 0) or null"
            )
        tok.eot_id = eos
    return tok


def hf_dir_tokenizer(path: Path, eot_token: str | None = None) -> dict | None:
    """The tokenizer an HF model directory ships (tokenizer.json; tpframe's byte-level one is the built-in
    tokenizer), its end-of-text token (`eot_token` where given, else tokenizer_config.json's eos_token or
    config.json's eos_token_id), checked to be one of its tokens; None without one."""
    file = path / "tokenizer.json"
    if not file.is_file():
        return None
    try:
        text = file.read_text(encoding="utf-8")
        spec = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{str(file)!r} is not a tokenizer.json ({e}); pass --tokenizer FILE") from None
    if spec == ByteTokenizer.hf_json():
        return {"kind": "bytes"}
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError(f"reading {str(file)!r} needs the 'tokenizers' package: pip install tokenizers") from None
    try:
        tok = Tokenizer.from_str(text)
    except Exception as e:  # noqa: BLE001 - the Rust side raises its own types
        raise ConfigError(f"{str(file)!r} could not be loaded ({e}); pass --tokenizer FILE") from None
    if eot_token is not None:  # named by the user: the directory's own settings are not consulted
        if tok.token_to_id(eot_token) is None:
            raise ConfigError(f"--eot-token {eot_token!r} is not a token of {str(file)!r}; name one of its tokens")
        return {"kind": "huggingface", "file": str(file), "eot_token": eot_token}
    settings = path / "tokenizer_config.json"
    eot = _json_object(settings).get("eos_token")
    eot = eot.get("content") if isinstance(eot, dict) else eot
    if eot is not None:
        if not isinstance(eot, str) or tok.token_to_id(eot) is None:
            raise ConfigError(
                f"{str(settings)!r}: eos_token={eot!r} is not a token of tokenizer.json; set it to "
                "the end-of-text token"
            )
    elif (eos_id := hf_eos_id(path)) is not None:
        eot = tok.id_to_token(eos_id)
        if eot is None:
            raise ConfigError(
                f"{str(path / 'config.json')!r}: eos_token_id={eos_id} is not a token of tokenizer.json "
                f"(vocabulary {tok.get_vocab_size()}); set it to the end-of-text token's id"
            )
    elif all(tok.token_to_id(name) is None for name in EOT_CANDIDATES):
        raise ConfigError(
            f"{str(file)!r} has no end-of-text token among {', '.join(EOT_CANDIDATES)}; name its own "
            "as eos_token in tokenizer_config.json"
        )
    return {"kind": "huggingface", "file": str(file), "eot_token": eot}


def hf_eos_ids(path: Path) -> list[int]:
    """config.json's eos_token_id as a list (Llama 3 names several end tokens; [] for none)."""
    eos = _json_object(path / "config.json").get("eos_token_id")
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise ConfigError(
            f"{str(path / 'config.json')!r}: eos_token_id={eos!r} must be a token id (or a list of "
            "them, or null); fix it in config.json"
        )
    return ids


def hf_eos_id(path: Path) -> int | None:
    """config.json's eos_token_id (the first of a list), or None."""
    return next(iter(hf_eos_ids(path)), None)


def stop_ids(source: ModelSource, tok, *, own_tokenizer: bool = True) -> list[int]:
    """The ids generation stops at: the tokenizer's end-of-text, and for an HF directory read with its own tokenizer
    (not --tokenizer: `own_tokenizer`) every id of config.json's eos_token_id (transformers stops at any of them)."""
    extra = hf_eos_ids(source.path) if source.kind == "hf" and own_tokenizer else []
    bad = [i for i in extra if i >= source.model.vocab_size]
    if bad:
        raise ConfigError(
            f"{str(source.path / 'config.json')!r}: eos_token_id {bad[0]} is outside the vocabulary "
            f"({source.model.vocab_size}); fix it in config.json"
        )
    return sorted({int(tok.eot_id), *extra})


def _json_object(path: Path) -> dict:
    """A JSON object file's contents ({} when missing); ConfigError when it is not one."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{str(path)!r} is not valid JSON ({e}); fix or delete it") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{str(path)!r} must hold a JSON object; fix or delete it")
    return value


def read_prompts(prompts: list[str] | None, file: str | None) -> list[str]:
    """--prompt values, then those of --prompts FILE: one per line, or JSONL (`.jsonl`: per line an object
    with a "prompt" or "text" key, or a JSON string). Blank lines are skipped. FILE `-` is standard input,
    always plain text, one prompt per line (a line of JSON is a prompt as written; for JSONL, use a .jsonl
    file); stdin that is a terminal, not UTF-8 or holds no prompt is refused. A file named `-`: pass `./-`."""
    out = list(prompts or [])
    if file == "-":
        lines = [line for line in _read_stdin().splitlines() if line.strip()]
        if not lines:
            raise ConfigError("--prompts - (standard input) held no prompts: pipe in one prompt per line")
        out.extend(lines)
    elif file:
        path = Path(file)
        for lineno, line in enumerate(_read_prompt_file(path, file).splitlines(), 1):
            if not line.strip():
                continue
            out.append(_jsonl_prompt(line, f"{file}:{lineno}") if path.suffix == ".jsonl" else line)
    if not out:
        raise ConfigError("no prompts: pass --prompt TEXT (repeatable) or --prompts FILE")
    return out


def _utf8(data: bytes, name: str) -> str:
    try:
        # a byte-order mark (Notepad's) is not part of the text; decoded with it, so that `byte` counts from 0
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise ConfigError(f"--prompts {name} is not UTF-8 text (byte {e.start} is {e.object[e.start]:#04x})") from None


def _read_prompt_file(path: Path, file: str) -> str:
    if not path.is_file():
        raise ConfigError(f"--prompts {file!r} " + ("is not a file" if path.exists() else "does not exist"))
    return _utf8(path.read_bytes(), repr(file))


def _read_stdin() -> str:
    """Standard input's text, for --prompts -: refused when it is a terminal (it would wait for typing) or closed."""
    stdin = sys.stdin
    if stdin is None or stdin.closed:
        raise ConfigError(
            "--prompts - reads standard input, which is closed; pipe the prompts in or pass --prompt TEXT"
        )
    if stdin.isatty():
        raise ConfigError(
            "--prompts - reads standard input, which is a terminal; pipe the prompts in "
            "(e.g. cat prompts.txt | python generate.py ... --prompts -) or pass --prompt TEXT"
        )
    return _utf8(stdin.buffer.read(), "- (standard input)")


def _jsonl_prompt(line: str, where: str) -> str:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not valid JSON ({e.msg}); each line must be a JSON object or string") from None
    if isinstance(obj, str):
        return obj
    if isinstance(obj, dict):
        for key in ("prompt", "text"):
            if isinstance(obj.get(key), str):
                return obj[key]
    raise ConfigError(f"{where}: expected a JSON string or an object with a string 'prompt' (or 'text') key")


def encode_prompts(tok, prompts: list[str], *, context: int, max_new_tokens: int) -> list[list[int]]:
    """Token ids of each prompt (an empty prompt starts a document: the end-of-text id), checked to fit
    the model's context together with the tokens to generate."""
    out = []
    for i, text in enumerate(prompts):
        ids = [int(t) for t in tok.encode(text)] or [int(tok.eot_id)]
        if len(ids) >= context:
            raise ConfigError(
                f"prompt {i + 1} is {len(ids)} tokens but the model's context is {context} "
                "(model.max_seq_len); shorten it"
            )
        if len(ids) + max_new_tokens > context:
            raise ConfigError(
                f"prompt {i + 1} ({len(ids)} tokens) + --max-new-tokens {max_new_tokens} exceeds the "
                f"model's context of {context} tokens; use --max-new-tokens {context - len(ids)} or less"
            )
        out.append(ids)
    return out
