"""Instruction data: JSONL records -> token rows packed for fine-tuning, with a loss mask (tools/prepare_data.py
--seq-len).

    {"prompt": "2+3=", "completion": "5"}                                  # prompt + completion, as plain text
    {"messages": [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}]}   # a conversation

A conversation is rendered by the tokenizer's own chat template (tokenizer_config.json's `chat_template` or the
chat_template.jinja beside it, or --chat-template FILE) with Jinja as transformers renders it (a sandbox, trim_blocks,
lstrip_blocks, `raise_exception`, `{% generation %}`). Only assistant turns carry a loss: what the template marks with
{% generation %}, else the text of a turn from where it departs from the prompt rendered up to it (with
add_generation_prompt), tokens any of whose characters lie there; for prompt/completion, the completion and the
end-of-document token that follows it (the model learns to stop). Each example ends with the end-of-document token
(it may appear nowhere inside one: model.attention_mask=document cuts there) and examples are packed, in order,
into rows of seq_len tokens; a row's rest is end-of-document tokens without loss. An example longer than a row is
skipped and counted; a malformed record, or one the template fails on, is refused, naming its file and line.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import numpy as np
from jinja2 import TemplateError, TemplateSyntaxError, UndefinedError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tpframe.data.tokenizer import (
    FORMAT,
    REPLACED,
    ByteTokenizer,
    HFTokenizer,
    check_paths,
    content_record,
    mask_path,
    not_utf8,
    sidecar_path,
    token_dtype,
    write_ids,
)
from tpframe.paths import temporary_name

ROLES = ("system", "user", "assistant", "tool")


class TemplateFailure(Exception):
    """A chat template's own error on a record: its raise_exception, an undefined name, a wrong type."""


class _Generation(Extension):
    """transformers' `{% generation %}...{% endgeneration %}`: the assistant text inside carries the loss; its
    character spans are collected in `spans` while a render appends its output to `out`."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

    def _mark(self, caller):
        text, start = caller(), sum(map(len, self.out))
        self.spans.append((start, start + len(text)))
        return text


def chat_renderer(template: str, special: dict[str, str], *, name: str = "the chat template"):
    """render(messages, add_generation_prompt) -> (text, the spans {% generation %} marks), for a chat template
    (Jinja source) as transformers renders it; `special`: bos_token, eos_token ... as the template reads them.
    TemplateFailure where it fails on a record; ValueError (naming `name`) where it does not compile."""

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _Generation])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)  # Llama 3.1's date line, as transformers
    try:
        compiled = env.from_string(template)
    except TemplateSyntaxError as e:
        raise ValueError(f"{name}: line {e.lineno}: {e.message}; fix the template") from None
    marks = env.extensions[_Generation.identifier]

    def render(messages, add_generation_prompt):
        marks.out, marks.spans = [], []
        try:
            for chunk in compiled.generate(messages=messages, add_generation_prompt=add_generation_prompt, **special):
                marks.out.append(chunk)
        except UndefinedError as e:
            raise TemplateFailure(
                f"{e} (pass --tokenizer the model's directory: its tokenizer_config.json names its special tokens)"
            ) from None
        except Exception as e:  # the template is code: whatever it raises is about this record
            raise TemplateFailure(str(e) if isinstance(e, TemplateError) else f"{type(e).__name__}: {e}") from None
        return "".join(marks.out), marks.spans

    return render


def _record(line: str, where: str) -> dict:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg}, column {e.colno})") from None
    ok = isinstance(obj, dict) and (
        isinstance(obj.get("prompt"), str) and isinstance(obj.get("completion"), str) or "messages" in obj
    )
    if not ok:
        raise ValueError(f'{where}: expected {{"prompt": str, "completion": str}} or {{"messages": [...]}}')
    messages = obj.get("messages")
    if "messages" in obj:
        bad = [
            i
            for i, m in enumerate(messages if isinstance(messages, list) else [None])
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str)
        ]
        if bad:
            raise ValueError(
                f"{where}: message {bad[0]} needs a role ({', '.join(ROLES)}) and a string content"
                if isinstance(messages, list)
                else f"{where}: messages must be a list of {{role, content}}"
            )
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"{where}: the conversation has no assistant turn (nothing to learn)")
    return obj


def text_and_spans(obj: dict, render, where: str) -> tuple[str, list[tuple[int, int]]]:
    """An example's text and the character spans that carry a loss: the completion, the spans the template marks
    with {% generation %}, or else each assistant turn's text from where it departs from the generation prompt."""
    if "messages" not in obj:
        return obj["prompt"] + obj["completion"], [(len(obj["prompt"]), len(obj["prompt"]) + len(obj["completion"]))]
    if render is None:
        raise ValueError(f"{where}: a conversation needs a chat template: the tokenizer has none; pass --chat-template")
    messages = obj["messages"]
    try:
        text, spans = render(messages, False)
        for i, m in enumerate(messages if not spans else ()):
            if m["role"] == "assistant":
                prompt, turn = render(messages[:i], True)[0], render(messages[: i + 1], False)[0]
                if not text.startswith(turn):
                    raise ValueError(
                        f"{where}: the chat template renders turn {i} differently in a longer conversation"
                    )
                spans.append((len(os.path.commonprefix([prompt, turn])), len(turn)))  # R1: the prompt adds <think>
    except TemplateFailure as e:
        raise ValueError(f"{where}: the chat template fails on it: {e}") from None
    return text, spans


