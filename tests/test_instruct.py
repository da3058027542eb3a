"""Instruction data (tools/prepare_data.py --seq-len): chat templates rendered as transformers renders them, a loss
on assistant tokens only, packed rows of whole examples, bad records one line; training on it ignores the prompts."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest

from tests.dist_utils import run_distributed
from tests.training_utils import REPO, train_in_process

# Llama 3's template (bos, headers, <|eot_id|>), byte-level here: its markers are plain text
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SPECIAL = ("<|eot_id|>", "<|end_of_text|>")
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "1+1?"},
    {"role": "assistant", "content": "2"},
    {"role": "user", "content": "and 2+2?"},
    {"role": "assistant", "content": "4"},
]


def _hf_dir(tmp_path, template: str):
    """A byte-level Hugging Face tokenizer directory with a chat template."""
    from tpframe.data.tokenizer import ByteTokenizer

    d = tmp_path / "tok"
    d.mkdir()
    spec = ByteTokenizer.hf_json()  # bytes, and Llama 3's end of turn and end of text as special tokens
    special = dict(single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)
    spec["added_tokens"] = [{"id": 256 + i, "content": t, **special} for i, t in enumerate(SPECIAL)]
    (d / "tokenizer.json").write_text(json.dumps(spec))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, "eos_token": "<|eot_id|>"}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


def _prepare(tmp_path, records, *extra) -> SimpleNamespace:
    """tools/prepare_data.py in this process on records (JSON lines; bytes: the file): exit code, stdout, stderr."""
    data = tmp_path / "in.jsonl"
    if isinstance(records, bytes):
        data.write_bytes(records)
    else:
        data.write_text("".join(json.dumps(r) + "\n" if not isinstance(r, str) else r + "\n" for r in records))
    spec = importlib.util.spec_from_file_location("prepare_data", os.path.join(REPO, "tools", "prepare_data.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = tool.main([str(data), "--out", str(tmp_path / "sft.bin"), *extra])
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def test_chat_rendering_equals_transformers_and_only_assistant_tokens_carry_loss(tmp_path):
    transformers = pytest.importorskip("transformers")
    d = _hf_dir(tmp_path, LLAMA3)
    out = _prepare(tmp_path, [{"messages": CHAT}, {"prompt": "3+3=", "completion": "6"}], "--tokenizer", str(d),
                   "--seq-len", "512", "--eot-token", "<|end_of_text|>")  # fmt: skip
    assert out.returncode == 0, out.stderr
    tokens = np.fromfile(tmp_path / "sft.bin", dtype=np.uint16)
    mask = np.fromfile(tmp_path / "sft.bin.mask", dtype=np.uint8)
    assert len(tokens) == len(mask) == 513  # one row, and the last row's last label
    ref = transformers.AutoTokenizer.from_pretrained(d).apply_chat_template(CHAT, tokenize=True)
    ref = ref if isinstance(ref, list) else ref["input_ids"]  # transformers 5 returns a BatchEncoding
    n = len(ref)
    assert tokens[:n].tolist() == list(ref) and tokens[n] == 257  # transformers' tokens, then the end of doc
    assert tokens[:n][mask[:n] == 1].tolist() == [ord("2"), 256, ord("4"), 256]  # assistant turns and their ends
    assert tokens[n:][mask[n:] == 1].tolist() == [ord("6"), 257]  # the completion and its end: it learns to stop
    assert (tokens[n + 1 + 6 :] == 257).all() and not mask[n + 1 + 6 :].any()  # padding: end-of-document, no loss


BAD = [
    (['{"messages": [{"role": "user", "content": "hi"}]}'], "in.jsonl:1: the conversation has no assistant turn"),
    (['{"messages": [{"content": "hi"}]}'], "in.jsonl:1: message 0 needs a role"),
    (['{"prompt": "a", "completion": "b"}', "{oops"], "in.jsonl:2: not valid JSON"),
    (['{"text": "a"}'], 'in.jsonl:1: expected {"prompt": str, "completion": str} or {"messages": [...]}'),
    (['{"prompt": "' + "x" * 80 + '", "completion": "y"}'], "no example of"),  # every one too long
    (['{"prompt": "a\\u0000", "completion": "b"}'], None),  # NUL dropped by the byte tokenizer: fine
    (['{"messages": null}'], "in.jsonl:1: messages must be a list of {role, content}"),
    (['{"prompt": "a", "completion": "b", "messages": null}'], "in.jsonl:1: messages must be a list"),
    (b'{"prompt": "a\xff", "completion": "b"}\n', "input '{tmp}/in.jsonl' is not UTF-8 text"),
]


@pytest.mark.parametrize("lines,message", BAD)
def test_bad_instruction_records_are_one_line_exit_2_and_nothing_written(tmp_path, lines, message):
    (tmp_path / "t.jinja").write_text(LLAMA3)
    out = _prepare(tmp_path, lines, "--chat-template", str(tmp_path / "t.jinja"), "--seq-len", "64")
    if message is None:
        assert out.returncode == 0, out.stderr
        return
    message = message.replace("{tmp}", str(tmp_path))
    assert out.returncode == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not any((tmp_path / f"sft.bin{s}").exists() for s in ("", ".mask", ".json"))


def test_invalid_utf8_is_replaced_and_counted_with_replace_invalid(tmp_path):
    out = _prepare(tmp_path, b'{"prompt": "a\xff", "completion": "b"}\n', "--seq-len", "64", "--replace-invalid")
    assert out.returncode == 0 and "replaced 1 byte(s) that were not UTF-8 in " in out.stdout, out.stderr
    assert json.loads((tmp_path / "sft.bin.json").read_text())["replaced_invalid_bytes"] == {
        str(tmp_path / "in.jsonl"): 1
    }


MISTRAL = (  # Mistral's: roles must alternate, and each answer ends with eos_token
    "{{ bos_token }}{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}"
)
TEMPLATE_ERRORS = [
    (MISTRAL, CHAT, "in.jsonl:1: the chat template fails on it: Conversation roles must alternate user/assistant"),
    (MISTRAL, CHAT[1:3], "in.jsonl:1: the chat template fails on it: 'eos_token' is undefined (pass --tokenizer"),
    ("{% for m in messages %}{{ m.content }\n", CHAT, "chat template {tmp}/t.jinja: line 1: unexpected '}'"),
    ("{{ messages[0].content + 1 }}", CHAT, "in.jsonl:1: the chat template fails on it: TypeError: "),
]


@pytest.mark.parametrize("template,chat,message", TEMPLATE_ERRORS, ids=["raise", "undefined", "syntax", "type"])
def test_a_chat_template_that_fails_is_one_line_naming_the_record_or_the_template(tmp_path, template, chat, message):
    (tmp_path / "t.jinja").write_text(template)
    out = _prepare(tmp_path, [{"messages": chat}], "--chat-template", str(tmp_path / "t.jinja"), "--seq-len", "64")
    message = message.replace("{tmp}", str(tmp_path))
    assert out.returncode == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not any((tmp_path / f"sft.bin{s}").exists() for s in ("", ".mask", ".json"))


def _masked(tmp_path) -> tuple[list[int], list[int]]:
    """The first example of sft.bin (up to its end-of-document token) and its tokens that carry a loss."""
    eot = json.loads((tmp_path / "sft.bin.json").read_text())["eot_id"]
    tokens = np.fromfile(tmp_path / "sft.bin", dtype=np.uint16)
    mask = np.fromfile(tmp_path / "sft.bin.mask", dtype=np.uint8)
    n = int(np.argmax(tokens == eot)) + 1
    return tokens[:n].tolist(), tokens[:n][mask[:n] == 1].tolist()


def test_a_tokenizer_json_file_defines_its_own_end_of_text_token_for_the_template(tmp_path):
    (tmp_path / "t.jinja").write_text(MISTRAL)
    file = _hf_dir(tmp_path, LLAMA3) / "tokenizer.json"  # no tokenizer_config.json: eos_token is its <|eot_id|>
    out = _prepare(tmp_path, [{"messages": CHAT[1:3]}], "--tokenizer", str(file), "--eot-token", "<|end_of_text|>",
                   "--chat-template", str(tmp_path / "t.jinja"), "--seq-len", "64")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert _masked(tmp_path)[1] == [ord("2"), 256]


def test_generation_marks_the_loss_as_transformers_marks_assistant_tokens(tmp_path):
    transformers = pytest.importorskip("transformers")
    marked = LLAMA3.replace("{{ m['content'] | trim }}<|eot_id|>", "{% if m['role'] == 'assistant' %}{% generation %}"
                            "{{ m['content'] | trim }}<|eot_id|>{% endgeneration %}{% else %}{{ m['content'] | trim }}"
                            "<|eot_id|>{% endif %}")  # fmt: skip
    d = _hf_dir(tmp_path, marked)
    out = _prepare(tmp_path, [{"messages": CHAT}], "--tokenizer", str(d), "--seq-len", "512",
                   "--eot-token", "<|end_of_text|>")  # fmt: skip
    assert out.returncode == 0, out.stderr
    ref = transformers.AutoTokenizer.from_pretrained(d).apply_chat_template(
        CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    tokens, masked = _masked(tmp_path)
    assert tokens[:-1] == list(ref["input_ids"])
    assert (
        masked == [t for t, m in zip(ref["input_ids"], ref["assistant_masks"]) if m] == [ord("2"), 256, ord("4"), 256]
    )


R1 = (  # DeepSeek-R1's: the generation prompt opens <think>, a rendered answer does not
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ '<|User|>' + m['content'] }}"
    "{% else %}{{ '<|Assistant|>' + m['content'] + '<|eos|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|Assistant|><think>\\n' }}{% endif %}"
)


def test_the_loss_starts_where_the_turn_departs_from_the_generation_prompt(tmp_path):
    (tmp_path / "t.jinja").write_text(R1)
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "The answer is 4."}]
    out = _prepare(tmp_path, [{"messages": chat}], "--chat-template", str(tmp_path / "t.jinja"), "--seq-len", "64")
    assert out.returncode == 0, out.stderr
    assert bytes(_masked(tmp_path)[1]).decode() == "The answer is 4.<|eos|>"


def test_a_template_reads_todays_date_as_transformers_gives_it(tmp_path):
    """strftime_now: Llama 3.1's templates write the day's date into the system header (their fallback is a fixed
    date, which would make the data disagree with transformers' apply_chat_template)."""
    from datetime import datetime

    (tmp_path / "t.jinja").write_text("{{ 'Today ' + strftime_now('%d %b %Y') + '.' }}" + R1)
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    out = _prepare(tmp_path, [{"messages": chat}], "--chat-template", str(tmp_path / "t.jinja"), "--seq-len", "64")
    assert out.returncode == 0, out.stderr
    today = f"Today {datetime.now().strftime('%d %b %Y')}."
    assert bytes(_masked(tmp_path)[0][: len(today)]).decode() == today


def test_a_chat_template_jinja_beside_the_tokenizer_is_its_template(tmp_path):
    d = _hf_dir(tmp_path, LLAMA3)
    config = json.loads((d / "tokenizer_config.json").read_text())
    (d / "chat_template.jinja").write_text(config.pop("chat_template"))  # as transformers' save_pretrained writes it
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    out = _prepare(tmp_path, [{"messages": CHAT}], "--tokenizer", str(d), "--seq-len", "512",
                   "--eot-token", "<|end_of_text|>")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert _masked(tmp_path)[1] == [ord("2"), 256, ord("4"), 256]


def _bpe_file(tmp_path) -> str:
    """A byte-level BPE like GPT-2's that merges " of" into one token (Ġof, 257), <|endoftext|> 258."""
    from tpframe.data.tokenizer import ByteTokenizer

    spec = ByteTokenizer.hf_json()
    spec["model"]["vocab"].update({"Ġo": 256, "Ġof": 257})
    spec["model"]["merges"] = [["Ġ", "o"], ["Ġo", "f"]]
    special = dict(single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)
    spec["added_tokens"] = [{"id": 258, "content": "<|endoftext|>", **special}]
    (tmp_path / "bpe.json").write_text(json.dumps(spec))
    return str(tmp_path / "bpe.json")


@pytest.mark.parametrize(
    "record,bpe,expected",
    [
        ({"prompt": "one ", "completion": "of"}, True, [257, 258]),  # one, Ġof: the token straddles the two
        ({"prompt": "x\u0000\u0000y", "completion": "zw"}, False, [ord("z"), ord("w"), 0]),  # NULs dropped
    ],
    ids=["straddling", "nul"],
)
def test_a_token_any_of_whose_characters_is_in_the_completion_carries_the_loss(tmp_path, record, bpe, expected):
    out = _prepare(tmp_path, [record], *(["--tokenizer", _bpe_file(tmp_path)] if bpe else []), "--seq-len", "64")
    assert out.returncode == 0, out.stderr
    assert _masked(tmp_path)[1] == expected


def test_long_examples_are_skipped_and_counted_and_the_end_token_may_not_appear_inside(tmp_path):
    (tmp_path / "t.jinja").write_text(LLAMA3)
    long = {"prompt": "x" * 100, "completion": "y"}
    out = _prepare(tmp_path, [long, {"prompt": "a", "completion": "b"}], "--chat-template", str(tmp_path / "t.jinja"),
                   "--seq-len", "64")  # fmt: skip
    assert out.returncode == 0 and "skipped 1 example(s) longer than --seq-len 64 (the first: " in out.stdout
    assert json.loads((tmp_path / "sft.bin.json").read_text())["skipped_too_long"] == 1
    d = _hf_dir(tmp_path, LLAMA3)
    out = _prepare(tmp_path, [{"messages": CHAT}], "--tokenizer", str(d), "--seq-len", "512")  # ends: <|eot_id|>
    assert out.returncode == 2 and "in.jsonl:1 holds the end-of-document token 256 inside the example" in out.stderr


def test_a_model_eod_id_other_than_the_end_of_document_token_of_the_data_is_refused(tmp_path):
    """model.eod_id=10 on instruction data ended by byte 0 would pack no example apart from the next: refused in one
    line before anything is written; the data's own token given explicitly is kept."""
    import train
    from tests.training_utils import TINY, merge_overrides
    from tpframe.errors import ConfigError

    records = [{"prompt": f"what is {i} + {i}? ", "completion": f"{2 * i}"} for i in range(40)]
    assert _prepare(tmp_path, records, "--seq-len", "32").returncode == 0
    base = merge_overrides(["--config", os.path.join(REPO, "configs", "tiny_cpu.yaml")], TINY, ["parallel.tp=1",
                           "data.source=tokens", f"data.path={tmp_path}/sft.bin", "model.attention_mask=document",
                           f"train.run_dir={tmp_path}/run"])  # fmt: skip
    with pytest.raises(ConfigError) as e:
        train.prepare(merge_overrides(base, ["model.eod_id=10"]), world_size=1, rank=0)
    message = f"model.eod_id=10, but data.path='{tmp_path}/sft.bin' ends each packed example with token 0"
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not (tmp_path / "run").exists()
    assert train.prepare(merge_overrides(base, ["model.eod_id=0"]), world_size=1, rank=0)[0].model.eod_id == 0


def _step_loss_and_reference(tmp: str, data: str):
    """train.py's first loss on the instruction data, and a plain per-token cross entropy of the same initial model
    on the same micro-batches with every true next token as label, averaged over the tokens the mask keeps or over
    all of them."""
    import torch
    import torch.nn.functional as F

    from tpframe.data import build_data
    from tpframe.models import BuildContext, build_model
    from tpframe.parallel import initialize_parallel

    common = ["parallel.tp=1", "data.source=tokens", "train.seq_len=64", "model.max_seq_len=64", "train.steps=1"]
    common += ["model.attention_mask=document", "data.valid_fraction=0.25", f"data.path={data}"]
    trainer = train_in_process([*common, f"train.run_dir={tmp}/r"], keep_trainer=True)
    cfg, loss = trainer.cfg, trainer.history[0]["loss"]
    model = build_model(cfg.model, BuildContext(initialize_parallel(tp=1).tp_comm, seed=cfg.train.seed))
    batches = build_data(cfg.data, 64, cfg.train.micro_batch_size, 0, 1)[0]
    sums = torch.zeros(4, dtype=torch.float64)  # masked sum, masked count, all sum, all count
    with torch.no_grad():
        for _ in range(cfg.train.global_batch_size // cfg.train.micro_batch_size):
            ids, labels = batches.next()
            full = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)  # the last label starts the next row: never a loss
            logits = model(ids)[..., : cfg.model.vocab_size].float()
            per_token = F.cross_entropy(logits.flatten(0, 1), full.flatten(), reduction="none").view_as(full)
            keep = labels != -100
            assert (labels[keep] == full[keep]).all()
            sums += torch.tensor(
                [per_token[keep].sum(), keep.sum(), per_token.sum(), keep.numel()], dtype=torch.float64
            )
    return loss, (sums[0] / sums[1]).item(), (sums[2] / sums[3]).item()


def test_prompt_tokens_carry_no_loss_the_loss_is_the_mean_over_answer_tokens(tmp_path):
    """train.py's loss is the mean cross entropy of the answer tokens alone over the global batch: changing every
    prompt token's target (here: the true next token instead of none) would change it."""
    (tmp_path / "t.jinja").write_text(LLAMA3)
    records = [{"prompt": f"what is {i} + {i}? ", "completion": f"{2 * i}"} for i in range(40)]
    assert _prepare(tmp_path, records, "--chat-template", str(tmp_path / "t.jinja"), "--seq-len", "64").returncode == 0
    loss, answers, everything = run_distributed(
        _step_loss_and_reference, 1, str(tmp_path), f"{tmp_path}/sft.bin", timeout=300
    )[0]
    assert abs(loss - answers) <= 1e-5 * answers, (loss, answers)
    assert abs(loss - everything) > 1e-3, (loss, everything)
