"""roles/manager/handed.py: the ownership rule of the prompt pools' group accounting, on its inputs
alone (no pools, no fleet): settled when every wanted member is somewhere, kept while the owner
lives, requeued whole or member by member when it is dead, and an owner never heard from counted
dead only after twice the dead-after time since the accounting first met it."""
from __future__ import annotations

from laminar.roles.manager.handed import HandedRow, Owners, settle_entries


def owners(*, known=("r1", "r2"), live=None, first_seen=None, now=100.0, dead=False) -> Owners:
    return Owners(frozenset(known), {"r1": 7, "r2": 0} if live is None else live, first_seen or {}, now,
                  dead_after_s=5.0, dead=dead)


def test_an_entry_whose_members_are_all_present_is_settled_whoever_owns_it():
    rows = [HandedRow("g1", "r1", 2, "g1", -1), HandedRow("g2/1", "gone", 4, "g2", 1),
            HandedRow("g3", "r1", 3, "g3", -1)]
    out = settle_entries(rows, {"g1": {0, 1}, "g2": {1}, "g3": {-1}}, owners(dead=True))
    assert (out.settled, out.requeue, out.kept) == (["g1", "g2/1", "g3"], [], 0)


def test_a_live_owner_keeps_what_is_missing():
    out = settle_entries([HandedRow("g1", "r1", 2, "g1", -1, pid=7)], {"g1": {0}}, owners())
    assert (out.settled, out.requeue, out.kept) == ([], [], 1)


def test_a_dead_owner_requeues_the_whole_entry_when_nothing_arrived():
    out = settle_entries([HandedRow("g1", "r1", 3, "g1", -1)], {}, owners(live={"r2": 0}))
    assert (out.settled, out.requeue, out.kept) == ([], ["g1"], 0)


def test_a_dead_owner_requeues_only_the_missing_members_and_settles_the_entry():
    out = settle_entries([HandedRow("g1", "r1", 4, "g1", -1)], {"g1": {0, 2}}, owners(dead=True))
    assert (out.settled, out.requeue, out.kept) == (["g1"], ["g1/1", "g1/3"], 0)


def test_another_process_of_a_live_owner_is_a_dead_owner():
    rows = [HandedRow("a", "r1", 1, "a", -1, pid=6), HandedRow("b", "r1", 1, "b", -1, pid=7),
            HandedRow("c", "r2", 1, "c", -1, pid=9), HandedRow("d", "r1", 1, "d", -1, pid=0)]
    out = settle_entries(rows, {}, owners())
    # pid 6 is an earlier process of r1 (now 7); r2 has no heartbeat pid yet; no pid recorded: the owner
    assert (out.requeue, out.kept) == (["a"], 3)


def test_a_stranger_is_alive_until_twice_the_dead_after_time_from_first_meeting():
    row = HandedRow("g", "new", 1, "g", -1)
    first = settle_entries([row], {}, owners(now=100.0))
    assert (first.kept, first.requeue, first.strangers) == (1, [], {"new": 100.0})
    later = settle_entries([row], {}, owners(now=110.0, first_seen={"new": 100.0}))
    assert (later.kept, later.requeue, later.strangers) == (1, [], {})  # 10 s is not past 2 x 5 s
    past = settle_entries([row], {}, owners(now=110.5, first_seen={"new": 100.0}))
    assert (past.kept, past.requeue) == (0, ["g"])


def test_a_dead_rollout_settled_makes_every_owner_dead_even_a_stranger_met_now():
    out = settle_entries([HandedRow("g", "new", 2, "g", 0)], {}, owners(dead=True))
    assert (out.requeue, out.strangers) == (["g"], {"new": 100.0})
