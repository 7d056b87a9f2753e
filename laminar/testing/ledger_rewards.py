"""The reward side of the multi-host ledger: was anything trained without its model score?

A run whose rollouts compose their reward with a model term (`roles.rollout.rewards` with a
`{role: NAME}` term) must store every trajectory through the partial pool, once every required
scorer applied its score: the pool's `trajectory_stored` line lists the components
(`components`, the scorer's name among them). A trajectory stored any other way (a rollout's own
`trajectory_stored` line: it put it straight into the buffer) or whose components lack a
required scorer entered the buffer unscored.

`trained_unscored` counts trained samples of that kind: for every group the trainer trained (as
often as it trained it), each member whose stored copies include one without a required score.
The buffer forgets which copy of a member it trained once it hands the group over, so a member
with several stored copies (attempts `~a<k>`, restarts `~r<n>`) counts when any of them lacked
its score: an upper bound, and exact when no copy ever enters the buffer unscored (the
contract). `trained_with_fallback` counts the trained members whose score is the pool's give-up
fallback (flagged `gave_up:<scorer>` in the components: the scorer failed for too long).

Pure reading of files (no processes): MultiHost.ledger calls it on a stopped cluster's folder.
"""
from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import yaml

STORED_LOGS = ("rollout.*.log", "partial_pool.*.log")  # the roles that log `trajectory_stored`


def required_scorers(config: Path) -> set[str]:
    """The scorers every trajectory's reward needs (`roles.rollout.rewards` terms `{role: NAME}`);
    empty when the config is absent or names none."""
    if not config.exists():
        return set()
    roles = (yaml.safe_load(config.read_text()) or {}).get("roles") or {}
    terms = (roles.get("rollout") or {}).get("rewards") or []
    return {t["role"] for t in terms if isinstance(t, dict) and t.get("role")}


def stored_events(run_dir: Path, log_events) -> Iterator[dict]:
    """Every `trajectory_stored` line of the run: rollouts' (stored by them) and the partial
    pool's (stored after awaiting their model scores)."""
    for pattern in STORED_LOGS:
        for log in sorted((run_dir / "logs").glob(pattern)):
            yield from log_events(log, "trajectory_stored")


def awaiting_ids(db: Path) -> set[str]:
    """Trajectories the partial pool still holds awaiting scores (its `awaiting` table)."""
    if not db.exists():
        return set()
    with sqlite3.connect(db) as con:
        if not con.execute("SELECT name FROM sqlite_master WHERE name = 'awaiting'").fetchone():
            return set()
        return {t for (t,) in con.execute("SELECT tid FROM awaiting")}


def unscored_members(events: list[dict], required: set[str], member_of) -> tuple[set[str], set[str]]:
    """(members with a stored copy lacking a required score, members with one scored by a
    fallback), from `trajectory_stored` lines."""
    unscored, fallback = set(), set()
    if not required:
        return unscored, fallback
    for e in events:
        if not (str(e.get("status", "")).startswith(("stored", "duplicate"))):
            continue
        comps = e.get("components") or {}
        m = member_of(e["trajectory"])
        if not required <= set(comps):
            unscored.add(m)
        elif any(f"gave_up:{s}" in comps for s in required):
            fallback.add(m)
    return unscored, fallback


def trained_counts(trained_groups: list[str], unscored: set[str], fallback: set[str], group_of) -> dict:
    """Trained samples (a group once per time it was trained) among `unscored` and `fallback` members."""
    per_group: dict[str, tuple[int, int]] = {}
    for m in unscored | fallback:
        u, f = per_group.get(group_of(m), (0, 0))
        per_group[group_of(m)] = (u + (m in unscored), f + (m in fallback and m not in unscored))
    return {"trained_unscored": sum(per_group.get(g, (0, 0))[0] for g in trained_groups),
            "trained_with_fallback": sum(per_group.get(g, (0, 0))[1] for g in trained_groups)}
