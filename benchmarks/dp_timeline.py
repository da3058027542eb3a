"""Where a DP step's extra time goes: the GPU timelines of benchmarks/data_parallel.py's profiled steps, side by side.

    PROFILE=/tmp/dp ROWS="DP=1;ddp, overlap on" python benchmarks/data_parallel.py
    python benchmarks/dp_timeline.py /tmp/dp [--base ddp-overlap1-nccl-dp1]

Reads every chrome trace in the folder (rank 0's, one step each) and splits its GPU span into: computation (the
union of every kernel, copy and memset that is not a collective), collectives no computation hid (exposed), and
idle (nothing on the GPU). Against the base trace (DP=1), a DP step's extra span is then
computation that got slower (kernels slowed by the collectives beside them) + exposed collectives (the tail after
backward, or traffic overlap did not hide) + idle (the host or a wait kept the GPU empty). Then, per trace, the
kernel names whose summed time grew the most against the base: which kernels the collectives slowed. Prints the
table and appends it to benchmarks/RESULTS.md (--no-append: print only). Where every rank's trace of a row is
there (`<name>.rank<r>.json`), a second table says how long each rank's NCCL kernels waited for the other ranks
(the collective's halves waiting for each other) against the transfers' own time.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tpframe.observe.profiler import collective_waits, gpu_events, gpu_timeline  # noqa: E402


def breakdown(trace: Path) -> dict:
    events = gpu_events(trace)
    if not events:
        return {}
    span, busy, comm, exposed = gpu_timeline(events)
    by_name = defaultdict(float)
    for e in events:
        by_name[e.get("name", "?")[:90]] += e["dur"] / 1e3
    return {
        "span": span,
        "compute": busy - exposed,
        "exposed": exposed,
        "idle": span - busy,
        "comm": comm,
        "by_name": by_name,
    }


def waits_table(traces: list[Path]) -> list[str]:
    """For rows profiled on every rank (`<name>.rank<r>.json` beside rank 0's): how long each rank's NCCL kernels
    waited for the other ranks to start the same collective (`collective_waits`)."""
    rows = []
    for trace in traces:
        others = sorted(trace.parent.glob(f"{trace.stem}.rank*.json"))
        waits = collective_waits([trace, *others]) if others else None
        if waits:
            rows.append(
                f"| {trace.stem} | {waits['collectives']} | "
                f"{' / '.join(f'{w:.1f}' for w in waits['waited_ms'])} | {waits['moving_ms']:.1f} | "
                f"{waits['median_skew_us']:.0f} | {' / '.join(f'{x:.2f}' for x in waits['start_skew_ms'])} | "
                f"{' / '.join(f'{x:.2f}' for x in waits['end_skew_ms'])} |"
            )
    if not rows:
        return []
    return [
        "",
        "Collectives across the ranks' traces: how long each rank's NCCL kernels waited for the others to "
        "start the same collective (a waiting kernel holds its SMs), the transfers' own time (each collective's "
        "shortest duration), and how far each rank's first and last GPU event trails the earliest one's:",
        "",
        "| trace | collectives | waited ms (rank 0 / 1 / ...) | transfers ms | median start skew us | "
        "start skew ms | end skew ms |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--base", default=None, help="the DP=1 trace's name (default: the one ending in -dp1)")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument(
        "--no-append", action="store_true", help="print only (default: also append to benchmarks/RESULTS.md)"
    )
    args = ap.parse_args()
    traces = sorted(t for t in Path(args.folder).glob("*.json") if ".rank" not in t.name)  # rank 0's; others pair
    if not traces:
        print(
            f"dp_timeline.py: no chrome traces (*.json) in {args.folder}; run benchmarks/data_parallel.py with "
            "PROFILE=<folder> first",
            file=sys.stderr,
        )
        raise SystemExit(2)
    rows = {t.stem: breakdown(t) for t in traces}
    rows = {k: v for k, v in rows.items() if v}
    base_name = args.base or next((k for k in rows if k.endswith("-dp1")), None)
    if base_name not in rows:
        print(
            f"dp_timeline.py: no base trace {base_name!r} among {', '.join(rows)}; name one with --base",
            file=sys.stderr,
        )
        raise SystemExit(2)
    base = rows[base_name]
    out = [
        "\n### Where DP steps' extra time goes: GPU timelines of one profiled step each (rank 0), ms",
        f"`python benchmarks/dp_timeline.py {args.folder}` (base: {base_name})",
        "",
        "| trace | span | computation | exposed collectives | idle | collectives (all) | extra span | "
        "of which slower computation | exposed | idle |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        out.append(
            f"| {name} | {r['span']:.1f} | {r['compute']:.1f} | {r['exposed']:.1f} | {r['idle']:.1f} | "
            f"{r['comm']:.1f} | {r['span'] - base['span']:+.1f} | {r['compute'] - base['compute']:+.1f} | "
            f"{r['exposed'] - base['exposed']:+.1f} | {r['idle'] - base['idle']:+.1f} |"
        )
    for name, r in rows.items():
        if name == base_name:
            continue
        grown = sorted(
            (
                (r["by_name"].get(k, 0.0) - base["by_name"].get(k, 0.0), k)
                for k in set(r["by_name"]) | set(base["by_name"])
            ),
            reverse=True,
        )[: args.top]
        out += ["", f"{name}: kernels whose summed time grew most against the base (ms)", ""]
        out += [
            f"    {delta:+8.2f}  {base['by_name'].get(k, 0.0):8.2f} -> {r['by_name'].get(k, 0.0):8.2f}  {k}"
            for delta, k in grown
        ]
    out += waits_table(traces)
    text = "\n".join(out)
    print(text)
    if not args.no_append:
        with open(Path(__file__).resolve().parent / "RESULTS.md", "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
