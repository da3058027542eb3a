"""Token files: local text / JSONL -> a flat memory-mapped token file plus a JSON sidecar, and back.

    write_token_file(["a.txt", "b.jsonl"], "data/foo.bin")          # byte-level, vocab 256
    write_token_file(["b.jsonl"], "data/foo.bin", tokenizer="tok.json")  # a Hugging Face tokenizer
    stream, meta = open_token_file("data/foo.bin")                   # TokenStream over a memmap

The token file is raw little-endian `uint16` (vocab <= 65535) or `uint32`; `<file>.json` holds
format, num_tokens, dtype, vocab_size, the tokenizer, eot_id, num_documents (each ended by eot_id), sha256 of the
tokens, the sources, and for a cheap check at every start (`check_content`, multi-GB files included) the file's
mtime and the sha256 of 64 blocks of 64 KiB spread over it: a file whose blocks differ is refused; one whose mtime
differs (edited in place, or copied without its times) is hashed whole against sha256 (about 1 s per GB) and refused
if that differs.
Every document ends with the end-of-text id: byte 0 (NUL) for the byte-level tokenizer, which keeps
vocab 256 (NUL bytes inside the text are dropped), or the tokenizer's own EOT token.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from tpframe.data.corpus import BYTE_VOCAB, EOD_BYTE, TokenStream
from tpframe.paths import check_creatable, not_a_file, refuse_existing, temporary_name

FORMAT = "tpframe.tokens/1"
BYTE_SOURCES = ("synthetic", "stdlib")  # the data sources (data.source) that are byte-level: the embedded corpora
EOT_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "<｜begin▁of▁sentence｜>")
_TEXT_CHUNK = 1 << 20  # characters per text read: bounds memory on large files
SAMPLE_BLOCKS, SAMPLE_BLOCK = 64, 1 << 16  # the sampled checksum: 4 MiB read whatever the file's size


def sidecar_path(path: str | Path) -> Path:
    return Path(str(path) + ".json")


def mask_path(path: str | Path) -> Path:
    """The loss mask beside a token file of instruction data (tpframe/data/instruct.py): a byte per token."""
    return Path(str(path) + ".mask")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.uint32)


# -- tokenizers -------------------------------------------------------------------------------


class ByteTokenizer:
    """UTF-8 bytes as ids (vocab 256); EOT is byte 0, so NULs in the text are dropped."""

    vocab_size = BYTE_VOCAB
    eot_id = EOD_BYTE
    info = {"kind": "bytes"}
    special = {}  # a chat template's eos_token, bos_token: none

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8").replace(b"\0", b""), dtype=np.uint8)

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids, [starts, ends]: the characters of `text` each token spans, its bytes' character; NULs: none)."""
        starts = np.repeat(np.arange(len(text)), [len(c.encode("utf-8")) if c != "\0" else 0 for c in text])
        return self.encode(text).astype(np.int64), np.array([starts, starts + 1])

    def decode(self, ids) -> str:
        """UTF-8 text of byte ids (an incomplete or invalid sequence becomes U+FFFD)."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    @staticmethod
    def hf_json() -> dict:
        """The same tokenizer as a Hugging Face `tokenizer.json`: GPT-2's byte-to-character map (ByteLevel pre-tokenizer
        and decoder, no regex split) and a BPE with no merges whose vocabulary is the 256 byte characters at their
        byte's id, so `AutoTokenizer` encodes text to its UTF-8 bytes and decodes them back. EOT (byte 0) is no
        special token: one would need an id past the 256 bytes; config.json's eos_token_id=0 stops generation. NULs in
        the text are dropped (a normalizer), as `encode` drops them."""
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        others = [b for b in range(256) if b not in printable]
        char = {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
        return {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": [],
            "normalizer": {"type": "Replace", "pattern": {"String": "\0"}, "content": ""},
            "pre_tokenizer": byte_level,
            "post_processor": None,
            "decoder": byte_level,
            "model": {
                "type": "BPE",
                "dropout": None,
                "unk_token": None,
                "continuing_subword_prefix": None,
                "end_of_word_suffix": None,
                "fuse_unk": False,
                "byte_fallback": False,
                "ignore_merges": False,
                "vocab": {char[b]: b for b in range(256)},
                "merges": [],
            },
        }


class HFTokenizer:
    """A Hugging Face `tokenizers` JSON file; EOT is `eot_token` or the first of EOT_CANDIDATES it knows."""

    def __init__(self, path: str | Path, eot_token: str | None = None):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ValueError(
                f"--tokenizer {path} needs the 'tokenizers' package: pip install tokenizers "
                "(or leave --tokenizer out for the built-in byte-level tokenizer)"
            ) from None
        path = Path(path)
        if why := not_a_file(path):
            raise ValueError(
                f"tokenizer file {str(path)!r} {why}; pass a tokenizer.json saved by the `tokenizers` package"
            )
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises its own exception type
            raise ValueError(f"tokenizer file {str(path)!r} could not be loaded: {e}") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        names = [eot_token] if eot_token else list(EOT_CANDIDATES)
        ids = [self._tok.token_to_id(n) for n in names]
        found = [(n, i) for n, i in zip(names, ids) if i is not None]
        if not found:
            raise ValueError(
                f"tokenizer {str(path)!r} has no end-of-text token among {', '.join(names)}; "
                "pass --eot-token with a token it has"
            )
        eot_name, self.eot_id = found[0]
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        self.info = {"kind": "huggingface", "file": str(path), "sha256": digest, "eot_token": eot_name}
        own = [
            next((n for n in c if self._tok.token_to_id(n) is not None), None) for c in (EOT_CANDIDATES, BOS_CANDIDATES)
        ]
        self.special = {k: n for k, n in zip(("eos_token", "bos_token"), own) if n}  # what a chat template reads

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids, [starts, ends]: the characters of `text` each token spans)."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return np.asarray(enc.ids, dtype=np.int64), np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2).T

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


# -- reading documents ------------------------------------------------------------------------


def _count_and_replace(error: UnicodeDecodeError) -> tuple[str, int]:
    REPLACED[0] += error.end - error.start
    return "\ufffd", error.end


REPLACED = [0]  # bytes that were not UTF-8, replaced by iter_text(replace_invalid=True) since the last reset
codecs.register_error("tpframe.count", _count_and_replace)


def not_utf8(path: Path) -> str:
    with open(path, "rb") as f:
        head = f.read(8192)
    if head.startswith(b"\x1f\x8b"):
        kind, fix = "gzip-compressed", "decompress it first (gunzip)"
    elif b"\0" in head:
        kind, fix = "binary, not text", "pass text files"
    else:
        kind, fix = "not UTF-8: Latin-1 or another 8-bit encoding?", "convert it (iconv -f latin1 -t utf-8)"
    return (
        f"input {str(path)!r} is not UTF-8 text ({kind}); {fix}, or pass --replace-invalid to tokenize it with "
        "every invalid byte replaced by U+FFFD and counted"
    )


def iter_text(path: str | Path, jsonl_key: str = "text", *, replace_invalid: bool = False) -> Iterator[str | None]:
    """The text of a file as chunks, with None after each document. `.jsonl`: one JSON object per
    line, the text under `jsonl_key`; any other file: one UTF-8 document, read in chunks of whole lines
    so a large file is never held in memory at once. Bytes that are not UTF-8: ValueError, or with
    `replace_invalid` each replaced by U+FFFD and counted in REPLACED."""
    path = Path(path)
    try:
        with open(path, encoding="utf-8", errors="tpframe.count" if replace_invalid else "strict") as f:
            if path.suffix == ".jsonl":
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        yield _jsonl_text(line, jsonl_key, f"{path}:{lineno}")
                        yield None
            else:
                while chunk := "".join(f.readlines(_TEXT_CHUNK)):
                    yield chunk
                yield None
    except UnicodeDecodeError:
        raise ValueError(not_utf8(path)) from None


def _jsonl_text(line: str, key: str, where: str) -> str:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{where}: not valid JSON ({e.msg}, column {e.colno}); each line must be one JSON object"
        ) from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object with a {key!r} key, got {type(obj).__name__}")
    if key not in obj:
        keys = ", ".join(map(repr, list(obj)[:8])) or "none"
        # instruction data (tpframe/data/instruct.py reads it, with --seq-len)
        chat = "messages" in obj or {"prompt", "completion"} <= obj.keys()
        hint = "instruction data: pass --seq-len N (train.seq_len) to pack it with a loss mask" if chat else ""
        raise ValueError(f"{where}: no key {key!r} (keys: {keys}); {hint or 'pass --jsonl-key NAME'}")
    if not isinstance(obj[key], str):
        raise ValueError(f"{where}: {key!r} holds {type(obj[key]).__name__}, expected a string")
    return obj[key]


# -- writing and opening token files ----------------------------------------------------------


def is_token_sidecar(path: str | Path) -> bool:
    """Whether `path` is a sidecar write_token_file wrote (a JSON object whose format is tpframe.tokens/...)."""
    try:
        if Path(path).stat().st_size > 1 << 28:  # a sidecar lists its sources: large, but not this large
            return False
        meta = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # missing, a directory, not UTF-8, not JSON
        return False
    return isinstance(meta, dict) and str(meta.get("format", "")).startswith(FORMAT.split("/")[0] + "/")


def foreign_output(out: str | Path) -> str | None:
    """Why writing token file `out` (and its sidecar) would destroy something write_token_file did not make, or None
    when only an earlier token file (or nothing) is there."""
    out, side = Path(out), sidecar_path(out)
    if out.exists() and not is_token_sidecar(side):
        return (
            f"exists and is not a token file made by prepare_data.py (no sidecar {str(side)!r} of format "
            f"{FORMAT!r} beside it)"
        )
    if side.exists() and not is_token_sidecar(side):
        return f"would replace {str(side)!r} (its sidecar's name), which is not a tpframe token sidecar"
    return None


def check_paths(inputs: list[str | Path], out: Path, *, tokenizer, eot_token: str | None, force: bool) -> None:
    """write_token_file's refusals: inputs missing, none, or the output itself; an output that is a directory, that
    cannot be created or (without `force`) that write_token_file did not make; --eot-token without --tokenizer."""
    missing = [(str(p), why) for p in inputs if (why := not_a_file(p))]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        name, why = missing[0]
        hint = f"; pass the files in it, e.g. {os.path.join(name, '*.txt')}" if Path(name).is_dir() else ""
        raise ValueError(f"input file {name!r} {why}{more}{hint}")
    if not inputs:
        raise ValueError("no input files given; pass one or more .txt or .jsonl files")
    if eot_token is not None and not tokenizer:  # it would be ignored
        raise ValueError("--eot-token is for --tokenizer FILE; the byte-level tokenizer ends documents with byte 0")
    if not out.name or out.is_dir():
        raise ValueError(
            f"the output {str(out)!r} is a directory; name the token file, e.g. {str(out / 'tokens.bin')!r}"
        )
    overwritten = [str(p) for p in inputs if Path(p).resolve() in (out.resolve(), sidecar_path(out).resolve())]
    if overwritten:  # the rename at the end would replace the text with its own tokens
        raise ValueError(
            f"input file {overwritten[0]!r} is also the output {str(out)!r} (or its sidecar); writing "
            "would destroy it: pick another output name"
        )
    if not force and (why := foreign_output(out)):
        refuse_existing(f"--out {str(out)!r}", why)
    check_creatable(f"--out {str(out)!r}", out)


def write_token_file(
    inputs: list[str | Path],
    out: str | Path,
    tokenizer: str | Path | None = None,
    jsonl_key: str = "text",
    eot_token: str | None = None,
    force: bool = False,
    replace_invalid: bool = False,
) -> dict:
    """Tokenize `inputs` into `out` (+ `out.json`), streaming; returns the sidecar dict.

    An `out` that exists is replaced only when it is an earlier token file (its sidecar says so) or with `force`.
    Written to temporary names and renamed at the end, so a failed run leaves no half file behind.
    """
    out = Path(out)
    check_paths(inputs, out, tokenizer=tokenizer, eot_token=eot_token, force=force)
    tok = HFTokenizer(tokenizer, eot_token) if tokenizer else ByteTokenizer()
    dtype = token_dtype(tok.vocab_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp, sidecar_tmp = temporary_name(out), temporary_name(sidecar_path(out))
    digest, count, docs, eot = hashlib.sha256(), 0, 0, np.array([tok.eot_id], dtype=dtype)
    replaced = {}  # input -> bytes that were not UTF-8 (replace_invalid)
    try:
        with open(tmp, "wb") as f:
            for path in inputs:
                REPLACED[0] = 0
                for text in iter_text(path, jsonl_key, replace_invalid=replace_invalid):
                    ids = eot if text is None else tok.encode(text).astype(dtype)
                    count += write_ids(f, digest, ids)
                    docs += text is None
                if REPLACED[0]:
                    replaced[str(path)] = REPLACED[0]
        if count == docs:
            raise ValueError(f"the inputs ({', '.join(map(str, inputs))}) hold no text")
        meta = {
            **content_record(tmp),
            "format": FORMAT,
            "num_tokens": count,
            "dtype": dtype.name,
            "vocab_size": tok.vocab_size,
            "eot_id": tok.eot_id,
            "num_documents": docs,
            "tokenizer": tok.info,
            "sha256": digest.hexdigest(),
            "sources": [str(p) for p in inputs],
            **({"replaced_invalid_bytes": replaced} if replaced else {}),
        }
        sidecar_tmp.write_text(json.dumps(meta, indent=2) + "\n")
        sidecar_path(out).unlink(missing_ok=True)  # never pair an old sidecar with new tokens
        os.replace(tmp, out)
        os.replace(sidecar_tmp, sidecar_path(out))
        return meta
    finally:
        for leftover in (tmp, sidecar_tmp):
            leftover.unlink(missing_ok=True)


def write_ids(f, digest, ids: np.ndarray) -> int:
    data = ids.astype(ids.dtype.newbyteorder("<"), copy=False).tobytes()
    digest.update(data)
    f.write(data)
    return len(ids)


def sampled_sha256(path: Path) -> str:
    """sha256 of SAMPLE_BLOCKS blocks spread evenly over the file, first and last included (a small file: all)."""
    size, digest = path.stat().st_size, hashlib.sha256()
    last = max(size - SAMPLE_BLOCK, 0)
    offsets = sorted({last * i // (SAMPLE_BLOCKS - 1) for i in range(SAMPLE_BLOCKS)})
    with open(path, "rb") as f:
        for offset in offsets:
            f.seek(offset)
            digest.update(f.read(SAMPLE_BLOCK))
    return digest.hexdigest()


def content_record(path: Path) -> dict:
    """What a start checks the token file against, cheaply (`check_content`)."""
    return {"mtime_ns": path.stat().st_mtime_ns, "sampled_sha256": sampled_sha256(path)}


def check_content(path: str | Path, meta: dict, key: str = "data.path") -> None:
    """ValueError if the token file's content is no longer what its sidecar records (same size, edited in place):
    the sampled blocks always, the whole file when its mtime changed. Sidecars from before these records pass."""
    path = Path(path)
    changed = f"{key}={str(path)!r} was changed after tools/prepare_data.py made it"
    fix = f"re-make it (python tools/prepare_data.py INPUT... --out {path}) or restore the file it was"
    if "sampled_sha256" in meta and sampled_sha256(path) != meta["sampled_sha256"]:
        raise ValueError(f"{changed}: its content no longer matches the checksum in {str(sidecar_path(path))!r}; {fix}")
    if "sha256" not in meta or meta.get("mtime_ns", path.stat().st_mtime_ns) == path.stat().st_mtime_ns:
        return
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    if digest.hexdigest() != meta["sha256"]:
        raise ValueError(f"{changed} (modified since; the sha256 of its tokens differs from its sidecar's); {fix}")


def first_path(path: str | list[str] | None) -> str:
    """A run's data.path, or the first file of a blend (all of a blend's files share one tokenizer): "" if none."""
    return (path if isinstance(path, str) else path[0] if path else "") or ""


def read_sidecar(path: str | Path, key: str = "data.path") -> dict:
    """The sidecar of token file `path`, checked against the file; errors name `key` and the fix."""
    path, side = Path(path), sidecar_path(path)
    fix = f"make it with: python tools/prepare_data.py INPUT... --out {path}"
    if why := not_a_file(path):
        if path.is_dir():
            fix = "name the token file itself (python tools/prepare_data.py INPUT... --out FILE makes one)"
        raise ValueError(f"{key}={str(path)!r}: the token file {why}; {fix}")
    if not side.is_file():
        raise ValueError(f"{key}={str(path)!r}: its sidecar {str(side)!r} is missing; {fix}")
    try:
        meta = json.loads(side.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{key}={str(path)!r}: sidecar {str(side)!r} is not valid JSON ({e}); {fix}") from None
    need = {"format": str, "num_tokens": int, "dtype": str, "vocab_size": int, "tokenizer": dict}
    bad = [k for k, t in need.items() if not isinstance(meta, dict) or not isinstance(meta.get(k), t)]
    if bad or meta["format"] != FORMAT:
        what = f"lacks or mistypes {', '.join(bad)}" if bad else f"has format {meta['format']!r}, expected {FORMAT!r}"
        raise ValueError(f"{key}={str(path)!r}: sidecar {str(side)!r} {what}; {fix}")
    tok = meta["tokenizer"]
    if not (tok.get("kind") == "bytes" or tok.get("kind") == "huggingface" and isinstance(tok.get("file"), str)):
        raise ValueError(
            f"{key}={str(path)!r}: sidecar {str(side)!r} has a malformed tokenizer record {tok!r} (kind "
            f"'bytes', or 'huggingface' with its 'file'); {fix}"
        )
    if meta["vocab_size"] < 1:
        raise ValueError(
            f"{key}={str(path)!r}: sidecar {str(side)!r} says vocab_size {meta['vocab_size']}; it must be "
            f"at least 1; {fix}"
        )
    if meta["dtype"] != token_dtype(meta["vocab_size"]).name:
        raise ValueError(
            f"{key}={str(path)!r}: sidecar says dtype {meta['dtype']!r} for vocab_size {meta['vocab_size']}, "
            f"expected {token_dtype(meta['vocab_size']).name!r}; {fix}"
        )
    expected = meta["num_tokens"] * np.dtype(meta["dtype"]).itemsize
    actual = path.stat().st_size
    if actual != expected:
        raise ValueError(
            f"{key}={str(path)!r} is {actual} bytes but its sidecar says {meta['num_tokens']} {meta['dtype']} tokens "
            f"({expected} bytes): the file is truncated or the sidecar belongs to another file; {fix}"
        )
    return meta


def open_token_file(path: str | Path, key: str = "data.path") -> tuple[TokenStream, dict]:
    """A read-only memmap of a token file made by `write_token_file`, and its checked sidecar."""
    meta = read_sidecar(path, key)
    if meta["num_tokens"] == 0:
        raise ValueError(f"{key}={str(path)!r} holds no tokens; re-run tools/prepare_data.py with non-empty inputs")
    check_content(path, meta, key)
    tokens = np.memmap(path, dtype=np.dtype(meta["dtype"]).newbyteorder("<"), mode="r", shape=(meta["num_tokens"],))
    fingerprint = f"tokens-{str(meta.get('sha256', ''))[:16] or meta['num_tokens']}"
    mask = None
    if meta.get("loss_mask"):  # instruction data: packed rows and their loss mask
        file = mask_path(path)
        if not file.is_file() or file.stat().st_size != meta["num_tokens"]:
            raise ValueError(f"{key}={str(path)!r}: its loss mask {str(file)!r} is missing or truncated; re-run it")
        mask = np.memmap(file, dtype=np.uint8, mode="r", shape=(meta["num_tokens"],))
    name = f"{key}={str(path)!r}"
    stream = TokenStream(
        tokens, meta["vocab_size"], fingerprint, meta.get("eot_id"), mask, meta.get("row_tokens"), name
    )
    return stream, meta
