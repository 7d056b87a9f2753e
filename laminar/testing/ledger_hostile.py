"""The ledger of the compromised-host scenario: what was trained, told apart by who was handed it.

    rec = read_records(run_dir)                       # after the run, from the components' own records
    out = hostile_ledger(rec, hostile={"3a", "3b"})   # honest_lost, honest_trained_twice, hostile_samples_trained...
    out |= hostile_alarms(watch_lines, {"h3", "h2"})  # /healthz alarms naming a compromised host

Who was handed what comes from the prompt pool's own audit trail (its `handed_out` log lines: the
trajectory ids of each TakeBatch and the rollout that took them); what was trained from the
trainer's (`members` in metrics.jsonl: trajectory id, rollout and run of every sample of every
kept version, written with `logging.record_members`). Neither is what the hostile keys wrote, and neither
is the hand-out MAC the pools check: the ledger does not trust the mechanism it audits.

Definitions (docs/faults.md, "The compromised-host scenario"):
- a trajectory's *origin* is the rollout the prompt pool handed its id to (a manager's restart of
  an orphan, `~r<n>`, keeps its original id's origin); the *hostile* rollouts are those whose keys
  the compromised host holds;
- a trained sample is *beyond the hostile host's hand-outs* (`hostile_samples_trained`) when its
  id was never handed out, when a hostile rollout wrote it but it was handed to an honest one, or
  when it names weights of a run that is not the trainer's (a replayed version). A sample handed
  to a hostile rollout, of the trainer's run (or of none: the model folder's own weights, before
  any version), is its own to store with any tokens and rewards:
  counted apart (`hostile_handed_trained`). The hostile rollouts never report to the manager, so
  it grants them nothing: an honest hand-out under a hostile rollout id was taken, not given;
- an *honest* member is a (group, sample index) slot some id of which was handed to an honest
  rollout; its group is an honest group. A slot is *lost* (`honest_lost`) when, at the end, it was
  not trained in a kept version by an allowed writer, its group was trained without it, and it is
  in none of the places that still account for it: its group removed by the buffer's policy or
  handed to a trainer (`gone`: the other checks look at those), held in the buffer, in flight or
  awaiting a score in the partial pool under an owner allowed to write it, or open in the prompt
  pool (outstanding or requeued). `honest_trained_twice` counts honest groups trained in two kept
  versions, or with one slot trained twice.
"""
from __future__ import annotations

import json
import re
import sqlite3
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from laminar.testing.ledger import group_of, log_events, member_of


@dataclass
class Records:
    """What the components recorded, as the ledger needs it."""
    handed: dict[str, str]                  # trajectory id -> the rollout the prompt pool handed it to
    trained: list[dict]                     # metrics.jsonl records of kept versions (group_ids, members)
    runs: set[str] = field(default_factory=set)        # the trainer's run id(s)
    gone: set[str] = field(default_factory=set)        # group ids the buffer removed (handed, dropped)
    buffered: set[str] = field(default_factory=set)    # trajectory ids the buffer holds
    partial: dict[str, str] = field(default_factory=dict)  # trajectory id -> owner, in flight or awaiting
    open: set[str] = field(default_factory=set)        # prompt pool entries outstanding or requeued


def origin_id(tid: str) -> str:
    """The id the prompt pool handed out: without the manager's restart suffixes (`~r<n>`)."""
    return re.sub(r"(~r[0-9]+)+$", "", tid)


def read_records(run_dir: str | Path) -> Records:
    """After the run (cluster stopped): the records `hostile_ledger` reads."""
    run_dir = Path(run_dir)
    handed = {t: str(e["rollout"]) for e in log_events(run_dir / "logs" / "prompt_pool.0.log", "handed_out")
              for t in e.get("trajectories", [])}
    m = run_dir / "trainer" / "metrics.jsonl"
    trained = [json.loads(x) for x in m.read_text().splitlines() if x.strip()] if m.exists() else []
    runs = {str(e["run_id"]) for e in log_events(run_dir / "logs" / "trainer.0.log", "lineage") if e.get("run_id")}
    rec = Records(handed, trained, runs)
    pools = run_dir / "pools"
    if (db := pools / "experience_buffer-0.sqlite").exists():
        with sqlite3.connect(db) as con:
            rec.gone = {g for (g,) in con.execute("SELECT gid FROM gone")}
            rec.buffered = {t for (t,) in con.execute("SELECT tid FROM trajs")}
    if (db := pools / "partial_pool-0.sqlite").exists():
        rec.partial = _partials(db)
    if (db := pools / "prompt_pool-0.sqlite").exists():
        with sqlite3.connect(db) as con:
            rec.open = {e for (e,) in con.execute("SELECT entry FROM handed_to")}
            rec.open |= {g for (g,) in con.execute("SELECT group_id FROM requeued")}
    return rec


