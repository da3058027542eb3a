"""Instruction data: JSONL records -> token rows packed for fine-tuning, with a loss mask (tools/prepare_data.py
--seq-len).

    {"prompt": "2+3=", "completion": "5"}                                  # prompt + completion, as plain text
    {"messages": [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}]}   # a conversation

A conversation is rendered by the tokenizer's own chat template (tokenizer_config.json's `chat_template`, or
--chat-template FILE) with Jinja as transformers renders it (a sandbox, trim_blocks, lstrip_blocks,
`raise_exception`). Only assistant turns carry a loss: the text a turn adds past the prompt rendered up to it (with
add_generation_prompt), tokens whose first character lies there; for prompt/completion, the completion and the
end-of-document token that follows it (the model learns to stop). Each example ends with the end-of-document token
(it may appear nowhere inside one: model.attention_mask=document cuts there) and examples are packed, in order,
into rows of seq_len tokens; a row's rest is end-of-document tokens without loss. An example longer than a row is
skipped and counted; a malformed record is refused, naming its file and line.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from tpframe.data.tokenizer import (
    FORMAT,
    ByteTokenizer,
    HFTokenizer,
    check_paths,
    content_record,
    mask_path,
    sidecar_path,
    token_dtype,
    write_ids,
)
from tpframe.paths import temporary_name

ROLES = ("system", "user", "assistant", "tool")


def chat_renderer(template: str, special: dict[str, str]):
    """render(messages, add_generation_prompt) -> str, for a chat template (Jinja source), as transformers renders
    it; `special`: bos_token, eos_token ... as the template reads them."""
    from jinja2 import TemplateError, ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    compiled = env.from_string(template)
    return lambda messages, add_generation_prompt: compiled.render(
        messages=messages, add_generation_prompt=add_generation_prompt, **special
    )


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
    if messages is not None:
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
    """An example's text and the character spans that carry a loss."""
    if "messages" not in obj:
        return obj["prompt"] + obj["completion"], [(len(obj["prompt"]), len(obj["prompt"]) + len(obj["completion"]))]
    if render is None:
        raise ValueError(f"{where}: a conversation needs a chat template: the tokenizer has none; pass --chat-template")
    messages = obj["messages"]
    text, spans = render(messages, False), []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            start, end = len(render(messages[:i], True)), render(messages[: i + 1], False)
            if not text.startswith(end) or start > len(end):
                raise ValueError(f"{where}: the chat template renders turn {i} differently in a longer conversation")
            spans.append((start, len(end)))
    return text, spans


def examples(paths: list[str], tok, render) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    """(where, token ids, loss mask) of each record, the end-of-document token appended."""
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                obj = _record(line, where)
                text, spans = text_and_spans(obj, render, where)
                ids, starts = tok.encode_offsets(text)
                if (ids == tok.eot_id).any():
                    raise ValueError(
                        f"{where} holds the end-of-document token {tok.eot_id} inside the example, where "
                        "model.attention_mask=document would cut it; pass --eot-token with a token no example holds"
                    )
                mask = np.zeros(len(ids), dtype=bool)
                for a, b in spans:
                    mask |= (starts >= a) & (starts < b)
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


def chat_template(tokenizer_dir: Path | None, template_file: str | None) -> tuple[str | None, dict[str, str]]:
    """The chat template (--chat-template FILE, else the directory's tokenizer_config.json's) and the special
    tokens it reads."""
    config = {}
    if tokenizer_dir is not None and (tokenizer_dir / "tokenizer_config.json").is_file():
        config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    special = {
        k: (v.get("content") if isinstance(v, dict) else v)
        for k, v in config.items()
        if k.endswith("_token") and isinstance(v, (str, dict))
    }
    template = Path(template_file).read_text(encoding="utf-8") if template_file else config.get("chat_template")
    if isinstance(template, list):  # several named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template, special


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


def write_instruction_file(
    inputs: list[str],
    out: str | Path,
    tokenizer: str | None,
    *,
    seq_len: int,
    eot_token: str | None = None,
    template: tuple[str | None, dict[str, str]] = (None, {}),
    force: bool = False,
) -> dict:
    """Tokenize the records of `inputs` into rows of `seq_len` at `out`, their loss mask at OUT.mask (a byte per
    token) and the sidecar OUT.json; returns the sidecar. `template`: (chat template, its special tokens)."""
    out = Path(out)
    check_paths(inputs, out, tokenizer=tokenizer, eot_token=eot_token, force=force)
    if seq_len < 2:
        raise ValueError(f"--seq-len {seq_len}: a row needs at least 2 tokens (use train.seq_len)")
    tok = HFTokenizer(tokenizer, eot_token) if tokenizer else ByteTokenizer()
    render = chat_renderer(*template) if template[0] else None
    dtype, files = token_dtype(tok.vocab_size), (out, mask_path(out), sidecar_path(out))
    tmps = [temporary_name(p) for p in files]
    digest, rows, loss, skipped, seen = hashlib.sha256(), 0, 0, [], [0]

    def counted(items):
        for item in items:
            seen[0] += 1
            yield item

    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(tmps[0], "wb") as f, open(tmps[1], "wb") as g:
            for where, ids, mask in pack(counted(examples(inputs, tok, render)), seq_len, tok.eot_id, dtype):
                if mask is None:
                    skipped.append((where, len(ids)))
                    continue
                rows, loss = rows + 1, loss + int(mask.sum())
                write_ids(f, digest, ids)
                g.write(mask.tobytes())
            write_ids(f, digest, np.array([tok.eot_id], dtype=dtype))  # the last row's last label
            g.write(b"\0")
        if rows == 0:
            raise ValueError(f"no example of {', '.join(inputs)} fits in --seq-len {seq_len} tokens")
        meta = _sidecar(tok, dtype, inputs, digest, seq_len=seq_len, rows=rows, loss=loss, skipped=skipped)
        meta["num_documents"] = seen[0] - len(skipped)
        meta.update(content_record(tmps[0]))  # what a start checks the file against (tokenizer.check_content)
        tmps[2].write_text(json.dumps(meta, indent=2) + "\n")
        sidecar_path(out).unlink(missing_ok=True)  # never pair an old sidecar with new tokens
        for tmp, path in zip(tmps, files):
            os.replace(tmp, path)
        return meta
    finally:
        for leftover in tmps:
            leftover.unlink(missing_ok=True)