def _lines(path: str, replaced: dict | None) -> Iterator[tuple[int, str]]:
    """(number, text) of each line of `path`; input that is not UTF-8: ValueError naming the file, or (`replaced`,
    --replace-invalid) each invalid byte replaced by U+FFFD, their count in replaced[path]."""
    REPLACED[0] = 0
    try:
        with open(path, encoding="utf-8", errors="strict" if replaced is None else "tpframe.count") as f:
            yield from enumerate(f, 1)
    except UnicodeDecodeError:
        raise ValueError(not_utf8(Path(path))) from None
    if REPLACED[0]:
        replaced[str(path)] = REPLACED[0]


def examples(
    paths: list[str], tok, render, *, replaced: dict | None = None
) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    """(where, token ids, loss mask) of each record, the end-of-document token appended."""
    for path in paths:
        for lineno, line in _lines(path, replaced):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            obj = _record(line, where)
            text, spans = text_and_spans(obj, render, where)
            ids, (starts, ends) = tok.encode_offsets(text)
            if (ids == tok.eot_id).any():
                raise ValueError(
                    f"{where} holds the end-of-document token {tok.eot_id} inside the example, where "
                    "model.attention_mask=document would cut it; pass --eot-token with a token no example holds"
                )
            mask, ends = np.zeros(len(ids), dtype=bool), np.maximum(ends, starts + 1)
            for a, b in spans:  # a token any of whose characters lies in a span (GPT-2: "one ", "of": "Ġof")
                mask |= (starts < b) & (ends > a) & (a < b)
            mask[:1] = False  # nothing before it in its document predicts the first token
            last = "messages" not in obj  # prompt/completion: the end of the completion is learned
            yield where, np.append(ids, tok.eot_id), np.append(mask, last)


def pack(items, seq_len: int, eot_id: int, dtype) -> Iterator[tuple[str | None, np.ndarray, np.ndarray]]:
    """Rows of `seq_len` (tokens, mask) of whole examples, in order; (where, ids, None) for each one too long."""
    row_ids, row_mask = [], []
    for where, ids, mask in items:
        if len(ids) > seq_len:
            yield where, ids, None
            continue
        if sum(map(len, row_ids)) + len(ids) > seq_len:
            yield None, *_row(row_ids, row_mask, seq_len, eot_id, dtype)
            row_ids, row_mask = [], []
        row_ids.append(ids)
        row_mask.append(mask)
    if row_ids:
        yield None, *_row(row_ids, row_mask, seq_len, eot_id, dtype)


