"""The multi-host fault test's lineage audit checks what the trainer trained, not a guess.

A member runs in several copies: after the buffer drops its group off-lineage (a trainer resumed
and discarded the weights it was generated with), the prompt runs again as a new attempt `~a1`.
When the put of that attempt is applied but its reply is lost (a cut link), the rollout's retry
is answered `duplicate` and only that is logged. The audit used to match each trained member to
its newest `stored` line, which then named the dropped copy of the discarded lineage: a lineage
violation reported for training that was sound (the multi-host fault test failed so, about one
run in three). The trainer now records the labels it trained (`weights` in metrics.jsonl), and
the audit checks those. A real violation is still found, and named with its groups.
"""
from __future__ import annotations

import json

import pytest

from laminar.testing.multihost import MultiHost


def line(rollout: str, tid: str, lineage: int, version: int, status: str, at: str) -> str:
    return json.dumps({"role": "rollout", "id": rollout, "event": "trajectory_stored", "trajectory": tid,
                       "version": version, "lineage": lineage, "status": status, "timestamp": at}) + "\n"


def record(version: int, groups: list[str], weights: dict[str, int] | None, ts: float) -> str:
    r = {"version": version, "ts": ts, "samples": 4.0 * len(groups), "group_ids": groups}
    if weights is not None:
        r["weights"] = weights
    return json.dumps(r) + "\n"


def run_folder(tmp_path, records: list[str]):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "trainer" / "checkpoints").mkdir(parents=True)
    (run / "trainer" / "checkpoints" / "lineage.json").write_text(
        json.dumps({"run_id": "r", "epoch": 2, "forks": {"1": 0, "2": 12}}))  # resumed from version 12
    # lineage 1 version 14: stored, then dropped off-lineage by the buffer once lineage 2 sampled
    (run / "logs" / "rollout.3b.log").write_text("".join(
        line("3b", f"e0-p218/{i}", 1, 14, "stored", "2026-11-27T13:42:58Z") for i in range(4)))
    # the new attempt, on lineage 2 version 17: applied, its reply lost, the retry answered duplicate
    (run / "logs" / "rollout.2a.log").write_text("".join(
        line("2a", f"e0-p218/{i}~a1", 2, 17, "duplicate", "2026-11-27T13:43:52Z") for i in range(4)))
    (run / "trainer" / "metrics.jsonl").write_text("".join(records))
    return MultiHost.reading(run)


def test_a_member_whose_trained_copy_logged_only_duplicate_is_not_a_violation(tmp_path):
    after = 1795787100.0  # both log lines are older than the record
    mh = run_folder(tmp_path, [record(24, ["e0-p218"], {"2:17": 4}, after)])
    checks = mh.checks()
    assert checks["lineage_violations"] == 0, checks["lineage_violation_examples"]
    assert checks["trained_members_checked"] == 4 and checks["trained_members_unlabelled"] == 0


def test_trained_work_of_the_discarded_lineage_is_a_violation(tmp_path):
    mh = run_folder(tmp_path, [record(24, ["e0-p218"], {"1:14": 4}, 1795787100.0),
                               record(25, ["e0-p9"], {"2:25": 3, "2:10": 1}, 1795787101.0)])
    checks = mh.checks()
    assert checks["lineage_violations"] == 8, checks
    got = {(x["lineage"], x["version"], x["why"], x["samples"], tuple(x["groups"]))
           for x in checks["lineage_violation_examples"]}
    assert got == {(1, 14, "off the trained lineage's history", 4, ("e0-p218",)),
                   (2, 25, "version not yet published", 3, ()),
                   (2, 10, "before its lineage started", 1, ())}


def test_a_record_without_labels_is_counted_unlabelled_not_passed(tmp_path):
    checks = run_folder(tmp_path, [record(24, ["e0-p218"], None, 1795787100.0)]).checks()
    assert checks["trained_members_checked"] == 0 and checks["trained_members_unlabelled"] == 4


def test_waiting_for_a_version_past_the_trainers_budget_says_so_at_once(tmp_path):
    """The fault test waited 180 s for version 82 of a trainer that had finished its 80 iterations
    (training outran a slow host join), then failed with a timeout; now the harness says why."""
    mh = run_folder(tmp_path, [record(v, [f"e0-p{v}"], {f"2:{v - 1}": 4}, 1795787100.0 + v) for v in range(13, 81)])
    (mh.run_dir / "logs" / "trainer.0.log").write_text(json.dumps(
        {"role": "trainer", "id": "0", "version": 80, "event": "training_finished", "level": "info"}) + "\n")
    mh.wait_version(80, timeout=30)  # reached: returns
    with pytest.raises(RuntimeError, match="finished at version 80"):  # not a TimeoutError after 2 s
        mh.wait_version(82, timeout=2)
