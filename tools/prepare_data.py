#!/usr/bin/env python
"""Tokenize local text into a token file for `data.source=tokens`.

    python tools/prepare_data.py notes.txt books/*.txt --out data/books.bin
    python tools/prepare_data.py corpus.jsonl --jsonl-key text --tokenizer tokenizer.json --out data/c.bin
    python tools/prepare_data.py corpus.jsonl --tokenizer hf_model/ --out data/c.bin    # an HF model's tokenizer
    python tools/prepare_data.py chat.jsonl --tokenizer hf_model/ --seq-len 512 --out data/sft.bin   # instruction data

`.jsonl` inputs hold one JSON object per line (the text under --jsonl-key); any other file is one UTF-8 text
document; input that is not UTF-8 (binary, gzip, Latin-1) is refused, or with --replace-invalid tokenized with
each invalid byte replaced by U+FFFD, counted and reported. Writes OUT (uint16/uint32 token ids) and OUT.json (the
sidecar); an earlier token file there is replaced, anything else only with --force. The built-in tokenizer is
byte-level (vocab 256, byte 0 ends each document); --tokenizer takes a Hugging Face `tokenizers` JSON file (its EOT
token ends each document), or a Hugging Face model directory (its tokenizer.json, the end-of-text token its
tokenizer_config.json or config.json names: fine-tuning data for `checkpoint.init_from=<that directory>`).
--seq-len N reads instruction records instead ({"prompt", "completion"} or {"messages": [...]}, rendered by the
tokenizer's chat template; tpframe/data/instruct.py) and writes rows of N tokens with a loss mask (OUT.mask). Bad
input: one error line, exit code 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from tpframe.data.tokenizer import sidecar_path, write_token_file  # noqa: E402
from tpframe.errors import ArgumentParser  # noqa: E402
from tpframe.exits import DISK_FULL_OR_READ_ONLY  # noqa: E402
from tpframe.paths import write_failure  # noqa: E402


def model_dir_tokenizer(tokenizer: str | None, eot_token: str | None) -> tuple[str | None, str | None]:
    """--tokenizer as given, or for a Hugging Face model directory its tokenizer.json and end-of-text token (None,
    None for tpframe's byte-level one)."""
    if tokenizer is None or not Path(tokenizer).is_dir():
        return tokenizer, eot_token
    from tpframe.inference.text import hf_dir_tokenizer

    record = hf_dir_tokenizer(Path(tokenizer), eot_token)
    if record is None:
        raise ValueError(
            f"--tokenizer {tokenizer!r} is a directory without a tokenizer.json; pass a model directory "
            "that has one, or the tokenizer.json file"
        )
    if record["kind"] == "bytes":
        return None, eot_token
    return record["file"], record["eot_token"]


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="prepare_data.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help=".txt (or any text) and .jsonl files")
    parser.add_argument("--out", required=True, help="the token file to write, e.g. data/foo.bin")
    parser.add_argument(
        "--tokenizer",
        help="a Hugging Face tokenizers JSON file, or a Hugging Face model directory (default: byte-level)",
    )
    parser.add_argument("--jsonl-key", default="text", help="the key holding the text in .jsonl lines")
    parser.add_argument("--eot-token", help="the tokenizer's end-of-text token (default: detected)")
    parser.add_argument(
        "--seq-len",
        type=int,
        help="instruction data: JSONL records packed into rows of this many tokens (train.seq_len), with a loss mask "
        "on the completions and assistant turns",
    )
    parser.add_argument(
        "--chat-template", help="instruction data: a Jinja chat template file (default: the tokenizer's own)"
    )
    parser.add_argument(
        "--replace-invalid",
        action="store_true",
        help="tokenize input that is not valid UTF-8 with each invalid byte replaced by U+FFFD, counted and reported "
        "(without it such input is refused)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="overwrite OUT (and OUT.json) even if they are not a token file made by this tool "
        "(an earlier token file is replaced without it)",
    )
    try:
        args = parser.parse_args(argv)
        tokenizer, eot = model_dir_tokenizer(args.tokenizer, args.eot_token)
        if args.seq_len is not None or args.chat_template:
            return _instruction_data(args, tokenizer, eot)
        meta = write_token_file(
            args.inputs,
            args.out,
            tokenizer,
            args.jsonl_key,
            eot,
            force=args.force,
            replace_invalid=args.replace_invalid,
        )
    except (ValueError, OSError) as e:
        full = isinstance(e, OSError) and e.errno in DISK_FULL_OR_READ_ONLY
        print(f"prepare_data.py: error: {write_failure('--out', args.out, e) if full else e}", file=sys.stderr)
        return 2
    print(
        f"wrote {meta['num_tokens']:,} tokens ({meta['dtype']}, vocab {meta['vocab_size']}, "
        f"tokenizer {meta['tokenizer']['kind']}) from {len(args.inputs)} file(s), {meta['num_documents']:,} "
        f"document(s) of {meta['num_tokens'] / meta['num_documents']:,.0f} tokens on average (end-of-document "
        f"tokens included), to {args.out} and {sidecar_path(args.out)}"
    )
    _print_replaced(meta)
    print(f"train on it with: data.source=tokens data.path={args.out} model.vocab_size={meta['vocab_size']}")
    return 0


def _print_replaced(meta: dict) -> None:
    for path, n in meta.get("replaced_invalid_bytes", {}).items():
        print(f"replaced {n:,} byte(s) that were not UTF-8 in {path} by U+FFFD (--replace-invalid)")


def _instruction_data(args, tokenizer: str | None, eot: str | None) -> int:
    from tpframe.data.instruct import chat_template, write_instruction_file

    if args.seq_len is None:
        raise ValueError("--chat-template is for instruction data: give --seq-len N (train.seq_len) too")
    directory = Path(args.tokenizer) if args.tokenizer and Path(args.tokenizer).is_dir() else None
    template = chat_template(directory, args.chat_template)
    meta = write_instruction_file(
        args.inputs,
        args.out,
        tokenizer,
        seq_len=args.seq_len,
        eot_token=eot,
        template=template,
        force=args.force,
        replace_invalid=args.replace_invalid,
    )
    rows = (meta["num_tokens"] - 1) // args.seq_len
    print(
        f"wrote {meta['num_documents']:,} example(s) in {rows:,} rows of {args.seq_len} tokens, "
        f"{meta['loss_tokens'] / (meta['num_tokens'] - 1):.0%} of them with a loss, to {args.out} (+ .mask, .json)"
    )
    if meta["skipped_too_long"]:
        print(
            f"skipped {meta['skipped_too_long']:,} example(s) longer than --seq-len {args.seq_len} (the first: "
            f"{meta['first_skipped']})"
        )
    _print_replaced(meta)
    print(
        f"train on it with: data.source=tokens data.path={args.out} train.seq_len={args.seq_len} "
        "model.attention_mask=document"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
