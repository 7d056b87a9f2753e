"""The fault ledger of a multi-host run, read from a finished run folder (laminar/testing/multihost.py,
bench/chaos.py, docs/faults.md "Checking it: the fault ledger").

    ledger(run_dir)                     lost, trained twice, stored twice, handed untrained, unscored
    checks(run_dir)                     lineage, prompts skipped, staleness, buffer refusals
    incomplete_groups(run_dir, before)  groups still incomplete after the drain

Everything here reads what the components recorded themselves (role logs, the trainer's
metrics.jsonl, the pools' SQLite stores), after the cluster stopped; nothing runs a process.
Trajectory ids: `<group>/<i>` from the prompt pool, `~a<k>` appended for its k-th re-issue (a
requeue: a new attempt), `~r<n>` appended by the manager for an orphan restarted from its prompt.
`member_of` strips both: the group's sample slot the id fills.
"""
from __future__ import annotations

import json
import re
import sqlite3
from collections import Counter
from datetime import datetime
from pathlib import Path

from laminar.logs import rotated_files
from laminar.roles.sqlite_store import unpack
from laminar.testing.ledger_rewards import (
    awaiting_ids,
    required_scorers,
    stored_events,
    trained_counts,
    unscored_members,
)
from laminar.testing.procs import log_events as events_in
from laminar.weights.lineage import read_lineage
from laminar.weights.manifest import off_lineage


def log_events(path: str | Path, name: str) -> list[dict]:
    """A role log's events named `name`, from its rotated files too (laminar/logs.py), oldest first."""
    return [e for f in rotated_files(path) for e in events_in(f, name)]


def member_of(tid: str) -> str:
    """`<group>/<i>` of any id of that member: without its attempt (`~a<k>`) and restart (`~r<n>`)."""
    return re.sub(r"(~[ar][0-9]+)+$", "", tid)


def group_of(tid: str) -> str:
    return member_of(tid).rsplit("/", 1)[0]


def event_time(e: dict) -> float:
    """A log event's time, epoch seconds."""
    stamp = str(e.get("timestamp", "1970-01-01T00:00:00+00:00")).replace("Z", "+00:00")
    return datetime.fromisoformat(stamp).timestamp()


def role_log(run_dir: Path, role: str, id: str) -> Path:
    return Path(run_dir) / "logs" / f"{role}.{id}.log"


def read_metrics(run_dir: Path) -> list[dict]:
    """The trainer's metrics.jsonl records (one per kept version)."""
    p = Path(run_dir) / "trainer" / "metrics.jsonl"
    if not p.exists():
        return []
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()]