def _partials(db: Path) -> dict[str, str]:
    """Trajectory id -> owner of what the partial pool still holds (in flight or awaiting scores)."""
    from laminar.roles.sqlite_store import unpack
    with sqlite3.connect(db) as con:
        done = {t for (t,) in con.execute("SELECT tid FROM completed")}
        out = {t: o for t, o in con.execute("SELECT tid, owner FROM deltas") if t not in done}
        for owner, blob in con.execute("SELECT owner, blob FROM chunks"):
            out.update({t: owner for t in unpack(blob).trajectory_ids if t not in done})
        out.update({t: o for t, o in con.execute("SELECT tid, owner FROM owners") if t not in done})  # taken over
        out.update({t: unpack(blob).rollout_id for t, blob in con.execute("SELECT tid, blob FROM awaiting")})
    return out


def beyond_handout(tid: str, rollout: str, run: str, rec: Records, hostile: set[str]) -> str:
    """Why a trained sample is beyond the hostile host's hand-outs ("" when it is not)."""
    origin = rec.handed.get(origin_id(tid))
    if origin is None:
        return "never handed out"
    if rollout in hostile and origin not in hostile:
        return f"handed to rollout {origin}, written by {rollout}"
    if rec.runs and run and run not in rec.runs:  # "": the model folder's own weights, before any version
        return f"generated by weights of run {run!r}, not the trainer's"
    return ""


def hostile_ledger(rec: Records, hostile: set[str]) -> dict:
    """The scenario's counts (module docstring): all of honest_lost, honest_trained_twice and
    hostile_samples_trained must be 0; `members_unrecorded` must be 0 for them to mean anything."""
    beyond, own, unrecorded = [], 0, 0
    slots: Counter = Counter()   # member slot -> times trained by an allowed writer
    for r in rec.trained:
        if "members" not in r:
            unrecorded += int(r.get("samples", 0))
            continue
        for tid, rollout, run in r["members"]:
            why = beyond_handout(tid, rollout, run, rec, hostile)
            if why:
                beyond.append({"trajectory": tid, "rollout": rollout, "version": r.get("version"), "why": why})
                continue
            own += rec.handed[origin_id(tid)] in hostile
            slots[member_of(tid)] += 1
    groups = Counter(g for r in rec.trained for g in r.get("group_ids", []))
    honest = {member_of(t) for t, r in rec.handed.items() if r not in hostile}
    honest_groups = {group_of(s) for s in honest}
    twice = {g for g in honest_groups if groups[g] > 1} | {group_of(s) for s in honest if slots[s] > 1}
    held = {member_of(t) for t in rec.buffered}
    held |= {member_of(t) for t, owner in rec.partial.items()
             if owner not in hostile or rec.handed.get(origin_id(t)) in hostile}
    lost = sorted(s for s in honest if not _accounted(s, slots, groups, held, rec))
    return {"honest_groups": len(honest_groups), "honest_members": len(honest), "honest_lost": len(lost),
            "honest_lost_examples": lost[:10], "honest_trained_twice": len(twice),
            "honest_trained_twice_examples": sorted(twice)[:10],
            "hostile_samples_trained": len(beyond), "hostile_trained_examples": beyond[:10],
            "hostile_handed_trained": own,
            "hostile_handed_out": sum(1 for r in rec.handed.values() if r in hostile),
            "members_unrecorded": unrecorded}


def _accounted(slot: str, slots: Counter, groups: Counter, held: set[str], rec: Records) -> bool:
    g = group_of(slot)
    if slots[slot]:
        return True                  # trained, by a writer allowed to
    if groups[g]:
        return False                 # its group was trained without it
    return g in rec.gone or slot in held or g in rec.open or slot in rec.open


ALARM = re.compile(r"^(\w+) \(([^:]+):.* from (\S+) on host (\S+),")


def hostile_alarms(watch_lines: list[dict], hosts: set[str]) -> dict:
    """The /healthz alarms (laminar/testing/healthz_watch.py lines) that name a compromised host,
    counted once per (alarm, role, key, hosts)."""
    seen: dict[tuple, str] = {}
    for line in watch_lines:
        for a in line.get("alarms", []):
            m = ALARM.match(a)
            if m and set(m.group(4).split(",")) & hosts:
                seen.setdefault(m.groups(), a)
    return {"hostile_alarms": len(seen), "hostile_alarm_examples": list(seen.values())[:10]}


REFUSALS = ("write_refused", "request_refused", "link_refused", "offer_refused", "weight_run_refused",
            "scores_refused", "publish_refused")


def refusals_logged(run_dir: str | Path) -> dict[str, int]:
    """Every refusal the roles logged, by event (whoever caused it)."""
    out: Counter = Counter()
    for log in sorted((Path(run_dir) / "logs").glob("*.log*")):
        for line in log.read_text(errors="replace").splitlines():
            if "_refused" in line:
                try:
                    out[json.loads(line).get("event")] += 1
                except ValueError:
                    continue
    return {k: out[k] for k in REFUSALS if out[k]}
