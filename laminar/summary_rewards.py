"""The summary's reward section (`reward` in summary.json): what the model scorers did in a run.

Read from files the roles already write (a run without `reward` replicas gets None):

    <workdir>/logs/reward.<id>.log        each replica's `rewards_scored` (trajectories, seconds,
                                          waiting, parse_failed) and `reward_batch_failed` lines
    <workdir>/logs/partial_pool.*.log     `trajectory_stored` lines of the trajectories that awaited
                                          their scores there (`components`: every term's raw score)
    <workdir>/logs/rollout.*.log          `trajectory_awaiting_reward`: when each was handed over
    <workdir>/pools/partial_pool-*.sqlite its `awaiting` table: what still awaits a score at the end

Keys (docs/rewards.md): `replicas` {id: {scorer, batches, trajectories, failed_batches,
parse_failures, latency_p50_s, latency_max_s, seconds_per_trajectory, queue_depth_max,
queue_depth_mean}}; `scored` (trajectories stored after their scores), `awaiting_at_end`,
`await_s_p50` / `await_s_max` (from the rollout's hand-over to the pool's store: scoring plus
queueing), `gave_up` (trajectories scored by the pool's give-up fallback), and `scorers` {name:
{trajectories, mean, vs: {"fn:<module:fn>": {n, pearson, agree}}}}: how each model's score
compares with each rule function's on the same trajectories: the Pearson correlation of the two
raw scores and `agree`, the share of trajectories on which both are on the same side of 0.5 (for a
verdict-like judge and a 0/1 verifier, the share of equal verdicts).
"""
from __future__ import annotations

import math
import sqlite3
from datetime import datetime
from pathlib import Path

from laminar.logs import read_rotated_jsonl


def reward_section(run: Path) -> dict | None:
    replicas = {path.name[len("reward."):-len(".log")]: replica(read_rotated_jsonl(path))
                for path in sorted((run / "logs").glob("reward.*.log"))}
    stored = [e for p in sorted((run / "logs").glob("partial_pool.*.log")) for e in read_rotated_jsonl(p)
              if e.get("event") == "trajectory_stored" and e.get("via") == "partial_pool"]
    if not replicas and not stored:
        return None
    handed = {e["trajectory"]: _ts(e) for p in sorted((run / "logs").glob("rollout.*.log"))
              for e in read_rotated_jsonl(p) if e.get("event") == "trajectory_awaiting_reward"}
    waits = sorted(_ts(e) - handed[e["trajectory"]] for e in stored if e["trajectory"] in handed)
    comps = [e.get("components") or {} for e in stored if str(e.get("status", "")).startswith(("stored", "dup"))]
    return {"replicas": replicas, "scored": len(comps), "awaiting_at_end": awaiting_at_end(run),
            "await_s_p50": _q(waits, 0.5), "await_s_max": waits[-1] if waits else None,
            "gave_up": sum(1 for c in comps if any(k.startswith("gave_up:") for k in c)),
            "scorers": scorer_stats(comps)}


def replica(events: list[dict]) -> dict:
    scored = [e for e in events if e.get("event") == "rewards_scored"]
    secs = sorted(float(e.get("seconds", 0.0)) for e in scored)
    n = sum(int(e.get("trajectories", 0)) for e in scored)
    waiting = [int(e.get("waiting", 0)) for e in scored]
    return {"scorer": next((e.get("scorer") for e in scored), None), "batches": len(scored), "trajectories": n,
            "failed_batches": sum(1 for e in events if e.get("event") == "reward_batch_failed"),
            "parse_failures": sum(int(e.get("parse_failed", 0)) for e in scored),
            "latency_p50_s": _q(secs, 0.5), "latency_max_s": secs[-1] if secs else None,
            "seconds_per_trajectory": sum(secs) / n if n else None,
            "queue_depth_max": max(waiting, default=None),
            "queue_depth_mean": sum(waiting) / len(waiting) if waiting else None}


def scorer_stats(comps: list[dict]) -> dict:
    """Per model scorer: its mean and how it compares with each rule function (same trajectories)."""
    names = sorted({k for c in comps for k in c if not k.startswith(("fn:", "gave_up:")) and k != "env"})
    rules = sorted({k for c in comps for k in c if k.startswith("fn:")})
    out = {}
    for s in names:
        xs = [c[s] for c in comps if s in c]
        vs = {}
        for f in rules:
            pairs = [(c[s], c[f]) for c in comps if s in c and f in c]
            vs[f] = {"n": len(pairs), "pearson": pearson(pairs),
                     "agree": sum((a >= 0.5) == (b >= 0.5) for a, b in pairs) / len(pairs) if pairs else None}
        out[s] = {"trajectories": len(xs), "mean": sum(xs) / len(xs) if xs else None, "vs": vs}
    return out


def pearson(pairs: list[tuple[float, float]]) -> float | None:
    """Correlation of the pairs' two values (None: fewer than 2, or one side constant)."""
    if len(pairs) < 2:
        return None
    n = len(pairs)
    ma, mb = sum(a for a, _ in pairs) / n, sum(b for _, b in pairs) / n
    cov = sum((a - ma) * (b - mb) for a, b in pairs)
    va, vb = sum((a - ma) ** 2 for a, _ in pairs), sum((b - mb) ** 2 for _, b in pairs)
    return cov / math.sqrt(va * vb) if va > 0 and vb > 0 else None


def awaiting_at_end(run: Path) -> int | None:
    """Rows of the partial pools' `awaiting` tables (None: no store, or one from before it)."""
    total, seen = 0, False
    for db in sorted((run / "pools").glob("partial_pool-*.sqlite")):
        try:
            with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
                total += con.execute("SELECT COUNT(*) FROM awaiting").fetchone()[0]
                seen = True
        except sqlite3.Error:
            continue
    return total if seen else None


def _q(xs: list[float], q: float) -> float | None:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def _ts(e: dict) -> float:
    return datetime.fromisoformat(str(e.get("timestamp", "1970-01-01T00:00:00+00:00")).replace("Z", "+00:00")
                                  ).timestamp()
