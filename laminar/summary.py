"""The end-of-run summary: `<workdir>/summary.json`, a table on stdout, and `<workdir>/summary.png`.

Reads only files the roles already write, so it can also be run on a finished (or running) run:

    <workdir>/trainer/metrics.jsonl   one record per version (reward, staleness, batch tokens, ts)
    <workdir>/manager/repacks.jsonl   one record per executed repack plan
    <workdir>/manager/fleet.jsonl     every rollout report (state, KV usage) the manager saw (this
                                      and repacks.jsonl rotate by size: fleet.jsonl.1, .2, ... read too)
    <workdir>/run.json                the run's record (`laminar-node up`): the task (run.task, else the
                                      rollouts' reward); older runs: the `config_resolved` line of
    <workdir>/logs/rollout.*.log
    <workdir>/evaluator/metrics.jsonl one record per evaluation (held-out accuracy of a version)

    python -m laminar.summary RUN_DIR      (laminar-node up does this when the trainer finishes)

It (re)writes RUN_DIR/summary.json and RUN_DIR/summary.png (when matplotlib is installed) and
prints the table. A folder without trainer/metrics.jsonl is not a run: it is refused (exit 2)
and nothing is written there.

Throughput is the paper's metric (docs/architecture.md §8): prompt + response tokens of one global batch ÷ the
time between two consecutive actor updates, averaged after `warmup` iterations. Rollout idle
fraction is the share of rollout reports, between the first and the last actor update, in which
a rollout was idle (neither generating nor loading).

Learning: `mismatch_mean_abs` is the mean over the versions that measured the train-inference
mismatch (|trainer - behaviour| logprob of the same tokens under the same weights version) of
each version's token mean, `mismatch_max_abs` the largest |delta| of the run;
`skipped_nonfinite_steps` counts the optimizer steps the trainer skipped for a NaN/inf loss or
gradient; `eval_accuracy_first/last` are the first and last held-out accuracies (`eval/accuracy`,
greedy answers; the first is version 0, before training, when the evaluator ran from the start),
`eval_accuracy_first_ci/last_ci` their 95% intervals [lo, hi] (Wilson's, laminar/intervals.py),
`eval_accuracy_sampled_first/last` the same for the sampled answers, `eval_versions` the versions
evaluated; None when the run did not evaluate. `groups_generated` / `groups_kept` /
`groups_dropped_nosignal` / `versions_without_step` / `filter_cap_versions` say what the versions
were made of (dynamic sampling, docs/learning.md). `eval` is {set: {metric: {first, last, best}}}
over the evaluations of every eval set (with `first_ci`/`last_ci`, 95% intervals), `eval_best` the
evaluator's best.json (docs/evaluation.md), `eval_change` {set: {metric: {from, to, diff, lo, hi}}}
the last evaluation minus the first on the same problems with the 95% interval of that paired
difference (from `<workdir>/evaluator/scores.jsonl`, each problem's scores per evaluation).
`curriculum` is {prompt pool id: its difficulty curriculum's last counts} (retired, down-weighted,
pass rate; `<workdir>/prompt_pool/curriculum-<id>.json`, docs/learning.md), {} when it was off.
`reward` is what the model scorers did (replicas' latency and queue depth, parse failures, time
awaiting a score, each model's agreement with the rule functions): laminar/summary_rewards.py,
docs/rewards.md; None for a run without them. `agents` is what the agent roles ran (episodes, how
they ended, episodes per second): laminar/summary_agents.py; None without an agent role. `moe` is
a mixture-of-experts run's versions one by one (reward, staleness, mismatch, the share of tokens
whose top-k differs, routing bytes per trajectory): laminar/summary_moe.py; None without routing.
`sandbox_alarms` lists what an env role's code sandbox ran without ({env, event, warning}: no
per-run cgroup, `sandbox_no_cgroup`; no system-call filter, `sandbox_degraded`), from
`<workdir>/logs/env.*.log`; [] when every sandbox had all its layers (or the run had no env role).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from laminar.intervals import paired_difference
from laminar.logs import read_rotated_jsonl
from laminar.report import read_jsonl
from laminar.summary_agents import agent_section
from laminar.summary_moe import moe_section, moe_table
from laminar.summary_rewards import reward_section


def summarize(run_dir: str | Path, warmup: int = 1, window: int = 5) -> dict:
    run = Path(run_dir)
    recs = read_jsonl(run / "trainer" / "metrics.jsonl")
    repacks = read_rotated_jsonl(run / "manager" / "repacks.jsonl")  # with its rotated files, oldest first
    fleet = read_rotated_jsonl(run / "manager" / "fleet.jsonl")
    out: dict = {"run_dir": str(run), "iterations": len(recs), "task": task_of(run),
                 "reward_first": None, "reward_last": None, "max_staleness": None}
    evals = read_jsonl(run / "evaluator" / "metrics.jsonl")
    out.update(learning_stats(recs, evals))
    out["eval"] = eval_sets(evals)
    out["eval_change"] = eval_change(run)
    out["reward"] = reward_section(run)  # model scorers (summary_rewards.py); None without any
    out["agents"] = agent_section(run)   # agent programs run (summary_agents.py); None without an agent role
    out["moe"] = moe_section(recs)       # per version, with routing (summary_moe.py); None without routing
    try:
        out["eval_best"] = json.loads((run / "evaluator" / "best.json").read_text())
    except (OSError, ValueError):
        out["eval_best"] = None
    out["sandbox_alarms"] = sandbox_alarms(run)
    out["curriculum"] = {f.stem.partition("-")[2]: json.loads(f.read_text())
                         for f in sorted((run / "prompt_pool").glob("curriculum-*.json"))}
    if recs:
        rewards = [r["reward_mean"] for r in recs]
        k = max(1, min(window, len(recs) // 2 or 1))
        out["reward_first"] = sum(rewards[:k]) / k
        out["reward_last"] = sum(rewards[-k:]) / k
        out["reward_window"] = k
        stale: Counter = Counter()
        for r in recs:
            for key, v in r.items():
                if key.startswith("staleness/"):
                    stale[int(key.split("/")[1])] += int(v)
        out["max_staleness"] = max(stale) if stale else 0
        out["staleness_histogram"] = {str(k): v for k, v in sorted(stale.items())}
        out["response_len_mean"] = sum(r.get("response_len_mean", 0) for r in recs) / len(recs)
        out["publish_stall_s_max"] = max(r.get("publish_stall_s", 0.0) for r in recs)
        tput = [b.get("batch_tokens", 0.0) / (b["ts"] - a["ts"])
                for a, b in zip(recs, recs[1:], strict=False) if b["ts"] > a["ts"]]
        tput = tput[warmup:] or tput  # the first intervals include engine and trainer warm-up
        out["throughput_tokens_per_s"] = sum(tput) / len(tput) if tput else None
        out["duration_s"] = recs[-1]["ts"] - recs[0]["ts"]
    out["repacks"] = sum(len(r["moves"]) for r in repacks)
    out["repack_plans"] = len(repacks)
    out["repack_s_mean"] = (sum(r["seconds"] for r in repacks) / len(repacks)) if repacks else None
    out["moved_trajectories"] = sum(m["moved"] for r in repacks for m in r["moves"])
    # steady state: rollout reports between the first and the last actor update
    out.update(fleet_stats(fleet, recs[0]["ts"], recs[-1]["ts"]) if len(recs) > 1 else fleet_stats(fleet))
    return out


def learning_stats(recs: list[dict], eval_recs: list[dict] | None = None) -> dict:
    """Mismatch and skipped non-finite steps over the trainer's per-version records; held-out
    accuracy over the evaluator's records (`eval_recs`, in the order written), else over any
    `eval/accuracy` the trainer's records carry."""
    measured = [r for r in recs if r.get("mismatch_tokens", 0) > 0 and "mismatch_mean_abs" in r]
    source = eval_recs if eval_recs else recs
    evals = [r[k] for r in source for k in ("eval/accuracy", "eval_accuracy") if r.get(k) is not None]
    sampled = [r["eval/accuracy_sampled"] for r in source if r.get("eval/accuracy_sampled") is not None]
    cis = [_accuracy_ci(r) for r in (eval_recs or []) if r.get("eval/accuracy") is not None]
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    return {"mismatch_mean_abs": mean([r["mismatch_mean_abs"] for r in measured]),
            "mismatch_max_abs": max((r["mismatch_max_abs"] for r in measured), default=None),
            "mismatch_k3_mean": mean([r["mismatch_k3"] for r in measured if "mismatch_k3" in r]),
            "mismatch_versions": len(measured),
            "skipped_nonfinite_steps": int(sum(r.get("skipped_nonfinite_steps", 0) for r in recs)),
            **intake_stats(recs),
            "eval_accuracy_first": evals[0] if evals else None,
            "eval_accuracy_last": evals[-1] if evals else None,
            "eval_accuracy_first_ci": cis[0] if cis else None,
            "eval_accuracy_last_ci": cis[-1] if cis else None,
            "eval_accuracy_sampled_first": sampled[0] if sampled else None,
            "eval_accuracy_sampled_last": sampled[-1] if sampled else None,
            "eval_versions": [int(r["version"]) for r in (eval_recs or []) if "version" in r]}


