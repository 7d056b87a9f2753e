"""With `eviction: reject` the buffer must never be blocked for good by incomplete groups: room
for a group's missing members is held from its first member on, so a member of a group the
buffer already holds is never refused, and a full buffer still completes (and hands out) groups."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from laminar.roles.experience_buffer.state import BufferBook

from tests.unit.roles.experience_buffer.test_state_properties import traj


def test_first_members_cannot_fill_a_rejecting_buffer():
    book = BufferBook(4, eviction="reject")
    firsts = [book.put(traj(g, 0, 2, 0))[0] for g in range(4)]   # four groups start, one member each
    assert firsts[:2] == ["stored", "stored"] and all(s.startswith("full") for s in firsts[2:])
    for g in range(2):                                            # their second members still fit
        assert book.put(traj(g, 1, 2, 0))[0] == "stored"
    groups, _, _ = book.sample(4, 0)
    assert sorted(grp[0].spec.group_id for grp in groups) == ["g0", "g1"]
    assert book.put(traj(2, 0, 2, 0))[0] == "stored"              # room again once handed out


def test_a_group_larger_than_the_capacity_is_refused_with_a_reason():
    book = BufferBook(3, eviction="reject")
    status, _ = book.put(traj(1, 0, 4, 0))
    assert status.startswith("refused") and "capacity 3" in status  # for good: no later offer can change it


@settings(max_examples=200, deadline=None)
@given(order=st.permutations([(g, i) for g in range(8) for i in range(3)]), capacity=st.integers(3, 12))
def test_members_of_held_groups_are_never_refused(order, capacity):
    book = BufferBook(capacity, eviction="reject")
    for g, i in order:
        held = f"g{g}" in book.groups
        status, _ = book.put(traj(g, i, 3, 0))
        if held:
            assert status == "stored", status
        assert book.stored <= capacity
        # room for every missing member of every held group: each of them can still complete
        missing = sum(grp.size - len(grp.members) for grp in book.groups.values())
        assert book.stored + missing <= capacity


def test_an_incomplete_group_too_stale_to_train_gives_its_room_back():
    book = BufferBook(4, eviction="reject", max_staleness=1)
    assert book.put(traj(0, 0, 2, 0))[0] == "stored"          # its second member never comes
    assert book.put(traj(1, 0, 2, 3))[0] == "stored"
    assert book.put(traj(2, 0, 2, 3))[0].startswith("full")
    book.sample(1, 3)                                          # version 3: g0 can never be trained now
    assert "g0" not in book.groups and book.counts["dropped_stale_incomplete"] == 1
    assert book.put(traj(2, 0, 2, 3))[0] == "stored"
    assert book.put(traj(0, 1, 2, 0))[0].startswith("duplicate")   # a late member is refused, not stored
