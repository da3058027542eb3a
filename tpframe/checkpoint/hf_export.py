"""A tpframe checkpoint as a Hugging Face model directory, and the tokenizer files that ship with it.

    export_hf(step_dir, out_dir)        # config.json + model.safetensors + tokenizer files (when known)
    AutoModelForCausalLM.from_pretrained(out_dir)

The mapping (which family, config.json, the tensor names) is tpframe/checkpoint/hf.py's; here the directory is
written beside `out_dir` and moved into place when complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tpframe.checkpoint.export import read_model_tensors, write_safetensors
from tpframe.checkpoint.hf import CONFIG, DTYPES, WEIGHTS, hf_architecture, hf_config, to_hf
from tpframe.data.corpus import EOD_BYTE
from tpframe.data.tokenizer import BYTE_SOURCES, ByteTokenizer, first_path
from tpframe.models.config import read_model_config
from tpframe.paths import link_target, recorded_path, refuse_existing, temporary_name

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# export_hf's own file, {"exported_by": "tpframe", ...}: what tells an earlier export (which a new one may replace) from
# any other model directory. Not in the weights' header: safetensors writes its keys in no fixed order, and the export
# is byte-for-byte the same every time
MARKER = "tpframe_export.json"
EXPORT_FILES = (CONFIG, WEIGHTS, *TOKENIZER_FILES, MARKER)  # all that export_hf writes
BYTES = {"kind": "bytes", "eot_id": EOD_BYTE}


def tokenizer_record(config: dict[str, Any], warn: Callable[[str], None], cwd: str | None = None) -> dict | None:
    """The tokenizer a run's data was made with: {"kind": "bytes", ...} for byte-level data (the embedded corpora, a
    byte-level token file), else its token file's HF tokenizer (the sidecar's record), if unchanged on disk;
    `cwd`: the folder the run was launched from (relative paths are relative to it)."""
    data = config.get("data", {})
    if data.get("source") in BYTE_SOURCES:
        return BYTES
    if data.get("source") != "tokens" or not first_path(data.get("path")):
        return None
    sidecar = Path(recorded_path(first_path(data["path"]), cwd) + ".json")
    if not sidecar.is_file():
        warn(f"no tokenizer files: the token file's sidecar {sidecar} is gone")
        return None
    meta = json.loads(sidecar.read_text())
    info = meta.get("tokenizer", {})
    if info.get("kind") == "bytes":
        return BYTES
    if info.get("kind") != "huggingface":
        return None
    file = Path(recorded_path(info["file"], cwd))
    if not file.is_file() or hashlib.sha256(file.read_bytes()).hexdigest() != info.get("sha256"):
        warn(f"no tokenizer files: {file}, recorded in {sidecar}, is missing or has changed since the data was made")
        return None
    return {"kind": "huggingface", "file": file, "eot_token": info.get("eot_token"), "eot_id": meta.get("eot_id")}


def write_tokenizer(out_dir: Path, record: dict, model_max_length: int) -> None:
    """tokenizer.json + tokenizer_config.json: what AutoTokenizer.from_pretrained(out_dir) reads."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length}
    if record["kind"] == "bytes":
        (out_dir / "tokenizer.json").write_text(
            json.dumps(ByteTokenizer.hf_json(), ensure_ascii=False) + "\n", encoding="utf-8"
        )
    else:
        shutil.copyfile(record["file"], out_dir / "tokenizer.json")
        config.update(eos_token=record["eot_token"], bos_token=record["eot_token"])
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def foreign_export_dir(out_dir: str | Path, files: tuple[str, ...] = EXPORT_FILES) -> str | None:
    """Why an HF export to `out_dir` would replace something tpframe did not write, or None when `out_dir` is missing,
    empty, or an earlier export: only `files` (what the export writes), MARKER among them (exports written before
    the marker was added cannot be told from any other HF model: they need --force once)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        return "is a file; --format hf writes a directory"
    if not out_dir.exists():
        return None
    names = sorted(p.name for p in out_dir.iterdir())
    other = [n for n in names if n not in files]
    if other:
        return (
            f"is a directory holding files a tpframe export does not write ({', '.join(map(repr, other[:3]))}"
            f"{', ...' if len(other) > 3 else ''})"
        )
    if names and not _is_marker(out_dir / MARKER):
        return f"is a directory of model files without tpframe's {MARKER}: not a tpframe export"
    return None


def _is_marker(path: Path) -> bool:
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("exported_by") == "tpframe"
    except (OSError, ValueError, AttributeError):  # missing, not JSON, not an object
        return False


def publish(new: Path, out: Path, files: tuple[str, ...] = EXPORT_FILES) -> None:
    """Put the finished export `new` (a folder beside `out`) at `out`. A missing or empty `out`: one rename. An earlier
    export: moved aside, the new one renamed in, the old one deleted, so `out` is never half-written (a crash between
    the renames leaves the old export beside it under a hidden name). Another directory (--force): the export's
    files replaced one by one (a name this export does not write, such as an old tokenizer, removed), the rest kept."""
    if not out.exists() or not any(out.iterdir()):
        os.replace(new, out)  # rename(2) replaces an empty directory
    elif foreign_export_dir(out, files) is None:
        old = temporary_name(out, "old")
        os.rename(out, old)
        try:
            os.rename(new, out)
        except OSError:
            os.rename(old, out)
            raise
        shutil.rmtree(old)
    else:
        for name in files:
            if (new / name).exists():
                os.replace(new / name, out / name)
            else:
                (out / name).unlink(missing_ok=True)
        new.rmdir()


def export_hf(
    checkpoint: str | Path,
    out_dir: str | Path,
    warn: Callable[[str], None] = print,
    force: bool = False,
    *,
    tensors: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A tpframe checkpoint (any layout) -> an HF directory `AutoModelForCausalLM.from_pretrained` loads.

    Refuses (HFMappingError) before writing anything when the model has no HF equivalent, and (ConfigError) a
    `out_dir` holding anything but an earlier export unless `force`. Written into a new folder beside `out_dir`
    and moved into place when complete (`publish`).
    `tensors`: the model's logical tensors, when not the checkpoint's own (a LoRA run's, merged with their base).
    Returns a summary: architecture, tensor and parameter counts, the tokenizer written (or None).
    """
    checkpoint, out_dir = Path(checkpoint), link_target(Path(out_dir))
    if not force and (why := foreign_export_dir(out_dir)):
        refuse_existing(f"--out {str(out_dir)!r}", why)
    meta = json.loads((checkpoint / "meta.json").read_text())
    m = read_model_config(meta["config"]["model"])
    arch = hf_architecture(m)  # refuse before reading or writing anything
    tokenizer = tokenizer_record(meta["config"], warn, meta.get("cwd"))
    tensors = to_hf(read_model_tensors(checkpoint) if tensors is None else tensors, m)
    dtype = next(iter(tensors.values())).dtype
    config = hf_config(m, dtype=dtype, eos_token_id=tokenizer["eot_id"] if tokenizer else None)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    new = temporary_name(out_dir)
    new.mkdir()
    try:
        (new / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        write_safetensors(tensors, new / WEIGHTS, {"format": "pt"})
        if tokenizer:
            write_tokenizer(new, tokenizer, m.max_seq_len)
        mark = {"exported_by": "tpframe", "tpframe_version": meta.get("tpframe_version"), "step": meta["step"]}
        (new / MARKER).write_text(json.dumps(mark, indent=2) + "\n")
        publish(new, out_dir)
    finally:
        if new.exists():
            shutil.rmtree(new)
    return {
        "architecture": arch,
        "tensors": len(tensors),
        "params": sum(t.numel() for t in tensors.values()),
        "dtype": DTYPES[dtype],
        "step": meta["step"],
        "tokenizer": tokenizer and ("byte-level" if tokenizer["kind"] == "bytes" else str(tokenizer["file"])),
    }
