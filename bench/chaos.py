"""Chaos run (docs/architecture.md §10): random faults on a four-host namespace cluster, then the ledger check.

    python bench/chaos.py [--minutes 10] [--every 8] [--seed 0] [--out runs/bench/chaos.json]   (root)

The cluster is laminar/testing/multihost.py's: h0 (broker, manager, pools, trainer on the tiny
model), h1..h3 (a relay and two `sim` rollouts each), every host under `laminar-node start`.
Every `--every` seconds one fault, drawn at random: SIGKILL of a random role (any kind, on any
host; its supervisor restarts it), a whole host killed and restarted after `--host-down-s`, a
host's link cut for `--link-down-s` then restored, the master relay stopped (SIGSTOP) past the
cluster's `dead_after_s` and continued (`master_stop`), every relay stopped for `--stall-s` so no
weights move (`stall`: the manager must raise `weights_stalled`, with K = `--stall-lag` and T =
`--stall-after-s`, and clear it once they move again), the trainer restarted on an older
checkpoint folder (`old_checkpoint`: its newest checkpoint is moved aside, so its lineage goes
down), a reward replica killed (`reward`), or the manager killed inside a repack move, after the
source gave its work up (MigrateOut) and before the destination took it (MigrateIn)
(`migrate_window`: the failpoint `manager.after_migrate_out` is armed, laminar/failpoints.py, and
fires at the next move within `--migrate-window-s`; a fault with no move in that time is counted
as not fired, `migrate_window_fired` says how many did). With `migrate_window` in the deck the
manager's batch bound is `--migrate-batch-bound` (16) rather than the rollouts' max_concurrency
(8): at 8 a replica at its bound is never a repack candidate and no move ever happens here.
With `reward` among the kinds (the default), every trajectory's reward has a model term: the
rollouts' rewards are the rule (weight 1 - w) plus a `classifier` scorer `rm` (weight w =
`--reward-weight`; the tiny score-head model, untrained: its values do not matter here) served
by a `reward` replica on h1 and h2 with leases of `--reward-lease-s`; a killed replica's leases
expire and the other one (or its restart) scores
the work, and the ledger's `trained_unscored` counts trained samples that lacked that score.
After the faults the cluster runs `--drain-s` without any; a group with a member stored before the
drain that is still incomplete in the buffer after it is stranded
(`incomplete_groups_after_drain`, 0 required). Kinds are drawn from a shuffled deck (every kind
once per round), so a run of a round or more kills the trainer. A fault counts as recovered when
the trainer publishes a newer version and the faulted role/host is running again within `--recover-s`.

The trainer checkpoints every `--checkpoint-every` versions (4): a trainer kill discards the
versions it published since its checkpoint, so relays, rollouts and the buffer must move to the
resumed trainer's new lineage (docs/weights.md). The buffer holds at most `--buffer-capacity`
trajectories with `eviction: reject` for the whole run, so it is full for much of it: rollouts
are refused and must retry (`buffer_refusals` counts the refusals their logs report); 0 keeps
the harness's large drop_oldest buffer.

At the end the cluster stops and the ledger is checked (MultiHost.ledger: trainer versions, groups
trained, every stored trajectory, what the manager recovered, what the partial pool still holds),
and three more (MultiHost.checks): lineage (every trained sample's (lineage, version), as the
trainer recorded it, names weights the trainer published in the history of the lineage that
trained it: `lineage_violations`), prompts (the prompt pool's own `prompts_skipped`, from its store, as its
heartbeat counts it) and staleness (samples with negative staleness in metrics.jsonl's
histogram: `negative_staleness_samples`). Printed: the
table of faults with time to the next version, the chain repairs (the paper's target: < 1 s),
and the ledger. Recovery is compared with the paper's figures (fault_recovery_s in paper.json)
only as a reference: these are processes on one machine, not machines being replaced.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import chaos_hostile  # noqa: E402
from _common import exit_on_signals, percentile, print_table, write_json  # noqa: E402

KINDS = ["rollout", "relay", "prompt_pool", "partial_pool", "experience_buffer", "manager", "trainer", "broker",
         "host", "link", "master_stop", "stall", "old_checkpoint", "reward", "migrate_window"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--every", type=float, default=8.0, help="seconds between faults")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--host-down-s", type=float, default=5.0)
    ap.add_argument("--link-down-s", type=float, default=6.0)
    ap.add_argument("--recover-s", type=float, default=120.0)
    ap.add_argument("--checkpoint-every", type=int, default=4, help="the trainer's checkpoint period (versions)")
    ap.add_argument("--buffer-capacity", type=int, default=48,
                    help="buffer capacity (trajectories) with eviction: reject; 0: the harness's default buffer")
    ap.add_argument("--stall-s", type=float, default=24.0, help="a `stall` fault: every relay stopped this long")
    ap.add_argument("--migrate-window-s", type=float, default=30.0,
                    help="a `migrate_window` fault: how long the armed failpoint waits for a repack move")
    ap.add_argument("--migrate-batch-bound", type=int, default=16,
                    help="with `migrate_window` in the deck: the manager's batch_bound B (the harness's is 8, "
                         "its rollouts' max_concurrency), so two draining replicas of one version can be "
                         "packed into one and repack moves happen at all (0: keep the harness's)")
    ap.add_argument("--migrate-max-tokens", type=int, default=1024,
                    help="with `migrate_window`: the sim rollouts' response cap (the harness's 256 cuts every "
                         "response of the 7B_math lengths at once: no tail, no draining batch, no move)")
    ap.add_argument("--migrate-speedup", type=float, default=4.0,
                    help="with `migrate_window`: the sim rollouts' time compression (the longer responses "
                         "then take about as long as the harness's)")
    ap.add_argument("--stall-after-s", type=float, default=6.0, help="the manager's stall_after_s (T) for the run")
    ap.add_argument("--stall-lag", type=int, default=2, help="the manager's stall_lag_versions (K) for the run")
    ap.add_argument("--drain-s", type=float, default=60.0, help="after the faults: seconds without faults before "
                    "the cluster stops; a group with a member stored before it and still incomplete after it counts "
                    "in incomplete_groups_after_drain")
    ap.add_argument("--reward-weight", type=float, default=0.1, help="weight of the model term (kind `reward`)")
    ap.add_argument("--reward-lease-s", type=float, default=5.0, help="the reward replicas' lease (kind `reward`)")
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated fault kinds to draw from (default: all; "
                    "empty with --hostile: no faults)")
    ap.add_argument("--hostile", action="store_true", help="the compromised-host scenario (bench/chaos_hostile.py): "
                    "scoped keys, h3's rollout keys and h2's reward key driven by hostile scripts while the faults "
                    "go on")
    ap.add_argument("--hostile-period", type=float, default=3.0, help="seconds between the attackers' rounds")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if unknown := set(a.kinds.split(",")) - set(KINDS) - {""}:
        ap.error(f"--kinds: unknown {sorted(unknown)}; known: {', '.join(KINDS)}")
    exit_on_signals()  # SIGTERM (e.g. `timeout`) unwinds the `with MultiHost`: hosts, namespaces, /dev/shm
    if os.geteuid() != 0:
        raise SystemExit("bench/chaos.py needs root (network namespaces)")
    from laminar.models.tiny import build_tiny_model
    from laminar.testing.multihost import SIM_ROLLOUT, MultiHost, log_events

    rng = random.Random(a.seed)
    tmp = Path(tempfile.mkdtemp(prefix="laminar-chaos-"))
    model = build_tiny_model(tmp / "tiny")
    faults = []
    roles = {"trainer": {"checkpoint": {"every": a.checkpoint_every}},
             "manager": {"stall_lag_versions": a.stall_lag, "stall_after_s": a.stall_after_s}}
    if "migrate_window" in a.kinds.split(","):
        if a.migrate_batch_bound:
            roles["manager"]["batch_bound"] = a.migrate_batch_bound  # room for repack moves: see --help
        roles.setdefault("rollout", {})["sim"] = {**SIM_ROLLOUT["sim"], "max_output_tokens": a.migrate_max_tokens,
                                                  "speedup": a.migrate_speedup}  # a long tail: batches that drain
    if a.buffer_capacity:
        roles["experience_buffer"] = {"capacity": a.buffer_capacity, "eviction": "reject"}
    reward_hosts = reward_setup(roles, tmp, a) if "reward" in a.kinds.split(",") or a.hostile else ()
    hostile_args = chaos_hostile.cluster_args(roles) if a.hostile else {}
    deck: list[str] = []
    kinds = [k for k in a.kinds.split(",") if k]
    with MultiHost(tmp, model, rollout_hosts=3, iterations=100000, roles=roles, reward_hosts=reward_hosts,
                   **hostile_args) as mh:
        mh.start_all()
        mh.wait_version(2, 300)
        hostile = chaos_hostile.start(mh, model, 60 * a.minutes, a.hostile_period) if a.hostile else None
        start_version, t_end = mh.version(), time.monotonic() + 60 * a.minutes
        print(f"cluster up at version {start_version}; injecting faults for {a.minutes} min"
              + (" with hostile hosts h3 (rollouts) and h2 (reward)" if hostile else ""), flush=True)
        while time.monotonic() < t_end:
            if not kinds:  # no faults: only the attackers (--hostile)
                time.sleep(min(5.0, max(0.0, t_end - time.monotonic())))
                continue
            if not deck:
                deck = rng.sample(kinds, len(kinds))
            kind = deck.pop()
            v0, t0, at = mh.version(), time.monotonic(), time.time()
            what, back = inject(mh, kind, rng, a)
            recovered = False
            try:
                mh.wait_version(v0 + 1, a.recover_s)
                deadline = time.monotonic() + a.recover_s
                while not back() and time.monotonic() < deadline:
                    time.sleep(0.5)  # polling for the supervisor's restart
                recovered = back()
            except TimeoutError:
                pass
            took = time.monotonic() - t0
            faults.append({"fault": what, "at_version": v0, "recovered": recovered, "next_version_s": round(took, 2),
                           "at": at, "kind": kind})
            print(f"[{time.strftime('%H:%M:%S')}] {what:<26} v{v0}: {'recovered' if recovered else 'NOT RECOVERED'} "
                  f"in {took:.1f}s", flush=True)
            time.sleep(max(0.0, a.every - took))  # the chaos schedule's period
        end_version = mh.version()
        if hostile:
            chaos_hostile.stop_attackers(hostile)
        drain_from = time.time()
        print(f"[{time.strftime('%H:%M:%S')}] faults over: draining for {a.drain_s:.0f}s", flush=True)
        time.sleep(a.drain_s)  # the drain: the cluster runs on without faults
        mh.close()
        if hostile:
            chaos_hostile.stop_monitor(hostile)
        ledger = mh.ledger()
        extra = mh.checks()
        incomplete = mh.incomplete_groups(drain_from)
        alarms = mh.stall_alarms()
        stall_alarm_per_fault(faults, alarms)
        repairs = log_events(mh.log("manager", "0"), "chain_repaired")
        dead = log_events(mh.log("manager", "0"), "rollout_dead")
        split_timings(mh, faults, a)
    print_table(f"chaos: {len(faults)} faults in {a.minutes} min",
                ["fault", "at version", "recovered", "s to next version", "detect", "chain repaired", "resumed",
                 "rejoined"],
                [[f["fault"], f["at_version"], f["recovered"], f["next_version_s"],
                  *("-" if f.get(k) is None else f[k] for k in PHASES)] for f in faults])
    # A repair re-links the live relays; when every relay is gone (the `stall` fault stops them all)
    # there is nothing to re-link and the removal's time is RPC deadlines to stopped peers: counted
    # apart, not as a repair against the paper's < 1 s.
    rep = [r["repair_s"] for r in repairs if r.get("order")]
    emptied = [r["repair_s"] for r in repairs if not r.get("order")]
    print_table("chain repairs", ["count", "p50 s", "max s"], [[len(rep), percentile(rep, 50) if rep else 0.0,
                                                                 max(rep) if rep else 0.0]])
    phases = {k: [f[k] for f in faults if f.get(k) is not None] for k in PHASES}
    print_table("recovery phases, seconds from the fault (paper, reference only: chain repair < 1 s, a full machine "
                "replacement 252 s)", ["phase", "faults", "p50", "max"],
                [[k, len(v), percentile(v, 50) if v else "-", max(v) if v else "-"] for k, v in phases.items()])
    print("\nledger: " + json.dumps(ledger | {"versions": f"{ledger['versions'][0]}..{ledger['versions'][-1]}"
                                               if ledger["versions"] else "-"}))
    print_table("lineage, prompts, staleness", list(CHECKS), [[extra[k] for k in CHECKS]])
    rewards = reward_counts(mh) if reward_hosts else None
    if rewards:
        print_table("model-scored rewards", ["reward kills", "batches scored", "trajectories scored", "late scores",
                                             "trained unscored", "trained with fallback"],
                    [[sum(f["kind"] == "reward" for f in faults), rewards["batches"], rewards["trajectories_scored"],
                      rewards["scores_refused_late"], ledger["trained_unscored"], ledger["trained_with_fallback"]]])
    stalls = [f for f in faults if f["kind"] == "stall"]
    print_table("weights_stalled alarm", ["raised", "cleared", "stall faults", "raised in them", "cleared after them",
                                          "incomplete groups after drain"],
                [[len(alarms["raised"]), len(alarms["cleared"]), len(stalls),
                  sum(bool(f.get("stall_raised")) for f in stalls), sum(bool(f.get("stall_cleared")) for f in stalls),
                  incomplete["incomplete_groups_after_drain"]]])
    for v in extra["lineage_violation_examples"]:
        print("lineage violation: " + json.dumps(v))
    hostile_keys = chaos_hostile.report(mh, hostile) if hostile else {}
    if hostile:
        chaos_hostile.print_report(hostile_keys)
    write_json(a.out, {
        "bench": "chaos", "minutes": a.minutes, "faults": faults,
        "faults_injected": len(faults), "faults_recovered": sum(f["recovered"] for f in faults),
        "trajectories_lost": ledger["trajectories_lost"], "samples_trained_twice": ledger["samples_trained_twice"],
        "trained_unscored": ledger["trained_unscored"], "trained_with_fallback": ledger["trained_with_fallback"],
        "reward_kills": sum(f["kind"] == "reward" for f in faults), "reward": rewards,
        "stored_twice": ledger["stored_twice"], "versions_monotone": ledger["versions_monotone"],
        "chain_repair_s_max": max(rep) if rep else None, "chain_repairs": len(rep), "chain_emptied": len(emptied),
        "rollouts_declared_dead": len(dead),
        "recovery_s": {k: {"n": len(v), "p50": percentile(v, 50) if v else None, "max": max(v) if v else None}
                       for k, v in phases.items()},
        "groups_handed_untrained": ledger["groups_handed_untrained"],
        "iterations_during_run": end_version - start_version,
        "ledger": {k: v for k, v in ledger.items() if k != "versions"},
        **extra, "trainer_kills": sum(f["kind"] == "trainer" for f in faults),
        "older_checkpoint_restores": sum(f["kind"] == "old_checkpoint" for f in faults),
        "migrate_window_faults": sum(f["kind"] == "migrate_window" for f in faults),
        "migrate_window_fired": sum(f["fault"] == "kill manager mid-move" for f in faults),
        **incomplete, "weights_stalled_raised": len(alarms["raised"]),
        "weights_stalled_cleared": len(alarms["cleared"]),
        "weights_stalled_at_end": len(alarms["raised"]) > len(alarms["cleared"]),
        "stall_faults": len(stalls), "stall_faults_raised": sum(bool(f.get("stall_raised")) for f in stalls),
        "stall_faults_cleared": sum(bool(f.get("stall_cleared")) for f in stalls), "drain_s": a.drain_s,
        "checkpoint_every": a.checkpoint_every, "buffer_capacity": a.buffer_capacity or None,
        **hostile_keys, "runs": str(tmp)})
    return 0


PHASES = ["detect_s", "chain_repaired_s", "resumed_s", "rejoined_s"]
CHECKS = ["trainer_restarts", "lineage_violations", "trained_members_checked", "trained_members_unlabelled",
          "lineage_dropped", "prompts_skipped", "negative_staleness_samples", "buffer_refusals"]


def reward_setup(roles: dict, tmp: Path, a) -> tuple[int, ...]:
    """The model term of the `reward` kind: an untrained tiny classifier `rm` served on h1 and h2."""
    from laminar.tasks.reward_model import build_tiny_classifier
    rm = build_tiny_classifier(tmp / "rm")
    roles["reward"] = {"scorer": "rm", "backend": "classifier", "batch_size": 16, "lease_s": a.reward_lease_s,
                       "classifier": {"model_dir": str(rm), "sigmoid": True, "threads": 1, "max_batch_tokens": 4096}}
    # a lease no replica scores is shared after twice the replicas' own lease (a killed replica's, a sitter's)
    roles.setdefault("partial_pool", {})["lease_shared_after_s"] = 2 * a.reward_lease_s
    roles.setdefault("rollout", {})["rewards"] = [
        {"fn": "laminar.tasks.rewards:upper_fraction", "weight": 1 - a.reward_weight},
        {"role": "rm", "weight": a.reward_weight}]
    return (1, 2)


def reward_counts(mh) -> dict:
    """What the reward side did, from the logs: batches scored, scores refused as late, leases
    that expired (a killed replica's work handed to another)."""
    from laminar.testing.multihost import log_events
    scored = [e for r in mh.reward_ids() for e in log_events(mh.log("reward", r), "rewards_scored")]
    refused = sum(int(e.get("count", 0)) for e in log_events(mh.log("partial_pool", "0"), "scores_refused"))
    return {"batches": len(scored), "trajectories_scored": sum(int(e["trajectories"]) for e in scored),
            "scores_refused_late": refused}


def split_timings(mh, faults: list[dict], a) -> None:
    """Per fault, from the roles' own logs (seconds after the fault was injected): `detect_s` the
    manager declared a rollout dead or lost a relay, `chain_repaired_s` the chain was re-linked
    (the manager's chain_repaired, or master_changed when the master relay's host went), `resumed_s`
    the first trajectory the manager recovered in this fault's window was stored, `rejoined_s` (a
    host fault) the host's relay made a version visible again after the host restarted."""
    from laminar.testing.multihost import log_events

    def ts(e: dict) -> float:
        return datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()

    man = mh.log("manager", "0")
    detect = sorted(ts(e) for name in ("rollout_dead", "relay_silent", "downstream_lost", "chain_repaired",
                                       "master_changed")
                    for e in log_events(man, name))
    repaired = sorted(ts(e) for name in ("chain_repaired", "master_changed") for e in log_events(man, name))
    recovering = [(ts(e), set(e["ids"])) for e in log_events(man, "recovering")]
    stored_at: dict[str, float] = {}
    for log in (mh.run_dir / "logs").glob("rollout.*.log"):
        for e in log_events(log, "trajectory_stored"):
            t = e["trajectory"].split("~r")[0]
            stored_at[t] = min(stored_at.get(t, float("inf")), ts(e))
    ends = [f["at"] for f in faults[1:]] + [float("inf")]
    for f, end in zip(faults, ends, strict=False):
        t0 = f["at"]
        first = lambda xs, t0=t0, end=end: next((x - t0 for x in xs if t0 <= x < end), None)  # noqa: E731
        f["detect_s"] = first(detect) if f["kind"] in ("rollout", "relay", "host", "link") else None
        f["chain_repaired_s"] = first(repaired) if f["kind"] in ("relay", "host", "link") else None
        ids = set().union(*[i for t, i in recovering if t0 <= t < end]) if recovering else set()
        done = sorted(stored_at[t.split("~r")[0]] for t in ids if t.split("~r")[0] in stored_at)
        f["resumed_s"] = round(done[0] - t0, 3) if done else None
        f["rejoined_s"] = None
        if f["kind"] == "host":
            h = f["fault"].split()[1][1:]
            back = t0 + a.host_down_s
            vis = sorted(ts(e) for e in log_events(mh.log("relay", f"r{h}"), "version_visible") if ts(e) >= back)
            f["rejoined_s"] = round(vis[0] - t0, 3) if vis else None  # (may be after the next fault)
        for k in ("detect_s", "chain_repaired_s"):
            f[k] = round(f[k], 3) if f[k] is not None else None


def stall_alarm_per_fault(faults: list[dict], alarms: dict) -> None:
    """Per `stall` fault: whether the manager raised weights_stalled in its window (from the fault
    to the next one) and cleared it after the raise."""
    ends = [f["at"] for f in faults[1:]] + [float("inf")]
    for f, end in zip(faults, ends, strict=False):
        if f["kind"] != "stall":
            continue
        up = [t for t in alarms["raised"] if f["at"] <= t < end]
        f["stall_raised"] = bool(up)
        f["stall_cleared"] = bool(up) and any(t >= up[0] for t in alarms["cleared"])


def inject(mh, kind: str, rng: random.Random, a) -> tuple[str, callable]:
    """Inject one fault; returns its description and a predicate 'the faulted part is back'."""
    if kind == "master_stop":  # a hung master relay: stopped past dead_after_s, then continued
        rid = mh.master_relay()
        try:
            mh.pause_role("relay", rid, 2 * 3.0 + 1)  # the harness's dead_after_s is 3 s
        except RuntimeError:
            pass
        return f"stop master relay.{rid}", lambda: mh.role_pid("relay", rid) is not None
    if kind == "stall":  # every relay hung: no weights move; the manager must raise weights_stalled
        relays = [("relay", f"r{h}") for h in range(1, mh.initial)]
        try:  # a trainer that is training: a stall of a stopped trainer is no stall of the weights
            mh.wait_version(mh.version() + 1, a.recover_s)
        except TimeoutError:
            pass
        t0 = time.time()
        mh.pause_roles(relays, a.stall_s)

        def back() -> bool:
            al = mh.stall_alarms()
            up = [t for t in al["raised"] if t >= t0]
            return all(mh.role_pid(*r) for r in relays) and (not up or any(t >= up[0] for t in al["cleared"]))
        return f"stall all relays {a.stall_s:.0f}s", back
    if kind == "migrate_window":  # the manager dies inside a repack move (laminar/failpoints.py)
        fired = mh.arm_failpoint("manager.after_migrate_out", a.migrate_window_s)
        what = "kill manager mid-move" if fired else f"no move in {a.migrate_window_s:.0f}s"
        return what, lambda: mh.role_pid("manager", "0") is not None
    if kind == "old_checkpoint":  # the trainer restored from an older checkpoint folder
        try:
            moved = mh.restart_trainer_on_older_checkpoint()
        except RuntimeError:
            moved = None
        return f"trainer on older ckpt ({moved or 'none'})", lambda: mh.role_pid("trainer", "0") is not None
    if kind == "host":
        h = rng.randrange(1, mh.initial)
        mh.kill_host(h)
        time.sleep(a.host_down_s)  # the host's down time (part of the fault)
        mh.start_host(h)
        return f"host h{h} down {a.host_down_s:.0f}s", lambda: all(mh.role_pid("rollout", r)
                                                                   for r in mh.live_rollout_ids(h))
    if kind == "link":
        h = rng.randrange(1, mh.initial)
        mh.net.set_link(h, False)
        time.sleep(a.link_down_s)  # the partition's length (part of the fault)
        mh.net.set_link(h, True)
        return f"link h{h} cut {a.link_down_s:.0f}s", lambda: True
    if kind == "rollout":
        rid = rng.choice([r for h in range(1, mh.initial) for r in mh.live_rollout_ids(h)])
    elif kind == "relay":
        rid = f"r{rng.randrange(1, mh.initial)}"
    elif kind == "reward":
        rid = rng.choice(mh.reward_ids())
    else:
        rid = "0"
    try:
        mh.kill_role(kind, rid)
    except RuntimeError:  # between its death and its restart: count what we asked for anyway
        pass
    return f"kill {kind}.{rid}", lambda: mh.role_pid(kind, rid) is not None


if __name__ == "__main__":
    sys.exit(main())
