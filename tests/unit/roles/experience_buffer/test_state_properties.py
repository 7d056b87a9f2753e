"""Experience buffer logic, property-based: groups stay whole, FIFO holds, the staleness filter
drops exactly the stale groups, capacity is never exceeded, nothing is handed out twice, and the
index of complete groups (`ready`) is exactly the complete groups in completion order."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from laminar.roles.experience_buffer.state import BufferBook

from laminar.protocol import Trajectory, TrajectorySpec


def traj(g: int, i: int, n: int, version: int) -> Trajectory:
    spec = TrajectorySpec(trajectory_id=f"g{g}/{i}", prompt_id=str(g), group_id=f"g{g}", sample_index=i,
                          group_size=n, prompt_tokens=np.array([1], np.int32))
    return Trajectory(spec=spec, response_tokens=np.array([5], np.int32), logprobs=np.array([-1.0], np.float32),
                      version=version, rollout_id="r", reward=0.0)


ops = st.lists(st.one_of(
    st.tuples(st.just("put"), st.integers(0, 11), st.integers(0, 3), st.integers(0, 6)),
    st.tuples(st.just("sample"), st.integers(1, 4), st.integers(0, 10), st.just(0))), max_size=120)


@settings(max_examples=200, deadline=None)
@given(ops=ops, capacity=st.integers(2, 30), n=st.integers(1, 4),
       max_stale=st.one_of(st.none(), st.integers(0, 4)), eviction=st.sampled_from(["drop_oldest", "reject"]))
def test_buffer_invariants(ops, capacity, n, max_stale, eviction):
    book = BufferBook(capacity, eviction, "fifo", max_stale)
    handed: set[str] = set()
    completion: list[str] = []   # our own model of completion order
    for op, a, b, c in ops:
        if op == "put":
            g, i = a, b % n
            before = set(book.groups)
            status, _ = book.put(traj(g, i, n, c))
            gid = f"g{g}"
            if status == "stored" and gid in book.groups and book.groups[gid].complete and gid not in completion:
                completion.append(gid)
            for gone in before - set(book.groups):
                if gone in completion:
                    completion.remove(gone)
        else:
            k, tv = a, b
            ready_before = {gid: grp.min_version() for gid, grp in book.groups.items() if grp.complete}
            groups, dropped, _ = book.sample(k, tv)
            stale = {gid for gid, v in ready_before.items() if max_stale is not None and tv - v > max_stale}
            assert dropped == len(stale)                    # exactly the stale groups are dropped
            got = [grp[0].spec.group_id for grp in groups]
            assert not (set(got) & stale)
            expected = [gid for gid in completion if gid in ready_before and gid not in stale][:k]
            assert got == expected                          # FIFO by completion
            for gid in stale:
                completion.remove(gid)
            for grp in groups:
                gid = grp[0].spec.group_id
                assert len(grp) == n and [t.spec.sample_index for t in grp] == list(range(n))  # whole
                assert gid not in handed                     # never twice
                handed.add(gid)
                completion.remove(gid)
        assert book.stored <= capacity                       # capacity never exceeded
        assert book.stored == sum(len(grp.members) for grp in book.groups.values())
        # the index of complete groups a sample reads instead of scanning: exactly them, in completion order
        assert list(book.ready) == [gid for gid in completion if gid in book.groups]
        assert set(book.ready) == {gid for gid, grp in book.groups.items() if grp.complete}
        assert all(grp.low == min(t.version for t in grp.members.values()) for grp in book.groups.values())


def test_duplicate_and_late_member_refused():
    book = BufferBook(10)
    assert book.put(traj(1, 0, 2, 0))[0] == "stored"
    assert book.put(traj(1, 0, 2, 0))[0] == "duplicate"
    book.put(traj(1, 1, 2, 0))
    groups, _, _ = book.sample(5, 1)
    assert len(groups) == 1
    assert book.put(traj(1, 1, 2, 0))[0].startswith("duplicate: group g1 was already handed")
    assert book.staleness == {1: 2}


def test_reject_when_full_names_capacity():
    book = BufferBook(4, eviction="reject")
    book.put(traj(1, 0, 2, 0))
    book.put(traj(1, 1, 2, 0))
    book.put(traj(2, 0, 2, 0))
    status, _ = book.put(traj(3, 0, 2, 0))
    assert status == "full: 3/4 trajectories stored, room for 1 more held for incomplete groups"


def test_leases_rehand_in_order_and_release():
    book = BufferBook(100)
    for g in range(5):
        for i in range(2):
            book.put(traj(g, i, 2, 0))
    first, _, ch = book.sample(2, 0, lease=True)
    assert [g[0].spec.group_id for g in first] == ["g0", "g1"] and ch.leased == [(0, "g0"), (1, "g1")]
    second, _, _ = book.sample(2, 1, lease=True)
    assert book.cursor == 4 and list(book.leased) == [0, 1, 2, 3]
    # a trainer resumed at position 2 (its checkpoint) is handed g2, g3 again, in order
    assert book.rehand(2, 5) == (["g2", "g3"], 4)
    assert book.rehand(1, 2) == (["g1", "g2"], 3)
    ch = type(ch)()
    book.release(2, ch)
    assert ch.released_below == 2 and list(book.leased) == [2, 3]
    assert book.rehand(0, 5) == (["g2", "g3"], 4)  # released positions are skipped
    # a final (unleased) hand-out is never handed again; duplicates of handed groups are refused
    book.sample(1, 2)
    assert book.rehand(4, 3) == ([], 5) and book.put(traj(4, 0, 2, 0))[0].startswith("duplicate")
