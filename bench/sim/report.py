"""The sweep's output: a table per (model, GPU count), the summary tables, the plot, the JSON, and
the expanded cluster files (`--write-configs`).

An invalid run (failed, unfinished, or lagged: bench/sim/results.py) keeps its row, marked
INVALID with the reason, its numbers in parentheses and no ratio; it enters no summary.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from bench.sim.processes import usable_cores
from bench.sim.results import BASELINES, PLATEAU_BOUND, _ratio, plateau, scaling_efficiency
from bench.sim.runs import DRAIN_FLAG, engine_settings
from laminar.report import print_table, write_json
from laminar.sim.scenario import build_config, staleness_bound
from laminar.sim.setup import MODES, SimSetup

ROOT = Path(__file__).resolve().parents[2]
# The paper's headline figures (arXiv 2510.12633), for reference only.
PAPER = {"laminar_over_verl_max": 5.48, "laminar_over_one_step_stream_avg_at_largest": 3.4,
         "scaling_efficiency_avg": 0.537}


def machine() -> dict:
    """The machine a sweep ran on, as its JSON records it: cores it may use, load averages."""
    return {"cores": usable_cores(), "loadavg": [round(x, 2) for x in os.getloadavg()]}


def _per_mode(counts: dict[str, int]) -> str:
    """{"laminar": 8, "sync": 5, ...} -> "8 (laminar), 5 (sync)": the distinct counts and their modes."""
    by: dict[int, list[str]] = {}
    for mode, n in counts.items():
        by.setdefault(n, []).append(mode)
    return ", ".join(f"{n} ({'/'.join(ms)})" for n, ms in sorted(by.items(), reverse=True))


def _f(v, digits: int = 0) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def _speed(r: dict) -> str:
    """A run's speedup and how it was chosen: `4.2 cache`, `3.1 probe 41s`, `2.1 rerun`."""
    pace = r.get("pace") or {}
    probe = pace.get("probe") or {}
    how = pace.get("source", "")
    if probe.get("wall_s"):
        how += f" {probe['wall_s']:.0f}s"
    return f"{r['speedup']:g} {how}".strip()


