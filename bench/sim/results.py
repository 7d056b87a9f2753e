"""The sweep's arithmetic on run results: one object per (model, GPU count) with the comparisons
between its modes, laminar's ceiling, the plateau and scaling efficiency, and merging the
results of separate invocations (`--combine`).

Only valid runs make numbers: a run that failed, did not finish, or lagged behind compressed
time (its engines behind their simulated timeline: it measured less than the modeled hardware
would do) stays in `runs` with its reason in `invalid`, and is listed in `lagged_or_unfinished`,
but enters no throughput, ratio, ceiling fraction or plateau.
"""
from __future__ import annotations

import json
from pathlib import Path

from laminar.sim.scenario import _length_stats
from laminar.sim.setup import MODES, SimSetup

BASELINES = ["sync", "one_step", "stream"]


def invalid_reason(r: dict) -> str | None:
    """Why a run's numbers may not be used (None: they may): failed, lagged, or unfinished."""
    if "error" in r:
        return f"failed: {r['error']}"
    if r.get("lagged"):
        return "lagged"
    if not r.get("finished"):
        return "unfinished"
    return None


def assemble(size: str, gpus: int, runs: dict[str, dict], warmup: dict[str, int], measure: dict[str, int]) -> dict:
    """One object per (model, GPUs): the per-mode results and the comparisons between the valid
    ones (module docstring)."""
    invalid = {m: reason for m, r in runs.items() if (reason := invalid_reason(r)) is not None}
    ok = {m: r for m, r in runs.items() if m not in invalid}
    tp = {m: r["throughput_tokens_per_s"] for m, r in ok.items()}
    lam = tp.get("laminar")
    obj = {"model": size, "gpus": gpus, "warmup": warmup, "measure": measure,
           "speedup": {m: r["speedup"] for m, r in ok.items()},
           "throughput_tokens_per_s": tp,
           "speedup_over": {b: _ratio(lam, tp.get(b)) for b in BASELINES + ["laminar_norepack"] if b in tp},
           # laminar with its staleness bound ÷ without (laminar_unbounded, when run): what the bound costs
           "staleness_bound_cost": _ratio(lam, tp.get("laminar_unbounded")),
           "dropped_stale_groups": {m: r.get("dropped_stale_groups") for m, r in ok.items()},
           # how each run's speed was chosen (calibrate.py) and what its probe cost, every run that ran
           "pace": {m: r.get("pace") for m, r in runs.items()},
           "probe_wall_s": round(sum(((r.get("pace") or {}).get("probe") or {}).get("wall_s") or 0.0
                                     for r in runs.values()), 1),
           "kv_usage_mean": {"with_repack": _get(ok, "laminar", "kv_usage_mean"),
                             "without_repack": _get(ok, "laminar_norepack", "kv_usage_mean")},
           "generation_tokens_per_s": {"with_repack": _get(ok, "laminar", "generation_tokens_per_s"),
                                       "without_repack": _get(ok, "laminar_norepack", "generation_tokens_per_s")},
           # laminar_unbounded is the reference the bound is measured against, not a setting to report
           "max_staleness": max((r["max_staleness"] for m, r in ok.items()
                                 if r["max_staleness"] is not None and m != "laminar_unbounded"), default=None),
           "max_staleness_by_mode": {m: r["max_staleness"] for m, r in ok.items()},
           "staleness_histogram": {m: r["staleness_histogram_all"] for m, r in ok.items()},
           "fraction_of_ideal": {m: r["fraction_of_ideal"] for m, r in ok.items()},
           "rollout_idle_fraction": {m: r["rollout_idle_fraction"] for m, r in ok.items()},
           "kv_usage_mean_by_mode": {m: r["kv_usage_mean"] for m, r in ok.items()},
           "generation_tokens_per_s_by_mode": {m: r["generation_tokens_per_s"] for m, r in ok.items()},
           "repack_overhead_wall_s": _get(ok, "laminar", "repack", "wall_s_mean"),
           "laminar_ceiling_tokens_per_s": ceiling(ok["laminar"]) if "laminar" in ok else None,
           "lagged_or_unfinished": sorted(invalid, key=list(runs).index),
           "invalid": invalid,
           "draining_backlog": [m for m, r in ok.items() if r.get("draining")],
           # every attempt of every run that ran (a lagging run's slower reruns included)
           "wall_s": round(sum(a.get("wall_s", 0.0) for r in runs.values() for a in r.get("attempts", [r])), 1),
           "runs": runs}
    ceil = _get(obj, "laminar_ceiling_tokens_per_s", "tokens_per_s")
    obj["ceiling_speedup_over"] = {b: _ratio(ceil, tp.get(b)) for b in BASELINES if b in tp}
    obj["ceiling_fraction"] = _ratio(lam, ceil)  # laminar ÷ its ceiling on its placement
    g = obj["generation_tokens_per_s"]
    gain = _ratio(g["with_repack"], g["without_repack"])
    obj["generation_gain_from_repack"] = gain - 1 if gain else None
    return obj