def eval_sets(evals: list[dict]) -> dict:
    """{set: {metric: {first, last, best}}} over the evaluations (`eval/<set>/<metric>` values, in
    the order written; best: the highest), with `first_ci` / `last_ci`, the 95% interval [lo, hi]
    of the first and last value when the evaluator recorded it (`eval/<set>/<metric>/lo`, `/hi`),
    and the same bounds by name, `first_lo`, `first_hi`, `last_lo`, `last_hi`;
    runs from before named sets have their greedy and sampled accuracy as the set `heldout`
    (greedy, avg)."""
    series: dict[str, dict[str, list[tuple[float, list[float] | None]]]] = {}
    for e in evals:
        named = {k: v for k, v in e.items() if k.startswith("eval/") and k.count("/") == 2}
        if not named:  # an older evaluator: eval/accuracy and eval/accuracy_sampled only
            named = {f"eval/heldout/{m}": e[k] for k, m in (("eval/accuracy", "greedy"),
                                                           ("eval/accuracy_sampled", "avg")) if k in e}
        for k, v in named.items():
            _, name, metric = k.split("/")
            if metric in ("problems", "response_len_mean") or not isinstance(v, (int, float)):
                continue
            ci = [e[f"{k}/lo"], e[f"{k}/hi"]] if f"{k}/lo" in e and f"{k}/hi" in e else None
            series.setdefault(name, {}).setdefault(metric, []).append((float(v), ci))
    out: dict = {}
    for name, ms in series.items():
        for m, xs in ms.items():
            got = {"first": xs[0][0], "last": xs[-1][0], "best": max(x for x, _ in xs)}
            if xs[0][1] is not None:   # the bounds also by name (first_lo ... last_hi): what a check reads
                (flo, fhi), (llo, lhi) = xs[0][1], xs[-1][1] or [None, None]
                got.update(first_ci=xs[0][1], last_ci=xs[-1][1], first_lo=flo, first_hi=fhi, last_lo=llo,
                           last_hi=lhi)
            out.setdefault(name, {})[m] = got
    return out