def print_scale(obj: dict, workload: dict) -> None:
    """One (model, GPUs) object's table and the lines under it (ratios, ceiling, repack, staleness)."""
    size, gpus = obj["model"], obj["gpus"]
    lam = obj["throughput_tokens_per_s"].get("laminar")
    rows = []
    invalid = obj.get("invalid", {})
    for m, r in obj["runs"].items():
        if "error" in r:
            rows.append([m, "-", "-", "FAILED: " + r["error"]] + [""] * 13)
            continue
        pl = r["placement"]
        tput = _f(r["throughput_tokens_per_s"])
        if m in invalid:  # kept for the record, never as a number to quote
            tput = f"INVALID ({invalid[m]}): ({tput})"
        rows.append([m, f"{pl['train_gpus']}/{pl['rollout_gpus']}", pl["rollouts"], tput,
                     "-" if m in invalid else _f(_ratio(lam, r["throughput_tokens_per_s"]), 2),
                     _f(r["iteration_s_mean"], 1),
                     _f(r["generation_tokens_per_s"]), _f(r["fraction_of_ideal"], 2), _f(r["rollout_idle_fraction"], 2),
                     _f(r["kv_usage_mean"], 2), r["max_staleness"], json.dumps(r["staleness_histogram"]),
                     r["repack"]["plans"], r["preemptions"], _speed(r),
                     f"{_f(r.get('engine_lag_at_updates_s'), 1)}/{r['engine_max_lag_s']:.0f}"
                     + ("!" if r["lagged"] else ""),
                     f"{r['wall_s']:.0f}"
                     + ("" if r["finished"] else " (unfinished)")
                     + (f" ({len(r['attempts'])} attempts)" if len(r.get("attempts", [])) > 1 else "")])
    print_table(f"Qwen2.5-{size} on {gpus} simulated H800s: throughput = prompt+response tokens of a global batch / "
                f"time between updates (simulated), over {_per_mode(obj['measure'])} updates after a warm-up of "
                f"{_per_mode(obj['warmup'])}",
                ["mode", "train/roll GPUs", "replicas", "tokens/s", "laminar x", "iter s", "gen tok/s", "of ideal",
                 "idle", "kv mean", "max stale", "staleness (measured)", "repacks", "preempt", "speedup",
                 "lag mean/max", "wall s"], rows)
    so = obj["speedup_over"]
    print("  laminar over: " + ", ".join(f"{b} {_f(v, 2)}x" for b, v in so.items())
          + f"   (paper, reference only: up to {PAPER['laminar_over_verl_max']}x over verl; "
          f"~{PAPER['laminar_over_one_step_stream_avg_at_largest']}x over one_step/stream at the largest scale)")
    if c := obj.get("laminar_ceiling_tokens_per_s"):
        cs = obj["ceiling_speedup_over"]
        print(f"  laminar's ceiling on its placement: {_f(c['tokens_per_s'])} tok/s ({c['bound_by']}-bound; generation "
              f"at every rollout's roofline {_f(c['generation_bound'])}, "
              f"trainer never waiting {_f(c['training_bound'])})"
              + (" = " + ", ".join(f"{_f(v, 2)}x {b}" for b, v in cs.items() if v) if any(cs.values()) else "")
              + "; measured laminar is " + _f(_ratio(lam, c["tokens_per_s"]), 2) + " of it (ceiling_fraction)")
    rp = workload.get("repack_32B_16_rollouts", {})
    kv, g = obj["kv_usage_mean"], obj["generation_gain_from_repack"]
    print(f"  repack: mean kv {_f(kv['with_repack'], 3)} with / {_f(kv['without_repack'], 3)} without; generation "
          f"tokens/s {'-' if g is None else f'{g:+.1%}'}; wall time per plan {_f(obj['repack_overhead_wall_s'], 4)} s"
          f"   (paper, 32B x16 rollouts, reference: {rp.get('avg_kv_util_with')} / {rp.get('avg_kv_util_without')}, "
          f"+{rp.get('generation_throughput_gain', 0):.0%}, overhead {rp.get('overhead_s')} s)")
    bound = next((r.get("staleness_bound") for r in obj["runs"].values() if (r.get("staleness_bound") or {})
                  .get("max_staleness") is not None), None)
    dropped = {m: n for m, n in obj.get("dropped_stale_groups", {}).items() if n}
    print(f"  max staleness {obj['max_staleness']} "
          f"(paper observed <= {workload.get('inherent_staleness_observed_max')}"
          + (f"; laminar's bound: ahead {bound['ahead']}, max {bound['max_staleness']}" if bound else "") + ")"
          + (f"; groups dropped as too stale: {dropped}" if dropped else "")
          + (f"; the bound costs {1 - obj['staleness_bound_cost']:+.1%} of throughput (laminar ÷ laminar_unbounded "
             f"{obj['staleness_bound_cost']:.3f})" if obj.get("staleness_bound_cost") else "")
          + (f"; INVALID (lagged or unfinished, in no number above): {obj['lagged_or_unfinished']}"
             if obj["lagged_or_unfinished"] else ""))
    if obj.get("draining_backlog"):
        print(f"  not a steady state: {obj['draining_backlog']} consumed more than {DRAIN_FLAG}x the tokens generated "
              "in the measured window (a backlog drained); warm up for more versions (--warmup)")


def plot(objs: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    sizes = sorted({o["model"] for o in objs}, key=lambda s: float(s.rstrip("B")))
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4), squeeze=False)
    for ax, size in zip(axes[0], sizes, strict=False):
        pts = sorted((o for o in objs if o["model"] == size), key=lambda o: o["gpus"])
        for mode in MODES:
            xs = [o["gpus"] for o in pts if o["throughput_tokens_per_s"].get(mode)]
            ys = [o["throughput_tokens_per_s"][mode] for o in pts if o["throughput_tokens_per_s"].get(mode)]
            if xs:
                ax.plot(xs, ys, marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"Qwen2.5-{size} (simulated H800)")
        ax.set_xlabel("GPUs")
        ax.set_ylabel("throughput (tokens/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_configs(setup: SimSetup, workload: dict, runs: list[tuple[str, int]], modes: list[str], out: Path,
                  speedups: dict, relays: bool) -> None:
    """The expanded cluster files of `runs` × `modes`, one YAML each, runnable alone."""
    out.mkdir(parents=True, exist_ok=True)
    for size, gpus in runs:
        for mode in modes:
            name = f"{size}-{gpus}-{mode}"
            ahead, max_staleness = staleness_bound(setup, mode)
            cfg = build_config(setup, size, gpus, mode, workdir=f"runs/sim/{name}",
                               speedup=speedups[(size, gpus, mode)], ahead=ahead, max_staleness=max_staleness,
                               iterations=setup.iterations.warmup + setup.iterations.measure,
                               workload=workload, weights_root=f"/dev/shm/laminar-sim-{name}", relays=relays)
            head = (f"# Generated by `python bench/scale.py --write-configs {out} --model {size} --gpus {gpus}` from\n"
                    f"# configs/sim/paper.yaml (the constants and their derivation are there and in docs/sim.md).\n"
                    f"# Qwen2.5-{size} on {gpus} simulated H800s, mode {mode}; every role in one process:\n"
                    f"#   python -m bench.sim.cluster {out}/{name}.yaml   (from the repository's root)\n")
            (out / f"{name}.yaml").write_text(head + yaml.safe_dump(cfg, sort_keys=False, width=110))
            print(f"wrote {out / (name + '.yaml')}")



