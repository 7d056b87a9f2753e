"""The compromised-host scenario's ledger (laminar/testing/ledger_hostile.py) on records made by
hand: it must see each way a hostile host could get something trained or lose honest work, and
nothing in a clean run. The scenario itself runs in tests/integration/chaos/test_chaos_hostile.py."""
from __future__ import annotations

from laminar.testing.ledger_hostile import Records, hostile_alarms, hostile_ledger

HOSTILE = {"3a", "3b"}
RUN = "run-1"


def members(gid: str, rollout: str, n: int = 4, run: str = RUN, tail: str = "") -> list[list[str]]:
    return [[f"{gid}/{i}{tail}", rollout, run] for i in range(n)]


def handed(gid: str, rollout: str, n: int = 4, tail: str = "") -> dict[str, str]:
    return {f"{gid}/{i}{tail}": rollout for i in range(n)}


def version(v: int, *groups: list[list[str]]) -> dict:
    rows = [m for g in groups for m in g]
    return {"version": v, "samples": len(rows), "group_ids": sorted({t.rsplit("/", 1)[0] for t, _, _ in rows}),
            "members": rows}


def clean() -> Records:
    """r1 was handed e0-p1 and stored it; the hostile 3a was handed e0-p2 and stored it (its own)."""
    return Records(handed={**handed("e0-p1", "1a"), **handed("e0-p2", "3a")},
                   trained=[version(1, members("e0-p1", "1a"), members("e0-p2", "3a"))], runs={RUN})


def test_hostile_ledger_a_clean_run_counts_the_hostile_hosts_own_handouts_apart():
    out = hostile_ledger(clean(), HOSTILE)
    assert out["honest_lost"] == out["honest_trained_twice"] == out["hostile_samples_trained"] == 0, out
    assert out["hostile_handed_trained"] == 4 and out["hostile_handed_out"] == 4 and out["honest_groups"] == 1


def test_hostile_ledger_a_forged_one_member_group_is_hostile_and_the_honest_members_lost():
    rec = clean()
    rec.handed.update(handed("e0-p3", "1b"))  # r1b was handed e0-p3; 3a stored a forged member 0 of it
    rec.trained.append({"version": 2, "samples": 1, "group_ids": ["e0-p3"], "members": [["e0-p3/0", "3a", RUN]]})
    out = hostile_ledger(rec, HOSTILE)
    assert out["hostile_samples_trained"] == 1 and "written by 3a" in out["hostile_trained_examples"][0]["why"]
    assert out["honest_lost"] == 4  # its group was trained without the honest members (slot 0's too)


def test_hostile_ledger_an_id_never_handed_out_and_another_runs_label_are_beyond_the_handouts():
    rec = clean()
    rec.trained.append(version(2, members("e9-p9", "3a")))                  # never handed out
    rec.handed.update(handed("e0-p4", "3b"))
    rec.trained.append(version(3, members("e0-p4", "3b", run="run-old")))   # its own, labelled another run
    out = hostile_ledger(rec, HOSTILE)
    whys = sorted({x["why"].split(" ")[0] for x in out["hostile_trained_examples"]})
    assert out["hostile_samples_trained"] == 8 and whys == ["generated", "never"], out


def test_hostile_ledger_a_squatted_member_left_in_the_partial_pool_is_lost():
    rec = Records(handed=handed("e0-p5", "1a"), trained=[], runs={RUN})
    rec.partial = {"e0-p5/0": "1a", "e0-p5/1": "1a", "e0-p5/2": "1a", "e0-p5/3": "3a"}  # 3a owns member 3
    out = hostile_ledger(rec, HOSTILE)
    assert out["honest_lost"] == 1 and out["honest_lost_examples"] == ["e0-p5/3"]


def test_hostile_ledger_work_still_held_somewhere_is_not_lost():
    rec = Records(handed={**handed("e0-p6", "1a"), **handed("e0-p7", "1a"), **handed("e0-p8", "2b"),
                          **handed("e0-p9", "2a")}, trained=[], runs={RUN})
    rec.buffered = {"e0-p6/0", "e0-p6/1"}
    rec.partial = {"e0-p6/2~a3": "2a", "e0-p6/3": "1a"}  # a later attempt in flight elsewhere
    rec.open = {"e0-p7", "e0-p8/1"}
    rec.gone = {"e0-p9"}  # dropped by the buffer's policy (or handed to a trainer: other checks)
    out = hostile_ledger(rec, HOSTILE)
    assert out["honest_lost_examples"] == [f"e0-p8/{i}" for i in (0, 2, 3)]


def test_hostile_ledger_a_group_trained_twice_and_a_restarted_orphan():
    rec = clean()
    rec.trained.append(version(2, members("e0-p1", "1a")))
    out = hostile_ledger(rec, HOSTILE)
    assert out["honest_trained_twice"] == 1 and out["honest_trained_twice_examples"] == ["e0-p1"]
    rec = clean()  # an orphan the manager restarted (~r1) is its original hand-out's, wherever it finished
    rec.trained = [version(1, [["e0-p1/0~r1", "2a", RUN]] + members("e0-p1", "1a")[1:])]
    out = hostile_ledger(rec, HOSTILE)
    assert out["hostile_samples_trained"] == 0 and out["honest_lost"] == 0, out


def test_hostile_ledger_versions_without_members_are_counted_unrecorded():
    rec = clean()
    rec.trained.append({"version": 2, "samples": 16, "group_ids": ["e0-p1"]})
    assert hostile_ledger(rec, HOSTILE)["members_unrecorded"] == 16


def test_hostile_alarms_counts_healthz_alarms_naming_a_compromised_host_once_each():
    line = ("writes_refused (partial_pool.0: {n} writes without a hand-out, the newest from {key} on host {hosts}, "
            "{age} s ago)")
    polls = [{"alarms": [line.format(n=3, key="rollout.3a", hosts="h3", age=1), "weights_stalled (manager.0: lag 4 "
                         "versions)"]},
             {"alarms": [line.format(n=9, key="rollout.3a", hosts="h3", age=0),
                         line.format(n=1, key="reward.rm", hosts="h1,h2", age=2),
                         line.format(n=1, key="rollout.1a", hosts="h1", age=2)]}]
    out = hostile_alarms(polls, {"h3", "h2"})
    assert out["hostile_alarms"] == 2 and "rollout.3a on host h3" in out["hostile_alarm_examples"][0]