def eval_change(run: Path) -> dict:
    """{set: {metric: {from, to, diff, lo, hi}}}: the last evaluation minus the first on the same
    problems, with the 95% interval of that paired difference (laminar/intervals.py: a bootstrap
    over problems, far narrower than two separate intervals, since a problem's difficulty is shared
    by both); the change is significant when [lo, hi] excludes 0. From the evaluator's per-problem
    scores (`evaluator/scores.jsonl`); {} without two evaluations of a set."""
    recs = read_jsonl(run / "evaluator" / "scores.jsonl")
    out: dict = {}
    if len(recs) < 2:
        return out
    first, last = recs[0], recs[-1]
    for name, a in (first.get("sets") or {}).items():
        b = (last.get("sets") or {}).get(name)
        if not b or a.get("ids") != b.get("ids"):
            continue   # another set of problems: no paired comparison
        for m, before in a["scores"].items():
            after = b["scores"].get(m)
            if after is None or len(after) != len(before):
                continue
            d, lo, hi = paired_difference(before, after)
            out.setdefault(name, {})[m] = {"from": first["version"], "to": last["version"], "diff": d, "lo": lo,
                                           "hi": hi}
    return out


def _accuracy_ci(rec: dict) -> list[float] | None:
    """The 95% interval of a record's eval/accuracy: its first set's greedy interval (None: not recorded)."""
    for k in rec:
        if k.startswith("eval/") and k.endswith("/greedy/lo") and k.count("/") == 3:
            if rec[k[:-3]] == rec["eval/accuracy"] and f"{k[:-3]}/hi" in rec:
                return [rec[k], rec[f"{k[:-3]}/hi"]]
    return None


