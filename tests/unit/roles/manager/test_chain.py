"""ChainCoordinator: joins go to the tail, a dead relay's predecessor is linked to its successor,
a dead master's successor becomes master, and the Link actions always rebuild the exact order."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from laminar.roles.manager.chain import ChainCoordinator, Link, NewMaster, RelayInfo


def info(rid: str) -> RelayInfo:
    return RelayInfo(rid, "h", f"10.0.0.1:{7000 + int(rid[1:])}", f"tcp://10.0.0.1:{8000 + int(rid[1:])}")


def test_first_join_is_master_and_later_joins_link_the_tail():
    c = ChainCoordinator()
    assert c.join(info("r0")) == [NewMaster("r0", info("r0").data_address)]
    assert c.join(info("r1")) == [Link("r0", "r1", info("r1").data_address)]
    assert c.join(info("r2")) == [Link("r1", "r2", info("r2").data_address)]
    assert c.order() == ["r0", "r1", "r2"] and c.master.relay_id == "r0" and c.epoch == 3


def test_middle_death_relinks_predecessor_to_successor():
    c = ChainCoordinator()
    for r in ("r0", "r1", "r2", "r3"):
        c.join(info(r))
    assert c.remove("r1") == [Link("r0", "r2", info("r2").data_address)]
    assert c.order() == ["r0", "r2", "r3"]
    assert c.remove("r3") == [Link("r2", "", "")]          # the new tail forwards to nobody
    assert c.remove("r9") == []                              # unknown / already removed


def test_master_death_promotes_its_successor():
    c = ChainCoordinator()
    for r in ("r0", "r1", "r2"):
        c.join(info(r))
    assert c.remove("r0") == [NewMaster("r1", info("r1").data_address)]
    assert c.upstream_of("r1") is None and c.order() == ["r1", "r2"]
    c.remove("r1")
    c.remove("r2")
    assert c.master is None and c.order() == []
    assert c.join(info("r5")) == [NewMaster("r5", info("r5").data_address)]


def test_rejoin_moves_a_restarted_relay_to_the_tail():
    c = ChainCoordinator()
    for r in ("r0", "r1", "r2"):
        c.join(info(r))
    actions = c.join(info("r1"))
    assert c.order() == ["r0", "r2", "r1"]
    assert Link("r0", "r2", info("r2").data_address) in actions
    assert Link("r2", "r1", info("r1").data_address) in actions


def test_removal_is_constant_time_in_chain_length():
    c = ChainCoordinator()
    for i in range(20_000):
        c.join(info(f"r{i}"))
    assert c.remove("r10000") == [Link("r9999", "r10001", info("r10001").data_address)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 9)), max_size=60))
def test_actions_replayed_on_relays_rebuild_the_order(ops):
    """Simulate relays obeying the actions; their downstream pointers must spell c.order()."""
    c = ChainCoordinator()
    ref: list[str] = []
    down: dict[str, str] = {}
    master = ""
    for join, k in ops:
        rid = f"r{k}"
        if join:
            acts = c.join(info(rid))
            if rid in ref:
                ref.remove(rid)
            ref.append(rid)
        else:
            acts = c.remove(rid)
            if rid in ref:
                ref.remove(rid)
        down.pop(rid, None) if not join else down.__setitem__(rid, "")
        for a in acts:
            if isinstance(a, Link):
                down[a.upstream] = a.downstream
            else:
                master = a.relay_id
        assert c.order() == ref
        assert master == (ref[0] if ref else "")
        walk, cur = [], master
        while cur:
            walk.append(cur)
            cur = down.get(cur, "")
            assert len(walk) <= len(ref)
        assert walk == ref
