#!/usr/bin/env python
"""Plot train (and eval) loss against step from a run's metrics.jsonl to a PNG.

    python tools/plot_loss.py runs/default                # writes runs/default/loss.png
    python tools/plot_loss.py runs/default --out loss.png
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from tpframe.errors import ArgumentParser  # noqa: E402
from tpframe.paths import check_creatable  # noqa: E402
from tpframe.training.logger import read_metrics  # noqa: E402


def plot_loss(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the loss curve(s) of `run_dir` to `out` (default <run_dir>/loss.png); ValueError if no loss."""
    run_dir = Path(run_dir)
    out = Path(out) if out else run_dir / "loss.png"
    if out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a directory; name the image, e.g. --out {out / 'loss.png'}")
    if not out.suffix:  # matplotlib would add .png itself, and the path printed would not be the file written
        out = out.with_name(out.name + ".png")
    check_creatable(f"--out {str(out)!r}", out)
    records = read_metrics(run_dir / "metrics.jsonl")
    curves = {kind: [(r["step"], r["loss"]) for r in records if r.get("kind") == kind and r.get("loss") is not None]
              for kind in ("train", "eval")}
    if not curves["train"] and not curves["eval"]:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} has no 'loss' values to plot")
    try:
        import matplotlib
    except ImportError:
        raise ValueError('plotting needs matplotlib: pip install matplotlib (or pip install -e ".[dev]")') from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kind, style in (("train", "-"), ("eval", "o-")):
        if curves[kind]:
            steps, losses = zip(*curves[kind])
            ax.plot(steps, losses, style, label=kind, markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(str(run_dir))
    ax.grid(alpha=0.3)
    ax.legend()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="plot_loss.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a run directory holding metrics.jsonl")
    parser.add_argument("--out", help="the PNG to write (default: RUN_DIR/loss.png)")
    try:
        args = parser.parse_args(argv)
        out = plot_loss(args.run_dir, args.out)
    except (ValueError, OSError) as e:
        print(f"plot_loss.py: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