def intake_stats(recs: list[dict]) -> dict:
    """What the versions were made of: groups generated (trained or dropped for no signal by
    dynamic sampling), kept (with a reward spread: in the loss), dropped, the versions that hit the
    filter's cap, and the versions that made no optimizer step (every group without a signal)."""
    def total(key: str, default=lambda r: 0.0) -> int:
        return int(sum(r.get(key, default(r)) for r in recs))
    return {"groups_generated": total("groups_generated",
                                      lambda r: r.get("groups", 0) + r.get("groups_dropped_nosignal", 0)),
            "groups_kept": total("groups_kept", lambda r: r.get("groups", 0) - r.get("groups_uniform", 0)),
            "groups_dropped_nosignal": total("groups_dropped_nosignal"),
            "nosignal_tokens": total("nosignal_tokens"),
            "filter_cap_versions": total("filter_cap_reached"),
            "versions_without_step": sum(1 for r in recs if r.get("no_signal_steps", 0) > 0)}


def task_of(run: Path) -> str | None:
    """The run's task: from the run's record (`run.json`, written by `laminar-node up`: `run.task`,
    else the rollouts' reward function), else from the `config_resolved` line of a rollout's log
    (runs from before the record)."""
    try:
        task = json.loads((run / "run.json").read_text()).get("task")
        if task:
            return str(task)
    except (OSError, ValueError, AttributeError):
        pass
    for path in sorted((run / "logs").glob("rollout.*.log")):
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            if '"config_resolved"' not in line:
                continue
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            task = (ev.get("run") or {}).get("task") or (ev.get("settings") or {}).get("reward")
            if task:
                return str(task)
    return None


SANDBOX_EVENTS = ("sandbox_no_cgroup", "sandbox_degraded")


def sandbox_alarms(run: Path) -> list[dict]:
    """What the env roles' sandboxes ran without, from their logs (each warning once per env)."""
    out, seen = [], set()
    for log in sorted((run / "logs").glob("env.*.log")):
        env = log.name[:-len(".log")]
        for rec in read_rotated_jsonl(log):
            if rec.get("event") in SANDBOX_EVENTS and (env, rec.get("warning")) not in seen:
                seen.add((env, rec.get("warning")))
                out.append({"env": env, "event": rec["event"], "warning": rec.get("warning")})
    return out


def fleet_stats(fleet: list[dict], since: float | None = None, until: float | None = None) -> dict:
    rows = [f for f in fleet if (since is None or f["ts"] >= since) and (until is None or f["ts"] <= until)]
    if not rows:
        return {"rollout_idle_fraction": None, "kv_usage_mean": None}
    idle = sum(1 for f in rows if f["st"] == "idle") / len(rows)
    busy = [f["kv"] for f in rows if f["st"] != "idle"]
    return {"rollout_idle_fraction": idle, "kv_usage_mean": sum(f["kv"] for f in rows) / len(rows),
            "kv_usage_mean_busy": (sum(busy) / len(busy)) if busy else 0.0,
            "rollouts": sorted({f["id"] for f in rows})}


