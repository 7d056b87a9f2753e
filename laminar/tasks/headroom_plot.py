"""The headroom runs' figure: accuracy with 95% intervals by difficulty, and per version.

    python -m laminar.tasks.headroom_plot OUT.png --before BEFORE.json \\
        --after LABEL=AFTER.json [--after ...] [--curve LABEL=RUN_DIR ...] [--metric greedy]

Left: the `laminar-node eval` documents of the warm start (`--before`) and of each run's last
version (`--after`, written with `--compare`), the metric's accuracy per level set (`d2`, `d3`,
...) with its interval. Middle: each run's after - before per level with the paired interval the
document holds (`after_minus_before`). Right: each run's in-run evaluator curve (`RUN_DIR/
evaluator/metrics.jsonl`, the `heldout` set) per version, with its interval. The numbers drawn
come from `level_points`, `change_points` and `curve_points`, which read the documents alone.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def _level(name: str) -> int | None:
    m = re.fullmatch(r"d(\d+)", name)
    return int(m.group(1)) if m else None


def level_points(doc: dict, metric: str = "greedy") -> list[tuple[int, float, float, float]]:
    """(level, value, lo, hi) for each level set `d<N>` of an eval document that has `metric`."""
    out = []
    for name, entry in doc.get("sets", {}).items():
        level, m = _level(name), entry.get("metrics", {}).get(metric)
        if level is not None and m is not None:
            out.append((level, float(m["value"]), float(m["lo"]), float(m["hi"])))
    return sorted(out)


def change_points(doc: dict, metric: str = "greedy") -> list[tuple[int, float, float, float]]:
    """(level, after - before, lo, hi) for each level set of a `--compare`d eval document."""
    out = []
    for name, entry in doc.get("after_minus_before", {}).items():
        level, m = _level(name), entry.get(metric)
        if level is not None and m is not None:
            out.append((level, float(m["diff"]), float(m["lo"]), float(m["hi"])))
    return sorted(out)


def curve_points(run_dir: Path, set_name: str = "heldout", metric: str = "greedy"
                 ) -> list[tuple[int, float, float, float]]:
    """(version, value, lo, hi) of the evaluator's in-run results for one set; the last record
    of a version wins (a restarted trainer may evaluate a version twice)."""
    path = Path(run_dir) / "evaluator" / "metrics.jsonl"
    key = f"eval/{set_name}/{metric}"
    by_version: dict[int, tuple[float, float, float]] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if key in rec and "version" in rec:
            by_version[int(rec["version"])] = (float(rec[key]), float(rec[f"{key}/lo"]),
                                               float(rec[f"{key}/hi"]))
    return [(v, *by_version[v]) for v in sorted(by_version)]


def _labelled(items: list[str], flag: str) -> list[tuple[str, Path]]:
    out = []
    for item in items:
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            raise SystemExit(f"{flag} wants LABEL=PATH, got {item!r}")
        out.append((label, Path(path)))
    return out


def _errorbar(ax, points, x_shift: float, label: str, color: str | None = None) -> None:
    xs = [p[0] + x_shift for p in points]
    ys = [p[1] for p in points]
    err = [[p[1] - p[2] for p in points], [p[3] - p[1] for p in points]]
    ax.errorbar(xs, ys, yerr=err, fmt="o-", capsize=3, markersize=4, label=label, color=color)


def draw(out: Path, before: Path, afters: list[tuple[str, Path]], curves: list[tuple[str, Path]],
         metric: str = "greedy") -> Path:
    """Write the figure to `out` and return it."""
    import matplotlib  # late: heavy, and only this command draws
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # late: after the backend is chosen

    panels = 3 if curves else 2
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5), squeeze=False)
    ax = axes[0][0]
    docs = [("before", json.loads(before.read_text()))] + [(lab, json.loads(p.read_text())) for lab, p in afters]
    width = 0.5 / max(1, len(docs))
    for i, (label, doc) in enumerate(docs):
        _errorbar(ax, level_points(doc, metric), (i - (len(docs) - 1) / 2) * width, label, f"C{i}")
    ax.set_xlabel("level (steps a problem)")
    ax.set_ylabel(f"{metric} accuracy (95% interval)")
    ax.set_title("before and after, by difficulty")
    ax.legend(fontsize=8)
    ax = axes[0][1]
    ax.axhline(0.0, color="grey", linewidth=0.8)
    for i, (label, doc) in enumerate(docs[1:]):
        _errorbar(ax, change_points(doc, metric), (i - (len(docs) - 2) / 2) * width, label, f"C{i + 1}")
    ax.set_xlabel("level (steps a problem)")
    ax.set_ylabel(f"{metric}: after - before (paired 95% interval)")
    ax.set_title("the change, by difficulty")
    ax.legend(fontsize=8)
    if curves:
        ax = axes[0][2]
        for label, run in curves:
            _errorbar(ax, curve_points(run, metric=metric), 0.0, label)
        ax.set_xlabel("version")
        ax.set_ylabel(f"heldout {metric} (first problems, 95% interval)")
        ax.set_title("in-run evaluator, per version")
        ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m laminar.tasks.headroom_plot", description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the PNG to write")
    ap.add_argument("--before", type=Path, required=True, help="the warm start's eval document")
    ap.add_argument("--after", action="append", default=[], metavar="LABEL=FILE",
                    help="a run's eval document of its last version (repeatable)")
    ap.add_argument("--curve", action="append", default=[], metavar="LABEL=RUN_DIR",
                    help="a run directory whose evaluator/metrics.jsonl is drawn per version (repeatable)")
    ap.add_argument("--metric", default="greedy", help="the metric to draw (default greedy)")
    a = ap.parse_args(argv)
    print(draw(a.out, a.before, _labelled(a.after, "--after"), _labelled(a.curve, "--curve"), a.metric))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