def ceiling(r: dict) -> dict | None:
    """The most any scheduler could reach on this run's placement and cost model: the lower of
    (a) every rollout always at its roofline batch (the ideal generation rate, as prompt + response
    tokens) and (b) the trainer never waiting for data (a global batch's tokens ÷ its training
    time plus its publish stall, which it pays whatever the scheduling). From the run's own
    measurements (throughput × iteration ÷ (training + stall) = batch tokens ÷ (training +
    stall)), so it applies to files written before it (`combine` fills in their batch tokens per
    response token from the length fit; files without the stall get none)."""
    tp, per_token, ideal = r.get("throughput_tokens_per_s"), r.get("batch_tokens_per_response_token"), \
        r.get("ideal_generation_tokens_per_s")
    it, train, stall = r.get("iteration_s_mean"), r.get("train_s_mean"), r.get("stall_s_mean") or 0.0
    if not (tp and per_token and ideal and it and train):
        return None
    gen, trainer = ideal * per_token, tp * it / (train + stall)
    return {"tokens_per_s": min(gen, trainer), "generation_bound": gen, "training_bound": trainer,
            "bound_by": "generation" if gen < trainer else "training"}


def _get(runs, mode, *keys):
    v = runs.get(mode)
    for k in keys:
        v = None if v is None else v.get(k)
    return v


def _ratio(a, b):
    return a / b if a and b else None


PLATEAU_BOUND = 1.15


def plateau(objs: list[dict]) -> dict:
    """{model: {mode: throughput at the largest GPU count ÷ at the second-largest}} for the models
    with two scales or more in `objs`."""
    out = {}
    for size in sorted({o["model"] for o in objs}, key=lambda s: float(s.rstrip("B"))):
        pts = sorted((o for o in objs if o["model"] == size), key=lambda o: o["gpus"])
        if len(pts) < 2:
            continue
        a, b = pts[-2]["throughput_tokens_per_s"], pts[-1]["throughput_tokens_per_s"]
        out[size] = {m: _ratio(b.get(m), a.get(m)) for m in MODES if a.get(m) and b.get(m)}
    return out


def scaling_efficiency(objs: list[dict], mode: str = "laminar") -> dict:
    out = {}
    for size in sorted({o["model"] for o in objs}):
        pts = sorted((o["gpus"], o["throughput_tokens_per_s"].get(mode)) for o in objs if o["model"] == size)
        pts = [(g, t) for g, t in pts if t]
        if len(pts) >= 2 and pts[-1][0] > pts[0][0]:
            out[size] = (pts[-1][1] / pts[0][1]) / (pts[-1][0] / pts[0][0])
    return out


def combine(paths: list[str], setup: SimSetup, workload: dict) -> tuple[list[dict], list[dict]]:
    """The (model, GPUs) objects of earlier `--out` files, runs of one setup merged (a later file's
    run of a mode replaces an earlier one), and what the combined file records of each part: its
    file name, the command that wrote it and when (None for files written before the command was
    recorded) — not its path, which is usually a scratch folder a reader of the result does not
    have. A later file's run replaces an earlier one unless it is invalid and the earlier valid.
    Simulated throughput does not depend on the machine's load unless a run lagged, which
    every run records, so runs of separate invocations compare. Runs from before
    `batch_tokens_per_response_token` was recorded get (prompt + E[L]) ÷ E[L] of the model's
    length fit."""
    merged: dict[tuple, dict] = {}
    parts = []
    for path in paths:
        src = json.loads(Path(path).read_text())
        parts.append({"file": Path(path).name, "command": src.get("command"), "written_at": src.get("written_at")})
        for o in src["runs_by_scale"]:
            mean = _length_stats(setup, workload, o["model"])["mean"]
            for r in o["runs"].values():
                r.setdefault("batch_tokens_per_response_token", (setup.run_shape.prompt_tokens + mean) / mean)
            m = merged.setdefault((o["model"], o["gpus"]), {"runs": {}, "warmup": {}, "measure": {}})
            # files before per-mode windows kept one count for all modes
            per_mode = o["measure"] if isinstance(o["measure"], dict) else {mode: o["measure"] for mode in o["runs"]}
            for mode, r in o["runs"].items():
                earlier = m["runs"].get(mode)
                if earlier is None or invalid_reason(r) is None or invalid_reason(earlier) is not None:
                    m["runs"][mode] = r
                    m["warmup"][mode], m["measure"][mode] = o["warmup"][mode], per_mode[mode]
    order = lambda k: (float(k[0].rstrip("B")), k[1])  # noqa: E731
    objs = [assemble(size, gpus, {mode: m["runs"][mode] for mode in MODES if mode in m["runs"]},
                     m["warmup"], m["measure"])
            for (size, gpus), m in sorted(merged.items(), key=lambda kv: order(kv[0]))]
    return objs, parts