def table(s: dict) -> str:
    def f(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    keys = ["task", "iterations", "reward_first", "reward_last", "eval_accuracy_first", "eval_accuracy_last",
            "eval_accuracy_sampled_first", "eval_accuracy_sampled_last", "eval_versions", "groups_generated",
            "groups_kept", "versions_without_step", "filter_cap_versions",
            "throughput_tokens_per_s", "max_staleness", "staleness_histogram", "mismatch_mean_abs",
            "mismatch_max_abs", "skipped_nonfinite_steps", "repacks", "moved_trajectories", "repack_s_mean",
            "rollout_idle_fraction", "kv_usage_mean", "publish_stall_s_max", "duration_s"]
    width = max(map(len, keys))

    def cell(k):
        ci = s.get(f"{k}_ci")
        return f"{f(s.get(k))} [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else f(s.get(k))
    rows = [f"  {k:<{width}}  {cell(k)}" for k in keys]
    for name, ms in (s.get("eval_change") or {}).items():
        for m, c in ms.items():
            sig = "" if c["lo"] <= 0 <= c["hi"] else " (significant)"
            rows.append(f"  {'change[' + name + '/' + m + ']':<{width}}  v{c['from']} -> v{c['to']}: "
                        f"{c['diff']:+.3f} [{c['lo']:+.3f}, {c['hi']:+.3f}]{sig}")
    if s.get("agents"):
        a = s["agents"]
        rows.append(f"  {'agent episodes':<{width}}  {a['episodes']} ({a['exit_ok']} exit 0, {a['killed']} killed), "
                    f"{f(a['episodes_per_s'])} episodes/s")
    for a in s.get("sandbox_alarms") or []:
        rows.append(f"  {'sandbox[' + a['env'] + ']':<{width}}  {a['event']}: {a['warning']}")
    for name, sc in ((s.get("reward") or {}).get("scorers") or {}).items():
        vs = ", ".join(f"{fn[3:]}: r {f(v['pearson'])}, agree {f(v['agree'])}" for fn, v in sc["vs"].items())
        rows.append(f"  {'reward[' + name + ']':<{width}}  {sc['trajectories']} scored, mean {f(sc['mean'])}"
                    + (f"; vs {vs}" if vs else ""))
    if s.get("moe"):
        rows.append(moe_table(s["moe"]))
    return "\n".join(rows)


def plot(run_dir: str | Path, out: str | Path | None = None) -> Path | None:
    """Reward, held-out accuracy (when the run evaluated) and throughput over time (PNG). None when
    matplotlib is not installed."""
    try:
        import matplotlib  # late: matplotlib (heavy, optional), only for the plot
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # late: as matplotlib, after its backend is chosen
    except ImportError:
        return None
    run = Path(run_dir)
    recs = read_jsonl(run / "trainer" / "metrics.jsonl")
    if not recs:
        return None
    t0 = recs[0]["ts"]
    evals = [e for e in read_jsonl(run / "evaluator" / "metrics.jsonl") if "eval/accuracy" in e and "ts" in e]
    if evals:
        fig, (ax1, axe, ax2) = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    else:
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax1.plot([r["ts"] - t0 for r in recs], [r["reward_mean"] for r in recs], marker=".")
    ax1.set_ylabel("reward (batch mean)")
    ax1.grid(alpha=0.3)
    if evals:
        xs = [e["ts"] - t0 for e in evals]
        named = sorted({k for e in evals for k in e if k.startswith("eval/") and k.count("/") == 2
                        and k.rsplit("/", 1)[1] not in ("problems", "response_len_mean")})
        for k in named:  # every eval set's metrics (named sets), with their 95% intervals when recorded
            pts = [(x, e[k], e.get(f"{k}/lo"), e.get(f"{k}/hi")) for x, e in zip(xs, evals, strict=True) if k in e]
            line, = axe.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=k.split("/", 1)[1])
            band = [p for p in pts if p[2] is not None and p[3] is not None]
            if band:
                axe.fill_between([p[0] for p in band], [p[2] for p in band], [p[3] for p in band],
                                 color=line.get_color(), alpha=0.15, linewidth=0)
        if not named:
            axe.plot(xs, [e["eval/accuracy"] for e in evals], marker="o", label="greedy")
        if not named and any("eval/accuracy_sampled" in e for e in evals):
            axe.plot([x for x, e in zip(xs, evals, strict=True) if "eval/accuracy_sampled" in e],
                     [e["eval/accuracy_sampled"] for e in evals if "eval/accuracy_sampled" in e], marker="o",
                     label="sampled")
        for x, e in zip(xs, evals, strict=True):
            axe.annotate(f"v{int(e.get('version', 0))}", (x, e["eval/accuracy"]), fontsize=7,
                         textcoords="offset points", xytext=(0, 4))
        axe.set_ylabel("held-out accuracy (band: 95% interval)")
        axe.set_ylim(0, 1)
        axe.legend(loc="lower right")
        axe.grid(alpha=0.3)
    tput = [(b["ts"] - t0, b.get("batch_tokens", 0.0) / (b["ts"] - a["ts"]))
            for a, b in zip(recs, recs[1:], strict=False) if b["ts"] > a["ts"]]
    if tput:
        ax2.plot(*zip(*tput, strict=False), marker=".", color="tab:green")
    ax2.set_ylabel("throughput (tokens/s)")
    ax2.set_xlabel("seconds since the first update")
    ax2.grid(alpha=0.3)
    fig.suptitle(f"{run.name}: reward{', held-out accuracy' if evals else ''} and throughput per version")
    fig.tight_layout()
    path = Path(out) if out else run / "summary.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write(run_dir: str | Path) -> dict:
    run = Path(run_dir)
    s = summarize(run)
    png = plot(run)
    s["plot"] = str(png) if png else None
    (run / "summary.json").write_text(json.dumps(s, indent=2) + "\n")
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m laminar.summary", description=__doc__.split("\n\n")[0],
                                 epilog="writes RUN_DIR/summary.json and RUN_DIR/summary.png (replacing them) and "
                                        "prints the table; exit 2 when RUN_DIR holds no run")
    ap.add_argument("run_dir", help="a run's workdir (run.workdir of its config), holding trainer/metrics.jsonl")
    ap.add_argument("--expect-versions", type=int, default=0, metavar="N",
                    help="exit 1 unless the trainer made at least N versions (CI's check of the demo)")
    ap.add_argument("--expect-evals", type=int, default=0, metavar="K",
                    help="exit 1 unless the evaluator evaluated at least K versions")
    a = ap.parse_args(argv)
    run = Path(a.run_dir)
    if not run.is_dir():
        print(f"error: {run}: no such folder", file=sys.stderr)
        return 2
    if not (run / "trainer" / "metrics.jsonl").is_file():
        print(f"error: {run}: no trainer/metrics.jsonl: not a run's workdir, or its trainer has not finished a "
              "version yet", file=sys.stderr)
        return 2
    s = write(run)
    print(table(s))
    print(f"summary: {run / 'summary.json'}" + (f"   plot: {s['plot']}" if s["plot"] else ""))
    return expectations(s, a.expect_versions, a.expect_evals)


def expectations(s: dict, versions: int, evals: int) -> int:
    """0 when the run made at least `versions` versions and `evals` evaluations, else 1 (said why)."""
    short = []
    if s["iterations"] < versions:
        short.append(f"{s['iterations']} versions (expected at least {versions})")
    if len(s.get("eval_versions") or []) < evals:
        short.append(f"{len(s.get('eval_versions') or [])} evaluations (expected at least {evals})")
    for why in short:
        print(f"error: the run made only {why}", file=sys.stderr)
    return 1 if short else 0


if __name__ == "__main__":
    sys.exit(main())
