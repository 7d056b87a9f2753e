"""Before and after on the same problems: the paired differences of two `laminar-node eval` documents.

    laminar-node eval WARM_START --sets CONFIG --out before.json
    laminar-node eval FINAL --sets CONFIG --compare before.json --out after.json

Each document keeps every set's per-problem scores (`scores: {set: {metric: [score per problem]}}`)
and the problems' ids (`prompt_ids: {set: [id]}`). `paired` matches the two documents' problems by
id, set by set, and gives each metric's after − before with the paired bootstrap interval over
problems (laminar/intervals.py's paired_difference: the right interval for a change on one
held-out set, much narrower than two independent intervals; the change is significant when it
excludes 0). A set or metric only one document has, or a problem only one side answered, is
named in `unpaired`, never silently dropped.
"""
from __future__ import annotations

import json
from pathlib import Path

from laminar.intervals import paired_difference


def read_doc(path: str | Path) -> dict:
    """A `laminar-node eval` JSON document that carries per-problem scores (ValueError otherwise)."""
    doc = json.loads(Path(path).read_text())
    if "scores" not in doc or "prompt_ids" not in doc:
        raise ValueError(f"{path}: no per-problem scores (written by an older `laminar-node eval`?): "
                         "evaluate the model again")
    return doc


def paired(before: dict, after: dict) -> tuple[dict, list[str]]:
    """({set: {metric: {before, after, diff, lo, hi, problems}}}, unpaired): every metric of every
    set both documents scored, on the problems both answered."""
    out: dict = {}
    unpaired = [f"set {s}: only after" for s in after["scores"] if s not in before["scores"]]
    for name, b_scores in before["scores"].items():
        a_scores = after["scores"].get(name)
        if a_scores is None:
            unpaired.append(f"set {name}: only before")
            continue
        b_at = {p: i for i, p in enumerate(before["prompt_ids"][name])}
        a_at = {p: i for i, p in enumerate(after["prompt_ids"][name])}
        common = [p for p in before["prompt_ids"][name] if p in a_at]
        if len(common) < len(b_at) or len(common) < len(a_at):
            unpaired.append(f"set {name}: {len(b_at) - len(common)} problems only before, "
                            f"{len(a_at) - len(common)} only after")
        out[name] = {}
        for metric, bx in b_scores.items():
            if metric not in a_scores:
                unpaired.append(f"set {name}: metric {metric} only before")
                continue
            b = [bx[b_at[p]] for p in common]
            a = [a_scores[metric][a_at[p]] for p in common]
            d, lo, hi = paired_difference(b, a)
            out[name][metric] = {"before": sum(b) / len(b), "after": sum(a) / len(a), "diff": d, "lo": lo, "hi": hi,
                                 "problems": len(common)}
        unpaired += [f"set {name}: metric {m} only after" for m in a_scores if m not in b_scores]
    return out, unpaired


def table(diffs: dict) -> str:
    """One row per set and metric: before, after, after − before [95% paired interval], problems."""
    rows = [("set", "metric", "before", "after", "after - before [95%]", "problems")]
    for name, metrics in diffs.items():
        for m, x in metrics.items():
            sig = " *" if x["lo"] > 0 or x["hi"] < 0 else ""
            rows.append((name, m, f"{x['before']:.3f}", f"{x['after']:.3f}",
                         f"{x['diff']:+.3f} [{x['lo']:+.3f}, {x['hi']:+.3f}]{sig}", str(x["problems"])))
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)