def _staleness_args(a, setup: SimSetup | None) -> dict:
    """The laminar modes' staleness bound as the command line set it (paper.yaml's where it did not)."""
    own = {"ahead": getattr(a, "ahead", None), "max_staleness": getattr(a, "max_staleness", None)}
    if setup is not None:
        own = {k: (getattr(setup.staleness, "max" if k == "max_staleness" else k) if v == "setup" else v)
               for k, v in own.items()}
    return own


def _shown(path: str | None) -> str | None:
    """A path as a committed result should show it: relative to the repository when inside it."""
    if not path:
        return path
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(path)


def report(objs: list[dict], modes: list[str], workload: dict, a, wall_s: float, setup: SimSetup | None,
           combined_from: list[dict] | None = None, load: dict | None = None) -> int:
    """Print the tables and write the JSON; `setup` None (a --combine, whose parts are
    `combined_from`): each run's placement records its own engine settings."""
    for obj in objs:
        print_scale(obj, workload)
    eff = scaling_efficiency(objs)
    if len(objs) > 1:
        rows = [[o["model"], o["gpus"], *[_f(o["throughput_tokens_per_s"].get(m)) for m in modes],
                 *[_f(o["speedup_over"].get(b), 2) for b in BASELINES if b in modes]] for o in objs]
        print_table("throughput (tokens/s, simulated) by model, GPUs and mode; laminar's speedup over each baseline",
                    ["model", "GPUs", *modes, *[f"x {b}" for b in BASELINES if b in modes]], rows)
        if eff:
            print("\nscaling efficiency of laminar ((throughput largest / smallest) / (GPUs largest / smallest)): "
                  + ", ".join(f"{s} {v:.1%}" for s, v in eff.items())
                  + f"; mean {sum(eff.values()) / len(eff):.1%}   "
                  f"(paper, reference: {PAPER['scaling_efficiency_avg']:.1%})")
    plat = plateau(objs)
    if plat:
        print("\nplateau (each mode's throughput at a model's largest scale ÷ its second-largest; the paper's "
              f"baselines stop scaling: <= {PLATEAU_BOUND}): " + "; ".join(
                  f"{s} " + ", ".join(f"{m} {_f(v, 2)}" for m, v in by.items()) for s, by in plat.items()))
    primary = max(objs, key=lambda o: (o["gpus"], float(o["model"].rstrip("B"))))
    data = {**primary, "runs_by_scale": objs, "scaling_efficiency": eff, "plateau": plat,
            "plateau_bound": PLATEAU_BOUND,
            "scaling_efficiency_mean": (sum(eff.values()) / len(eff)) if eff else None,
            "paper_reference": {**PAPER, "repack_32B_16_rollouts": workload.get("repack_32B_16_rollouts"),
                                "inherent_staleness_observed_max": workload.get("inherent_staleness_observed_max")},
            "setups": _shown(a.setups), "relays": "real" if a.relays else "modeled", "jobs": a.jobs,
            "combined_from": combined_from, "staleness_bound": _staleness_args(a, setup),
            "max_concurrency": a.concurrency,
            **(engine_settings(setup) if setup else {"engine_seqs": "per run", "refill": "per run"}),
            "lag_retries": getattr(a, "lag_retries", None), "machine": load, "wall_s": wall_s}
    if a.out:
        png = plot(objs, Path(a.out).with_suffix(".png")) if len(objs) > 1 else None
        data["plot"] = png.name if png else None  # beside the JSON
    write_json(a.out, data)
    print(f"total wall time {data['wall_s']:.0f} s")
    return 0

