"""Fault tolerance across hosts (docs/architecture.md §10): four network namespaces as hosts, kill
anything, lose nothing.

h0: broker, manager, pools, trainer (tiny model); h1..h3: a relay and two `sim` rollouts each,
every host under its own `laminar-node start --host hX`. One run, one failure after another, each
followed by two more trainer versions (training goes on):

  a rollout (SIGKILL)  ->  its in-flight work is recovered from the partial pool, it restarts
  a whole host (h3)    ->  chain repaired, its rollouts' work recovered; the host comes back and
                           its relay catches up to a newer version, its rollouts take batches
  the partial pool     ->  restarts from its store
  the manager          ->  restarts, rebuilds its view; relays re-join its chain
  the trainer          ->  resumes from its newest checkpoint (every 4 versions: up to 3 published
                           versions are discarded, and with them a lineage: relays, rollouts and
                           the buffer move to the resumed trainer's new one)
  the master relay     ->  a new master; the trainer is re-pointed
  a hung master relay  ->  SIGSTOP past dead_after_s, then SIGCONT: replaced, and back in the chain
  an older checkpoint  ->  the trainer restarts on its second newest checkpoint (its newest moved
                           aside): its lineage goes down, and training goes on
  the broker           ->  peers reconnect
  a cut link (h2, 6 s) ->  its rollouts are declared dead and their work resumed elsewhere; when
                           the link is back its relay re-joins the chain, duplicates are refused
  a new host (h4)      ->  joins the running cluster from a config the cluster was not started
                           with: its relay links into the chain, its rollouts take batches
  bad input            ->  garbage at every listening port of every host (request/reply ports,
                           the broker, relay data ports): training goes on

Relays retain 48 older versions and the manager's orphan_policy is `retained`: work whose version
no live rollout holds any more is adopted by a rollout that loads that version and resumes it.

At the end, from every component's own records (MultiHost.ledger and MultiHost.checks, the same
code bench/chaos.py reports with): versions are gap-free, no group was trained twice, every group
the buffer handed out was trained in a kept version (or is leased for a resumed trainer), every
trajectory the manager recovered was stored exactly once (or is still safe in the partial pool,
owned by a live rollout), and adopted ones were stored with their own (lineage, version). Lineage:
every trained sample's (lineage, version), as the trainer recorded it, names weights the trainer
published in the history of the lineage that trained it (work of the discarded versions was
dropped off-lineage by the buffer and its prompt requeued, as a new attempt). Prompts: every
group the prompt pool handed out is settled (trained or in the buffer), outstanding or requeued:
prompts_skipped == 0. No sample has a negative staleness.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.netns, pytest.mark.timeout(600),
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2")]

pytest.importorskip("torch")

from laminar.models.tiny import build_tiny_model  # noqa: E402
from laminar.testing.multihost import MultiHost, log_events  # noqa: E402

CHECKPOINT_EVERY = 4  # a trainer kill discards the versions published since its checkpoint


def test_kill_anything_lose_nothing(tmp_path):
    model = build_tiny_model(tmp_path / "tiny")
    steps = []
    # No iteration budget the trainer could use up: the test's last waits (the joined host's first
    # stores, two more versions) come after a variable share of the run, and a trainer that had
    # finished its max_iterations by then failed the test (once at version 80, after a slow join).
    with MultiHost(tmp_path, model, rollout_hosts=3, iterations=100_000, late_hosts=1,
                   roles={"trainer": {"checkpoint": {"every": CHECKPOINT_EVERY}}}) as mh:
        mh.start_all()
        mh.wait_version(2, 240)

        def after(what: str, fn) -> None:
            v = mh.version()
            t0 = time.monotonic()
            fn()
            mh.wait_version(v + 2, 180)
            steps.append((what, v, round(time.monotonic() - t0, 1)))

        after("rollout 2a", lambda: mh.kill_role("rollout", "2a"))
        relay3_before = mh.version()
        after("host h3", lambda: mh.kill_host(3))
        mh.start_host(3)
        mh.wait_version(mh.version() + 2, 180)
        after("partial pool", lambda: mh.kill_role("partial_pool", "0"))
        after("manager", lambda: mh.kill_role("manager", "0"))
        while mh.version() % CHECKPOINT_EVERY in (0, 1):  # kill it with versions past its checkpoint
            time.sleep(0.2)  # polling the trainer's metrics file
        after("trainer", lambda: mh.kill_role("trainer", "0"))
        chain = log_events(mh.log("manager", "0"), "relay_joined")
        after("master relay", lambda: mh.kill_role("relay", "r1"))
        # a hung master: stopped past dead_after_s (3 s), then continued (it must not wedge the chain)
        after("master stopped", lambda: mh.pause_role("relay", mh.master_relay(), 7.0))
        while mh.version() % CHECKPOINT_EVERY in (0, 1):  # with versions past its newest checkpoint
            time.sleep(0.2)  # polling the trainer's metrics file
        after("older ckpt", mh.restart_trainer_on_older_checkpoint)  # the trainer's lineage goes down
        after("broker", lambda: mh.kill_role("broker", "0"))

        def cut_link() -> None:
            mh.net.set_link(2, False)
            time.sleep(6)  # the fault's duration: longer than rollout_dead_after_s (3 s)
            mh.net.set_link(2, True)
        after("link h2 cut 6s", cut_link)
        def fuzz() -> None:
            for h in range(mh.initial):
                p = mh.net.popen(h, [sys.executable, "-m", "laminar.testing.fuzz_ports", str(mh.config),
                                     "--hosts", f"h{h}", "--frames", "500", "--seed", str(h)],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                out, _ = p.communicate(timeout=120)
                assert p.returncode == 0, out
        after("fuzz all ports", fuzz)
        after("h4 joins", lambda: mh.join_host(4))
        deadline = time.monotonic() + 180
        while not any(log_events(mh.log("rollout", r), "trajectory_stored") for r in ("4a", "4b")):
            assert time.monotonic() < deadline, "the joined host's rollouts stored nothing\n" + mh.tail()
            time.sleep(0.5)  # polling the new rollouts' logs
        mh.wait_version(mh.version() + 2, 180)
        end_version = mh.version()
        metrics = mh.metrics()
        run = mh.run_dir
        mh.close()
        ledger = mh.ledger()
        checks = mh.checks()

    print("\n" + "\n".join(f"{w:<14} killed at v{v}: two more versions in {s}s" for w, v, s in steps))
    versions = [int(r["version"]) for r in metrics]
    assert versions == list(range(1, end_version + 1)), versions  # gap-free (resume discards the rest)
    trained = [g for r in metrics for g in r["group_ids"]]
    assert len(trained) == len(set(trained)), "a group was trained twice"

    # every trajectory the manager recovered was stored once, or is still safe in the partial pool
    print(json.dumps(ledger | {"versions": f"1..{end_version}"}))
    assert ledger["samples_trained_twice"] == 0 and ledger["stored_twice"] == 0
    # every group the buffer handed out is in a kept version, or leased for a resumed trainer
    assert ledger["groups_handed_untrained"] == 0, ledger
    assert ledger["recovered"] > 0, "no rollout work was recovered"
    assert ledger["trajectories_lost"] == 0, ledger
    # lineage: the trainer kill discarded versions (a new lineage); nothing trained names weights
    # outside the history of the lineage that trained it, and nothing has a negative staleness
    print(json.dumps(checks))
    assert checks["trainer_restarts"] >= 1, checks
    assert checks["lineage_violations"] == 0, checks["lineage_violation_examples"]
    assert checks["trained_members_checked"] > 0, checks
    assert checks["negative_staleness_samples"] == 0, checks
    # prompts: every group handed out is settled, outstanding or requeued
    assert checks["prompts_skipped"] == 0, checks
    # orphans of a version no live rollout held resumed on it (retained by a relay), stored with it.
    # Whether a fault leaves such orphans depends on timing (tests/integration/rollout/test_rollout_vllm.py
    # tests adoption itself deterministically), so only the version they were stored with is asserted here.
    assert ledger["adopted_wrong_version"] == 0, ledger
    # the host that came back: its relay got a version newer than the one at its death
    r3 = [e["version"] for e in log_events(run / "logs" / "relay.r3.log", "version_visible")]
    assert r3 and max(r3) > relay3_before, r3
    assert any(e["relay"] == "r3" for e in chain)
    # the joined host: its relay got versions, its rollouts stored trajectories
    assert log_events(run / "logs" / "relay.r4.log", "version_visible"), "h4's relay never got a version"
    assert any(log_events(run / "logs" / f"rollout.{r}.log", "trajectory_stored") for r in ("4a", "4b"))
