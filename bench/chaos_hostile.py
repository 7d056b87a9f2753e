"""The compromised-host part of the chaos run (`python bench/chaos.py --hostile`): docs/faults.md,
"The compromised-host scenario".

The cluster runs with scoped keys, one key folder per host holding only that host's keys
(laminar/testing/host_keys.py). Host h3 is compromised as a rollout host: its rollout processes are
the attacker's (they never run honestly; the config still places rollouts 3a and 3b there, so the
pools know their host), and a script holding h3's folder (`rollout.3a`, `rollout.3b`, `relay.r3`,
`node`, the cluster secret and the public weights key) attacks from h3's namespace; its relay r3
runs as usual. Host h2 is compromised as a reward host: beside its real replica `rm2`, a script
holding h2's folder (`reward.rm`, ...) attacks the reward plane. What each script does is in
laminar/testing/hostile_host.py; a version of an earlier run, sealed by the cluster's own weights
key, is recorded first for the replay. A monitor polls h0's /healthz for alarms.

After the run, besides the chaos ledger: laminar/testing/ledger_hostile.py's counts (honest_lost,
honest_trained_twice, hostile_samples_trained: all 0 required; hostile_handed_trained apart),
hostile_alarms (/healthz alarms naming h3 or h2: at least one required), the refusals the roles
logged, and per attack what the attackers sent and what the cluster let through.
"""
from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

HOSTILE_HOST, REWARD_HOST = 3, 2
HOSTILE_ROLLOUTS = ("3a", "3b")
METRICS_PORT = 7900


@dataclass
class Hostile:
    """The scenario's processes and files."""
    seconds: float
    period: float
    procs: list[subprocess.Popen] = field(default_factory=list)
    files: dict[str, Path] = field(default_factory=dict)


def cluster_args(roles: dict) -> dict:
    """MultiHost's arguments for the scenario (and the trainer's record of who wrote each sample)."""
    roles.setdefault("trainer", {}).setdefault("logging", {})["record_members"] = True
    return {"scoped": True, "idle_rollouts": HOSTILE_ROLLOUTS, "metrics_port": METRICS_PORT}


def start(mh, model_dir: Path, seconds: float, period: float) -> Hostile:
    """Record the old run's version, then start both attackers and the /healthz monitor."""
    from laminar.testing.hostile_host import record_old_run
    h = Hostile(seconds, period)
    h.files = {k: mh.tmp / f"{k}.jsonl" for k in ("rollout_attacker", "reward_attacker", "healthz")}
    recorded = record_old_run(mh.tmp / "keys", model_dir, mh.tmp / "old-run.manifest")
    run = [sys.executable, "-m", "laminar.testing.hostile_host"]
    log = open(mh.tmp / "attackers.out", "a")
    h.procs.append(mh.net.popen(HOSTILE_HOST, [
        *run, str(mh.configs[HOSTILE_HOST]), "--keys", str(mh.key_folders[f"h{HOSTILE_HOST}"]),
        "--rollouts", ",".join(HOSTILE_ROLLOUTS), "--recorded", str(recorded), "--seconds", str(seconds),
        "--period", str(period), "--out", str(h.files["rollout_attacker"])], stdout=log, stderr=subprocess.STDOUT))
    h.procs.append(mh.net.popen(REWARD_HOST, [
        *run, str(mh.configs[REWARD_HOST]), "--keys", str(mh.key_folders[f"h{REWARD_HOST}"]), "--scorer", "rm",
        "--seconds", str(seconds), "--period", str(period), "--out", str(h.files["reward_attacker"])],
        stdout=log, stderr=subprocess.STDOUT))
    h.procs.append(mh.net.popen(0, [
        sys.executable, "-m", "laminar.testing.healthz_watch", f"http://{mh.net.address(0)}:{METRICS_PORT}/healthz",
        "--seconds", str(seconds + 600), "--every", "5", "--out", str(h.files["healthz"])],
        stdout=log, stderr=subprocess.STDOUT))
    return h


def stop_attackers(h: Hostile) -> None:
    """End the attacks (SIGTERM: each finishes its round and closes)."""
    for p in h.procs[:2]:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in h.procs[:2]:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


def stop_monitor(h: Hostile) -> None:
    for p in h.procs[2:]:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def attacks(h: Hostile) -> dict[str, dict]:
    """Per attack: attempts, items sent, items the cluster let through."""
    out: dict[str, dict] = {}
    for k in ("rollout_attacker", "reward_attacker"):
        for r in _lines(h.files[k]):
            a = out.setdefault(r["attack"], {"attempts": 0, "sent": 0, "accepted": 0, "why": ""})
            a["attempts"] += 1
            a["sent"] += int(r["sent"])
            a["accepted"] += int(r["accepted"])
            a["why"] = a["why"] or r.get("why", "")
    return dict(sorted(out.items()))


def report(mh, h: Hostile) -> dict:
    """The scenario's JSON keys (module docstring)."""
    from laminar.testing.ledger_hostile import hostile_alarms, hostile_ledger, read_records, refusals_logged
    ledger = hostile_ledger(read_records(mh.run_dir), set(HOSTILE_ROLLOUTS))
    alarms = hostile_alarms(_lines(h.files["healthz"]), {f"h{HOSTILE_HOST}", f"h{REWARD_HOST}"})
    db = mh.run_dir / "pools" / "partial_pool-0.sqlite"
    with sqlite3.connect(db) as con:  # held back at the end (a sitter's leases, before they were shared)
        awaiting = con.execute("SELECT COUNT(*) FROM awaiting").fetchone()[0]
    return {**ledger, **alarms, "hostile_attacks": attacks(h), "refusals_logged": refusals_logged(mh.run_dir),
            "awaiting_scores_at_end": awaiting,
            "hostile_hosts": {"rollout": f"h{HOSTILE_HOST}", "reward": f"h{REWARD_HOST}"},
            "hostile_rollouts": list(HOSTILE_ROLLOUTS), "hostile_seconds": h.seconds}


def print_report(r: dict) -> None:
    from laminar.report import print_table
    print_table("hostile host: what the attackers sent and what got through",
                ["attack", "attempts", "items sent", "let through", "first answer"],
                [[k, v["attempts"], v["sent"], v["accepted"], v["why"][:70]] for k, v in r["hostile_attacks"].items()])
    keys = ["honest_groups", "honest_lost", "honest_trained_twice", "hostile_samples_trained",
            "hostile_handed_trained", "hostile_handed_out", "hostile_alarms", "members_unrecorded",
            "awaiting_scores_at_end"]
    print_table("hostile host: the ledger", keys, [[r[k] for k in keys]])
    for a in r["hostile_alarm_examples"]:
        print("alarm: " + a)
    for x in r["hostile_trained_examples"] + [{"lost": s} for s in r["honest_lost_examples"]]:
        print("VIOLATION: " + json.dumps(x))
    print("refusals logged: " + json.dumps(r["refusals_logged"]))