def ledger(run_dir: str | Path) -> dict:
    """After the run (cluster stopped): the cross-check of every component's own records."""
    run_dir = Path(run_dir)

    metrics = read_metrics(run_dir)
    trained = [g for r in metrics for g in r["group_ids"]]
    stored: dict[str, int] = {}
    stored_version: dict[str, tuple[int, int]] = {}  # trajectory -> the (lineage, version) it was stored with
    # refused by the buffer as a duplicate: it already held that sample (stored by a rollout
    # whose acknowledgement, and so whose log line, was lost with its host or link)
    held: set[str] = set()
    events = list(stored_events(run_dir, log_events))  # rollouts' and the partial pool's lines
    for e in events:
        if str(e["status"]).startswith("duplicate"):
            held.add(e["trajectory"].split("~r")[0])
        if e["status"] == "stored":
            stored[e["trajectory"]] = stored.get(e["trajectory"], 0) + 1
            stored_version[e["trajectory"]] = (int(e.get("lineage", -1)), int(e["version"]))
    base = lambda t: t.split("~r")[0]  # noqa: E731  (a restarted orphan keeps its original id before ~r)
    recovered = {base(t) for e in log_events(role_log(run_dir, "manager", "0"), "recovering") for t in e["ids"]}
    restarted = {base(t) for e in log_events(role_log(run_dir, "manager", "0"), "orphans_restarted") for t in e["ids"]}
    adopted = {t: (int(e.get("lineage", -1)), int(e["version"]))  # the weights each was adopted for
               for e in log_events(role_log(run_dir, "manager", "0"), "orphans_adopted") for t in e["ids"]}
    stored_ids = {base(t) for t in stored} | held
    db = run_dir / "pools" / "partial_pool-0.sqlite"
    pending: set[str] = set()
    if db.exists():
        with sqlite3.connect(db) as con:
            pending = {base(t) for (t,) in con.execute("SELECT DISTINCT tid FROM deltas")}
            # deltas stored in batches (the chunks table): their trajectories not yet completed
            done = {t for (t,) in con.execute("SELECT tid FROM completed")}
            pending |= {base(t) for (blob,) in con.execute("SELECT blob FROM chunks")
                        for t in unpack(blob).trajectory_ids if t not in done}
        pending |= {base(t) for t in awaiting_ids(db)}  # finished, awaiting a model's score
    dropped: dict[str, str] = {}  # groups the buffer let go by its policy (evicted, stale)
    handed: set[str] = set()      # groups the buffer handed to the trainer
    leased: set[str] = set()      # ... of which still leased (after the trainer's newest checkpoint)
    db = run_dir / "pools" / "experience_buffer-0.sqlite"
    if db.exists():
        with sqlite3.connect(db) as con:
            dropped = {g: why for g, why in con.execute("SELECT gid, why FROM gone WHERE why != 'handed'")}
            handed = {g for (g,) in con.execute("SELECT gid FROM gone WHERE why = 'handed'")}
            leased = {g for (g,) in con.execute("SELECT gid FROM handed")}
    # groups trained in versions an operator's restore of an older checkpoint discarded after
    # they were checkpointed (the buffer had released them at that checkpoint): lost to training
    # by that restore, by design, not by the system (restart_trainer_on_older_checkpoint)
    aside = [int(p.name[1:]) for p in (run_dir / "trainer" / "checkpoints-set-aside").glob("v*")
             if p.name[1:].isdigit()]
    by_restore: set[str] = set()
    discarded = run_dir / "trainer" / "metrics.discarded.jsonl"
    if aside and discarded.exists():
        for line in discarded.read_text().splitlines():
            r = json.loads(line) if line.strip() else {}
            if r and int(r.get("version", 0)) <= max(aside):
                by_restore.update(r.get("group_ids", []))
    by_policy = {t for t in recovered - stored_ids - pending if group_of(t) in dropped}
    # a group the buffer dropped as off-lineage (a trainer restart discarded its weights) runs
    # again as a new attempt, under new ids (`~a<k>`): an id stored twice is a real double store
    times = Counter(base(t) for t, k in stored.items() for _ in range(k))
    versions = [int(r["version"]) for r in metrics]
    return {"versions": versions, "versions_monotone": versions == sorted(set(versions)),
            "groups_trained": len(trained), "samples_trained_twice": len(trained) - len(set(trained)),
            "trajectories_stored": len(stored),
            "stored_twice": sum(1 for n in times.values() if n > 1),
            # attempts of one member stored more than once (each attempt under its own id): the
            # buffer keeps one per sample slot, so at most one of them is trained
            "members_stored_in_several_attempts": sum(
                1 for n in Counter(member_of(t) for t in times).values() if n > 1),
            "recovered": len(recovered), "recovered_finished": len(recovered & stored_ids),
            "recovered_already_held": len((recovered & held) - {base(t) for t in stored}),
            "recovered_restarted": len(restarted), "recovered_pending": len((recovered - stored_ids) & pending),
            # resumed on their own weights, (lineage, version), from a relay's retained copy; stored
            # with others: wrong
            "recovered_adopted": len(adopted),
            # (a lineage of -1: a manager that did not log it; the version alone is compared)
            "adopted_wrong_version": sum(
                1 for t, (lin, v) in adopted.items() if t in stored_version
                and (stored_version[t][1] != v or (lin >= 0 and stored_version[t][0] != lin))),
            "recovered_dropped_by_policy": len(by_policy), "groups_dropped_by_policy": len(dropped),
            "trajectories_lost": len(recovered - stored_ids - pending - by_policy),
            # handed to a trainer, in no version it kept, and not leased for its successor
            "groups_handed_untrained": len(handed - set(trained) - leased - by_restore),
            "groups_untrained_by_older_checkpoint": len((handed - set(trained) - leased) & by_restore),
            "groups_leased": len(leased),
            # trained members stored without a required model score (ledger_rewards.py)
            **trained_counts(trained, *unscored_members(events, required_scorers(Path(run_dir).parent
                                                                                 / "cluster.yaml"), member_of),
                             group_of)}


def incomplete_groups(run_dir: str | Path, before: float) -> dict:
    """After the run: groups the buffer still holds incomplete (fewer members than the group's
    size) although a member of theirs was stored before `before` (epoch seconds: the start of
    the drain). Such a group was given the whole drain to complete and did not: its missing
    members are stranded (a member nobody runs holds its room forever)."""
    run_dir = Path(run_dir)


    db = run_dir / "pools" / "experience_buffer-0.sqlite"
    if not db.exists():
        return {"incomplete_groups_after_drain": 0, "incomplete_group_examples": []}
    first_stored: dict[str, float] = {}
    for e in stored_events(run_dir, log_events):
        if e.get("status") == "stored":
            g = group_of(e["trajectory"])
            t = event_time(e)
            first_stored[g] = min(first_stored.get(g, t), t)
    held: dict[str, tuple[int, int]] = {}
    with sqlite3.connect(db) as con:
        gone = {g for (g,) in con.execute("SELECT gid FROM gone")}
        for gid, blob in con.execute("SELECT gid, blob FROM trajs"):
            n, size = held.get(gid, (0, 0))
            held[gid] = (n + 1, max(size, unpack(blob).spec.group_size))
    stuck = sorted(g for g, (n, size) in held.items()
                   if n < size and g not in gone and first_stored.get(g, 0.0) < before)
    return {"incomplete_groups_after_drain": len(stuck), "incomplete_group_examples": stuck[:10]}


