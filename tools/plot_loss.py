#!/usr/bin/env python
"""Plot train (and eval) loss against step from a run's metrics.jsonl to a PNG; several runs on one plot.

python tools/plot_loss.py runs/default                # writes runs/default/loss.png
python tools/plot_loss.py runs/default --out loss.png
python tools/plot_loss.py runs/a runs/b --out ab.png  # two runs overlaid (each its colour; eval as dots)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from tpframe.errors import ArgumentParser  # noqa: E402
from tpframe.observe.logger import read_metrics  # noqa: E402
from tpframe.paths import check_creatable, refuse_existing, replacing, write_failure  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def is_plot(path: Path) -> bool:
    """Whether `path` is a PNG that matplotlib drew (its Software text chunk follows the header): an earlier plot
    this tool may replace, not a picture of the user's."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return head.startswith(PNG_SIGNATURE) and b"Software\x00Matplotlib" in head


def _curves(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """The run's (step, loss) of each kind, "train" and "eval"; ValueError when it has none."""
    if run_dir.is_file():  # its metrics.jsonl, say: the default --out would be a path inside that file
        raise ValueError(
            f"{str(run_dir)!r} is a file; pass the run directory that holds metrics.jsonl, e.g. {str(run_dir.parent)!r}"
        )
    records = read_metrics(run_dir / "metrics.jsonl")
    curves = {
        kind: [(r["step"], r["loss"]) for r in records if r.get("kind") == kind and r.get("loss") is not None]
        for kind in ("train", "eval")
    }
    if not curves["train"] and not curves["eval"]:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} has no 'loss' values to plot")
    return curves


def plot_loss(run_dirs: str | Path | list, out: str | Path | None = None, force: bool = False) -> Path:
    """Write the loss curve(s) of one run directory, or of several overlaid, to `out` (default, for one run:
    <run_dir>/loss.png); ValueError if a run has no loss, if several runs are given without `out`, or if `out`
    holds anything but an earlier plot (unless `force`)."""
    runs = [Path(r) for r in (run_dirs if isinstance(run_dirs, list | tuple) else [run_dirs])]
    if len(runs) > 1 and not out:
        raise ValueError(f"{len(runs)} runs go on one plot: name it with --out, e.g. --out loss.png")
    if len(runs) == 1 and runs[0].is_file():
        _curves(runs[0])  # names the run directory to pass instead
    out = Path(out) if out else runs[0] / "loss.png"
    if out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a directory; name the image, e.g. --out {out / 'loss.png'}")
    if not out.suffix:  # matplotlib would add .png itself, and the path printed would not be the file written
        out = out.with_name(out.name + ".png")
    if out.exists() and not force and not is_plot(out):
        refuse_existing(f"--out {str(out)!r}", "exists and is not a PNG plot_loss.py drew")
    check_creatable(f"--out {str(out)!r}", out)
    every = {run: _curves(run) for run in runs}
    try:
        import matplotlib
    except ImportError:
        raise ValueError('plotting needs matplotlib: pip install matplotlib (or pip install -e ".[dev]")') from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (run, curves) in enumerate(every.items()):
        name = "" if len(runs) == 1 else f"{run} "
        for kind, style in (("train", "-"), ("eval", "o-")):
            if curves[kind]:
                steps, losses = zip(*curves[kind])
                ax.plot(
                    steps,
                    losses,
                    style,
                    label=f"{name}{kind}",
                    markersize=4,
                    color=None if len(runs) == 1 else f"C{i % 10}",
                    alpha=1.0 if kind == "train" else 0.8,
                )
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(str(runs[0]) if len(runs) == 1 else f"{len(runs)} runs")
    ax.grid(alpha=0.3)
    ax.legend()
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with replacing(out) as tmp:  # through a symbolic --out, to what it points at
            fig.savefig(tmp, dpi=120, bbox_inches="tight", format=out.suffix[1:].lower())
    except OSError as e:  # a full disk: the earlier plot stays
        raise ValueError(f"{write_failure('--out', out, e)} (an earlier plot there is intact)") from None
    finally:
        plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="plot_loss.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", nargs="+", help="a run directory holding metrics.jsonl (several: overlaid)")
    parser.add_argument(
        "--out", help="the PNG to write (default with one run: RUN_DIR/loss.png); an earlier plot there is replaced"
    )
    parser.add_argument("--force", action="store_true", help="overwrite --out even if it is not an earlier plot")
    try:
        args = parser.parse_args(argv)
        out = plot_loss(args.run_dir, args.out, force=args.force)
    except (ValueError, OSError) as e:
        print(f"plot_loss.py: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