def _row(ids: list, mask: list, seq_len: int, eot_id: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    pad = seq_len - sum(map(len, ids))
    tokens = np.concatenate([*ids, np.full(pad, eot_id)]).astype(dtype)
    return tokens, np.concatenate([*mask, np.zeros(pad, dtype=bool)]).astype(np.uint8)


def chat_template(tokenizer_dir: Path | None, template_file: str | None) -> tuple[str | None, dict[str, str], str]:
    """The chat template (--chat-template FILE, else the directory's tokenizer_config.json's or chat_template.jinja),
    the special tokens it reads, and where it comes from."""
    config = {}
    if tokenizer_dir is not None and (tokenizer_dir / "tokenizer_config.json").is_file():
        config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    special = {
        k: (v.get("content") if isinstance(v, dict) else v)
        for k, v in config.items()
        if k.endswith("_token") and isinstance(v, (str, dict))
    }
    template, name = config.get("chat_template"), f"{tokenizer_dir}/tokenizer_config.json's chat_template"
    beside = tokenizer_dir / "chat_template.jinja" if tokenizer_dir is not None else None
    if template_file or template is None and beside is not None and beside.is_file():  # what save_pretrained writes
        name = template_file or str(beside)
        template = Path(name).read_text(encoding="utf-8")
    if isinstance(template, list):  # several named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template, special, f"chat template {name}"


def _sidecar(tok, dtype, inputs, digest, *, seq_len: int, rows: int, loss: int, skipped: list) -> dict:
    return {
        "format": FORMAT,
        "num_tokens": rows * seq_len + 1,
        "dtype": dtype.name,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "tokenizer": tok.info,
        "sha256": digest.hexdigest(),
        "sources": [str(p) for p in inputs],
        "row_tokens": seq_len,  # packed rows: train.seq_len must equal it
        "loss_mask": True,  # OUT.mask, a byte per token: 1 where the token is a label that carries a loss
        "loss_tokens": loss,
        "skipped_too_long": len(skipped),
        "first_skipped": f"{skipped[0][0]} ({skipped[0][1]} tokens)" if skipped else None,
    }


def _write_rows(tmps: list[Path], packed, digest, *, eot_id: int, dtype) -> tuple[int, int, list]:
    """Write `pack`'s rows to the token and mask files `tmps`; returns (rows, tokens with a loss, skipped examples:
    (where, tokens))."""
    rows, loss, skipped = 0, 0, []
    with open(tmps[0], "wb") as f, open(tmps[1], "wb") as g:
        for where, ids, mask in packed:
            if mask is None:
                skipped.append((where, len(ids)))
                continue
            rows, loss = rows + 1, loss + int(mask.sum())
            write_ids(f, digest, ids)
            g.write(mask.tobytes())
        write_ids(f, digest, np.array([eot_id], dtype=dtype))  # the last row's last label
        g.write(b"\0")
    return rows, loss, skipped


def write_instruction_file(
    inputs: list[str],
    out: str | Path,
    tokenizer: str | None,
    *,
    seq_len: int,
    eot_token: str | None = None,
    template: tuple[str | None, dict[str, str], str] = (None, {}, ""),
    force: bool = False,
    replace_invalid: bool = False,
) -> dict:
    """Tokenize the records of `inputs` into rows of `seq_len` at `out`, their loss mask at OUT.mask (a byte per
    token) and the sidecar OUT.json; returns the sidecar. `template`: (chat template, its special tokens, its name);
    the tokenizer's own end-of-text and begin-of-text tokens are its eos_token and bos_token unless it names them;
    `replace_invalid`: bytes that are not UTF-8 become U+FFFD, counted (else refused)."""
    out = Path(out)
    check_paths(inputs, out, tokenizer=tokenizer, eot_token=eot_token, force=force)
    if seq_len < 2:
        raise ValueError(f"--seq-len {seq_len}: a row needs at least 2 tokens (use train.seq_len)")
    tok = HFTokenizer(tokenizer, eot_token) if tokenizer else ByteTokenizer()
    source, special, name = template
    render = chat_renderer(source, {**tok.special, **special}, name=name) if source else None
    dtype, files = token_dtype(tok.vocab_size), (out, mask_path(out), sidecar_path(out))
    tmps = [temporary_name(p) for p in files]
    digest, seen = hashlib.sha256(), [0]
    replaced = {} if replace_invalid else None

    def counted(items):
        for item in items:
            seen[0] += 1
            yield item

    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        packed = pack(counted(examples(inputs, tok, render, replaced=replaced)), seq_len, tok.eot_id, dtype)
        rows, loss, skipped = _write_rows(tmps, packed, digest, eot_id=tok.eot_id, dtype=dtype)
        if rows == 0:
            raise ValueError(f"no example of {', '.join(inputs)} fits in --seq-len {seq_len} tokens")
        meta = _sidecar(tok, dtype, inputs, digest, seq_len=seq_len, rows=rows, loss=loss, skipped=skipped)
        meta["num_documents"] = seen[0] - len(skipped)
        if replaced:
            meta["replaced_invalid_bytes"] = replaced
        meta.update(content_record(tmps[0]))  # what a start checks the file against (tokenizer.check_content)
        tmps[2].write_text(json.dumps(meta, indent=2) + "\n")
        sidecar_path(out).unlink(missing_ok=True)  # never pair an old sidecar with new tokens
        for tmp, path in zip(tmps, files):
            os.replace(tmp, path)
        return meta
    finally:
        for leftover in tmps:
            leftover.unlink(missing_ok=True)