def checks(run_dir: str | Path) -> dict:
    """After the run (cluster stopped): the lineage, prompt and staleness checks.

    Lineage: metrics.jsonl holds one record per kept version V (records past a resumed
    checkpoint are moved out), trained by the lineage that started below V last (lineage.json's
    forks), with the trainer's own count of the weights labels it trained (`weights`,
    {"<lineage>:<version>": samples}). Each label (lineage l, version v) is a violation when it is
    outside that lineage's history (manifest.off_lineage: it should have been dropped off-lineage
    and requeued, `lineage_dropped` counts those), when v >= V (the trainer had not published v
    when it trained V), or when v precedes lineage l's start (the trainer never published v on l).
    What was trained is read from the trainer, not guessed from the rollouts' logs: a member
    runs in several copies (attempts `~a<k>` after an off-lineage drop, restarts `~r<n>`), and
    the copy the buffer kept may have logged only `duplicate` (its first put's reply was lost),
    so the newest `stored` line of a member can name a copy that was dropped. A violation lists
    the trained groups whose members' rollout lines name its label. A record without labels (an
    older trainer) counts its samples as unlabelled, not checked.

    Prompts: the prompt pool's `prompts_skipped` (fresh groups handed out that are neither
    settled nor outstanding nor requeued), from its store, as its heartbeat counts it. Staleness:
    samples with negative staleness in metrics.jsonl's histogram."""
    run_dir = Path(run_dir)


    lin = read_lineage(run_dir / "trainer" / "checkpoints") or {"epoch": 0, "forks": {}}
    forks = {int(k): int(v) for k, v in lin["forks"].items()}
    named: dict[str, set[tuple[int, int]]] = {}  # group -> the labels its members' rollout lines name
    refusals = 0
    for e in stored_events(run_dir, log_events):
        named.setdefault(group_of(e["trajectory"]), set()).add((int(e.get("lineage", -1)), int(e["version"])))
    for log in (run_dir / "logs").glob("rollout.*.log"):
        refusals += sum(1 for e in log_events(log, "put_refused") if str(e.get("status", "")).startswith("full"))
    violations, checked, unlabelled, negative = [], 0, 0, 0
    for r in read_metrics(run_dir):
        V = int(r["version"])
        for k, n in r.items():
            if k.startswith("staleness/") and int(float(k.split("/", 1)[1])) < 0:
                negative += int(n)
        L = max((e for e, f in forks.items() if f < V), default=-1)
        if "weights" not in r:
            unlabelled += int(r.get("samples", 0))
            continue
        for label, n in r["weights"].items():
            lineage, v = (int(x) for x in label.split(":"))
            checked += int(n)
            why = ("off the trained lineage's history" if L >= 0 and off_lineage(lineage, v, L, forks) else
                   "version not yet published" if v >= V else
                   "before its lineage started" if lineage in forks and v < forks[lineage] else None)
            if why:
                violations.append({"lineage": lineage, "version": v, "samples": int(n), "trained_version": V,
                                   "trained_lineage": L, "why": why,
                                   "groups": [g for g in r["group_ids"] if (lineage, v) in named.get(g, ())][:8]})
    skipped = None
    db = run_dir / "pools" / "prompt_pool-0.sqlite"
    if db.exists():  # the pool's counts()["prompts_skipped"], from what its store holds (it is stopped)
        with sqlite3.connect(db) as con:
            handed = (con.execute("SELECT handed FROM cursor WHERE k = 0").fetchone() or (0,))[0]
            settled = dict(con.execute("SELECT k, v FROM accounting")).get("settled", handed)
            entries = [e for (e,) in con.execute("SELECT entry FROM handed_to")]
            entries += [e for (e,) in con.execute("SELECT group_id FROM requeued")]
        entry_group = lambda e: e.rsplit("/", 1)[0] if e.rsplit("/", 1)[-1].isdigit() else e  # noqa: E731
        skipped = handed - settled - len({entry_group(e) for e in entries})
    dropped = sum(int(e.get("count", 1))
                  for e in log_events(role_log(run_dir, "experience_buffer", "0"), "off_lineage_groups_dropped"))
    return {"trainer_restarts": max(0, int(lin["epoch"]) - 1),
            "lineage_forks": {str(k): v for k, v in forks.items()},
            "lineage_violations": sum(x["samples"] for x in violations),
            "lineage_violation_examples": violations[:10],
            "trained_members_checked": checked, "trained_members_unlabelled": unlabelled,
            "lineage_dropped": dropped, "prompts_skipped": skipped, "negative_staleness_samples": negative,
            "buffer_refusals": refusals}
