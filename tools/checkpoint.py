"""Inspect a tpframe checkpoint, or export its weights to one consolidated safetensors file.

    python tools/checkpoint.py inspect runs/x/checkpoints            # `latest`, or a step_* directory
    python tools/checkpoint.py export runs/x/checkpoints --out model.safetensors

Import: start any layout from an exported file with `checkpoint.init_from=model.safetensors`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tpframe.checkpoint import CheckpointError, resolve, verify  # noqa: E402


def inspect(path: Path) -> str:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = verify(path, "size")
    lines = [
        f"checkpoint  {path}",
        f"step        {meta['step']}   tokens seen {meta['train']['tokens_seen']:,}",
        f"layout      " + " ".join(f"{k}={v}" for k, v in meta["layout"].items()),
        f"versions    tpframe {meta['tpframe_version']}, torch {meta['torch_version']}",
        f"data        {meta['data']}",
        f"files       {len(meta['files'])}, {sum(f['size'] for f in meta['files'].values()) / 2**20:.1f} MiB",
        "tensors:",
    ]
    index = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for key in sorted(index):
        md = index[key]
        if isinstance(md, TensorStorageMetadata):
            dtype = str(md.properties.dtype).replace("torch.", "")
            lines.append(f"  {key:60s} {str(tuple(md.size)):>16s} {dtype:9s} {len(md.chunks)} chunk(s)")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_inspect = sub.add_parser("inspect", help="step, layout, tensors and shapes")
    p_inspect.add_argument("checkpoint")
    p_export = sub.add_parser("export", help="consolidated safetensors with plain full tensor names")
    p_export.add_argument("checkpoint")
    p_export.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    try:
        path = resolve(args.checkpoint)
        if args.command == "inspect":
            print(inspect(path))
        else:
            from tpframe.checkpoint.export import export_consolidated

            verify(path, "crc")
            tensors = export_consolidated(path, args.out)
            print(f"wrote {len(tensors)} tensors, {sum(t.numel() for t in tensors.values()):,} parameters to {args.out}")
    except CheckpointError as e:
        print(f"tpframe: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
