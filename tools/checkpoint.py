"""Inspect a tpframe checkpoint, or export its weights: one consolidated safetensors file, or a
Hugging Face model directory (GPT-2 or Llama) that transformers' from_pretrained loads.

    python tools/checkpoint.py inspect runs/x/checkpoints            # `latest`, or a step_* directory, or runs/x
    python tools/checkpoint.py inspect model.safetensors             # an export: its step, model and tensors
    python tools/checkpoint.py inspect hf_model/                     # an HF model: the model.* it needs, tensors
    python tools/checkpoint.py export runs/x/checkpoints --out model.safetensors
    python tools/checkpoint.py export runs/x/checkpoints --format hf --out hf_model/
    python tools/checkpoint.py export runs/lora/checkpoints --format hf --merge-lora --out merged/   # a LoRA run's
    python tools/checkpoint.py export runs/lora/checkpoints --format peft --out adapter/  # for peft, onto its base

An export replaces an earlier export at --out (written beside it and renamed into place when complete); anything
else there is kept, with one error line, unless --force.

Import: start any layout from either with `checkpoint.init_from=model.safetensors` (or `=hf_model`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tpframe.checkpoint import resolve, verify  # noqa: E402
from tpframe.errors import ArgumentParser, ConfigError  # noqa: E402
from tpframe.exits import DISK_FULL_OR_READ_ONLY  # noqa: E402
from tpframe.paths import check_creatable, refuse_existing, write_failure  # noqa: E402


def inspect(path: Path) -> str:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from tpframe.checkpoint.dcp_io import read_index

    meta = verify(path, "size")
    total = sum(f["size"] for f in meta["files"].values())
    lines = [
        f"checkpoint  {path}",
        f"step        {meta['step']}   tokens seen {meta['train']['tokens_seen']:,}",
        "layout      " + " ".join(f"{k}={v}" for k, v in meta["layout"].items()),
        f"versions    tpframe {meta['tpframe_version']}, torch {meta['torch_version']}",
        f"data        {meta['data']}",
        f"files       {len(meta['files'])} + meta.json, {total / 2**20:.1f} MiB",
        "tensors:",
    ]
    index = read_index(path, verify_hint=False)  # verify checked its size only: a flipped byte shows here
    for key in sorted(index):
        md = index[key]
        if isinstance(md, TensorStorageMetadata):
            dtype = str(md.properties.dtype).replace("torch.", "")
            lines.append(f"  {key:60s} {str(tuple(md.size)):>16s} {dtype:9s} {len(md.chunks)} chunk(s)")
    return "\n".join(lines)


def inspect_export(path: Path) -> str:
    """A consolidated export's header (step, versions, model) and tensors."""
    import json

    from safetensors import safe_open

    from tpframe.checkpoint.export import safetensors_metadata

    header = safetensors_metadata(path)
    if header is None:
        raise ConfigError(f"{str(path)!r} is not a safetensors file")
    lines = [f"export      {path}"]
    if header.get("format") == "tpframe":
        from tpframe.models.config import architecture
        from tpframe.training.config import from_dict

        model = architecture(from_dict({"model": json.loads(header.get("model_config", "{}"))}).model)
        lines += [
            f"step        {header.get('step')}   (tpframe {header.get('tpframe_version')})",
            "model       " + " ".join(f"{k}={v}" for k, v in model.items()),
        ]
    else:
        lines.append(f"header      {header or 'none'} (not written by tpframe)")
    lines.append("tensors:")
    with safe_open(str(path), framework="pt") as f:
        for name in sorted(f.keys()):
            part = f.get_slice(name)
            lines.append(f"  {name:60s} {str(tuple(part.get_shape())):>16s} {part.get_dtype()}")
    return "\n".join(lines)


def inspect_hf(path: Path) -> str:
    """An HF model directory: the tpframe model its config.json describes, as the `model.*` overrides that
    `checkpoint.init_from=<dir>` needs (the context, model.max_seq_len, may be shorter than the HF model's for a
    Llama; GPT-2's learned positions need n_positions), its tokenizer and its tensors; checked as generate.py checks
    it (config.json, tokenizer files, the tensors' names, shapes and dtypes), so a directory neither could use is one
    error line."""
    from tpframe.checkpoint.hf import model_fields, read_config, safetensors_file, weight_files
    from tpframe.data.tokenizer import HFTokenizer
    from tpframe.inference.loading import hf_source
    from tpframe.inference.text import hf_dir_tokenizer, resolve_tokenizer

    source = hf_source(path, repr(str(path)))
    config = read_config(path)
    fields = {
        k: v
        for k, v in model_fields(config, f"{str(path)!r}: its config.json").items()
        if v is not None and k != "name"
    }
    tokenizer = "none (pass --tokenizer FILE to generate.py)"
    if hf_dir_tokenizer(path) is not None or fields["vocab_size"] == 256:
        tok = resolve_tokenizer(source)
        if isinstance(tok, HFTokenizer):
            tokenizer = f"tokenizer.json, end-of-text {tok.info['eot_token']!r}"
        else:
            tokenizer = (
                "byte-level (tpframe's)" if (path / "tokenizer.json").is_file() else "none: byte-level (vocabulary 256)"
            )
            tokenizer += f", end-of-text byte {tok.eot_id}" if tok.eot_id else ""
    names = config.get("architectures")
    name = names[0] if isinstance(names, list) and names else "?"
    lines = [
        f"hf model    {path}   ({config.get('model_type')}, {name})",
        "model       "
        + " ".join(f"model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in fields.items()),
        f"tokenizer   {tokenizer}",
    ]
    if "max_seq_len" not in fields:  # rotary: any context up to the HF model's
        lines.insert(2, f"context     model.max_seq_len up to {source.model.max_seq_len} (max_position_embeddings)")
    lines.append("tensors:")
    files = weight_files(path)
    for name in sorted(files):
        with safetensors_file(files[name]) as f:
            part = f.get_slice(name)
            lines.append(f"  {name:60s} {str(tuple(part.get_shape())):>16s} {part.get_dtype()}")
    return "\n".join(lines)


def inspected(target: str) -> str:
    """`inspect`'s text for a step directory, a checkpoints root, a run directory (its checkpoints), an export or an
    HF model directory."""
    from tpframe.checkpoint.hf import is_hf_dir

    path = Path(target)
    if path.is_file() and path.suffix == ".safetensors":
        return inspect_export(path)
    if path.is_file() and is_hf_dir(path.parent):  # its config.json, say
        raise ConfigError(
            f"{target!r} is a file of the Hugging Face model directory {str(path.parent)!r}; pass the directory"
        )
    if is_hf_dir(path):
        return inspect_hf(path)
    if (
        path.is_dir()
        and not (path / "meta.json").exists()
        and not (path / "latest").exists()
        and (path / "checkpoints").is_dir()
    ):
        path = path / "checkpoints"  # a run directory
    return inspect(resolve(path))


def training_checkpoint(target: str) -> Path:
    """export's input, a training checkpoint's step directory; an export or an HF directory is named as what it is."""
    from tpframe.checkpoint.hf import is_hf_dir

    path = Path(target)
    if (path.is_file() and path.suffix == ".safetensors") or is_hf_dir(path):
        kind = "a .safetensors file" if path.is_file() else "a Hugging Face model directory"
        raise ConfigError(
            f"{target!r} is {kind}, not a training checkpoint: export reads a step directory or a checkpoints root "
            "(generate.py and checkpoint.init_from read it as it is)"
        )
    return resolve(path)


def check_out(out: str, fmt: str, force: bool = False) -> None:
    """The export's destination: named as generate.py and checkpoint.init_from tell a consolidated file from an HF
    directory (the .safetensors suffix), writable, and holding nothing but an earlier export (unless `force`);
    checked before the checkpoint is read."""
    path, is_file_name = Path(out), Path(out).suffix == ".safetensors"
    if fmt in ("hf", "peft") and path.exists() and not path.is_dir():
        raise ConfigError(f"--out {out!r} is a file; --format {fmt} writes a directory")
    if fmt == "safetensors" and (not path.name or path.is_dir()):
        raise ConfigError(f"--out {out!r} is a directory; name the file, e.g. --out {str(path / 'model.safetensors')}")
    if fmt == "safetensors" and not is_file_name:
        raise ConfigError(
            f"--out {out!r}: a consolidated export is a .safetensors file (generate.py reads it by that "
            "name); use e.g. --out model.safetensors, or --format hf for a directory"
        )
    if fmt in ("hf", "peft") and is_file_name:
        raise ConfigError(
            f"--out {out!r}: --format {fmt} writes a directory; use e.g. --out {Path(out).stem}, or "
            "--format safetensors for one .safetensors file"
        )
    if not force:
        from tpframe.checkpoint.adapters import PEFT_FILES
        from tpframe.checkpoint.export import foreign_export_file
        from tpframe.checkpoint.hf_export import foreign_export_dir

        why = foreign_export_dir(path, PEFT_FILES) if fmt == "peft" else None
        why = why or (foreign_export_dir(path) if fmt == "hf" else foreign_export_file(path) if fmt != "peft" else None)
        if why:
            refuse_existing(f"--out {out!r}", why)
    check_creatable(f"--out {out!r}", path, directory=fmt != "safetensors")


def export(path: Path, out: str, fmt: str, force: bool = False, merge_lora: bool = False) -> str:
    from tpframe.checkpoint.adapters import export_peft, model_tensors

    if fmt == "peft":
        if merge_lora:
            raise ConfigError("--merge-lora writes a whole model: use it with --format hf or safetensors, not peft")
        info = export_peft(path, out, force=force)
        return (
            f"wrote a PEFT LoRA adapter (step {info['step']}: rank {info['rank']}, alpha {info['alpha']:g}, "
            f"{info['modules']} modules, {info['params']:,} parameters) to {out}; its base: {info['base']}"
        )
    tensors = model_tensors(path, merge_lora=merge_lora)
    if fmt == "hf":
        from tpframe.checkpoint.hf_export import export_hf

        warn = lambda msg: print(f"tpframe: {msg}", file=sys.stderr)  # noqa: E731
        info = export_hf(path, out, warn=warn, force=force, tensors=tensors)
        tokenizer = {None: ", no tokenizer files", "byte-level": ", byte-level tokenizer files"}.get(
            info["tokenizer"], f", tokenizer from {info['tokenizer']}"
        )
        return (
            f"wrote a Hugging Face {info['architecture']} model (step {info['step']}: {info['tensors']} tensors, "
            f"{info['params']:,} parameters, {info['dtype']}{tokenizer}) to {out}"
        )
    from tpframe.checkpoint.export import export_consolidated

    tensors = export_consolidated(path, out, force=force, tensors=tensors)
    return f"wrote {len(tensors)} tensors, {sum(t.numel() for t in tensors.values()):,} parameters to {out}"


def main(argv=None) -> int:
    parser = ArgumentParser(
        prog="checkpoint.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_inspect = sub.add_parser("inspect", help="step, layout, tensors and shapes (of a checkpoint or an export)")
    p_inspect.add_argument(
        "checkpoint",
        help="a step_* directory, a checkpoints root, a run directory, an "
        "exported .safetensors file or a Hugging Face model directory",
    )
    p_export = sub.add_parser("export", help="consolidated safetensors (default) or a Hugging Face model directory")
    p_export.add_argument("checkpoint")
    p_export.add_argument("--out", required=True, help="the .safetensors file, or the directory with --format hf")
    p_export.add_argument(
        "--format",
        choices=("safetensors", "hf", "peft"),
        default="safetensors",
        help="safetensors: tpframe's logical tensor names; hf: config.json + model.safetensors "
        "(+ tokenizer files) for transformers' AutoModelForCausalLM; peft: a LoRA run's adapters as a PEFT adapter "
        "directory (onto its base, checkpoint.init_from)",
    )
    p_export.add_argument(
        "--merge-lora",
        action="store_true",
        help="a LoRA run's checkpoint: its adapters merged into its base (checkpoint.init_from), W + (alpha/r) B A",
    )
    p_export.add_argument(
        "--force",
        action="store_true",
        help="write --out even if what is there is not an earlier tpframe export (an earlier "
        "export is replaced without it); with --format hf, into a directory of other files: "
        "the export's own files there are replaced and the others kept",
    )
    args = None
    try:
        args = parser.parse_args(argv)
        if args.command == "export":
            check_out(args.out, args.format, args.force)
        if args.command == "inspect":
            print(inspected(args.checkpoint))
        else:
            path = training_checkpoint(args.checkpoint)
            verify(path, "crc")
            print(export(path, args.out, args.format, args.force, args.merge_lora))
    except ConfigError as e:  # CheckpointError, HFMappingError, a usage mistake
        print(f"tpframe: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the disk fills up, the destination vanishes ...
        full = args is not None and args.command == "export" and e.errno in DISK_FULL_OR_READ_ONLY
        line = write_failure("--out", args.out, e) + " (an earlier export there is intact)" if full else str(e)
        print(f"tpframe: {line}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
