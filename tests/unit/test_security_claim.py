"""A rollout key takes over (fences to itself) only a trajectory it owns, or one the manager
granted it for a MigrateIn. Before, a `rollout.r1` key that knew the id of r0's trajectory could
fence it to itself (r0's later writes refused: the work stolen), reassign it to itself without a
fence, or write the next delta into it and so become its owner. The pool and its dispatcher are
real; the caller's key identity, which the CURVE transport supplies in a scoped cluster
(tests/unit/test_security_scopes.py), is handed to the dispatcher directly."""
from __future__ import annotations

import asyncio

import pytest
from laminar.bus import auth

from laminar.protocol import AppendDeltas, ErrorReply, GetPartial, GrantPartials, ReassignPartial
from laminar.testing.inproc_cluster import InprocCluster
from tests.unit.test_pool_write_failures import cfg, delta

pytestmark = pytest.mark.timeout(60)


def test_a_rollout_key_claims_only_its_own_or_granted_trajectories(tmp_path):
    async def go():
        c = InprocCluster(cfg(tmp_path))
        pool = await c.start("partial_pool")
        client = c.client("partial_pool")
        await client.call(AppendDeltas("r0", [delta("a", 0)]))
        await client.call(AppendDeltas("r1", [delta("b", 0)]))
        d = pool.server.dispatcher
        d.authorize = auth.request_refusal  # as a scoped (CURVE) server does
        r = {}
        r["fence"] = await d.handle(ReassignPartial("a", "r1", fence=True), {}, None, "rollout.r1")
        r["take"] = await d.handle(ReassignPartial("a", "r1"), {}, None, "rollout.r1")
        r["write"] = await d.handle(AppendDeltas("r1", [delta("a", 1)]), {}, None, "rollout.r1")
        r["before"] = await client.call(GetPartial("a"))
        r["grant_by_rollout"] = await d.handle(GrantPartials(["a"], "r1"), {}, None, "rollout.r1")
        r["grant"] = await d.handle(GrantPartials(["a"], "r1"), {}, None, "manager")
        r["other"] = await d.handle(ReassignPartial("a", "r2", fence=True), {}, None, "rollout.r2")
        r["granted"] = await d.handle(ReassignPartial("a", "r1", fence=True), {}, None, "rollout.r1")
        r["after"] = await client.call(GetPartial("a"))
        r["r0_again"] = await d.handle(ReassignPartial("a", "r0", fence=True), {}, None, "rollout.r0")
        # a release by its owner leaves it claimable by that owner (MigrateOut's reclaim) and nobody else
        r["release"] = await d.handle(ReassignPartial("a", ""), {}, None, "rollout.r1")
        r["thief"] = await d.handle(ReassignPartial("a", "r2"), {}, None, "rollout.r2")
        r["reclaim"] = await d.handle(ReassignPartial("a", "r1"), {}, None, "rollout.r1")
        r["own"] = await d.handle(AppendDeltas("r1", [delta("b", 1)]), {}, None, "rollout.r1")
        r["end"] = await client.call(GetPartial("a"))
        await c.close()
        return r
    r = asyncio.run(go())
    for k in ("fence", "take", "other", "r0_again", "thief"):
        assert isinstance(r[k], ErrorReply) and r[k].code == "refused" and "may not take over" in r[k].message, k
    assert "a" in r["write"].rejected and "owned by rollout r0" in r["write"].rejected["a"]
    assert (r["before"].rollout_id, r["before"].epoch, r["before"].next_seq) == ("r0", 0, 1)
    assert isinstance(r["grant_by_rollout"], ErrorReply) and "forbidden" in r["grant_by_rollout"].message
    assert not isinstance(r["grant"], ErrorReply) and not isinstance(r["granted"], ErrorReply)
    assert r["granted"].detail == "epoch 1" and (r["after"].rollout_id, r["after"].epoch) == ("r1", 1)
    assert not isinstance(r["release"], ErrorReply) and not isinstance(r["reclaim"], ErrorReply)
    assert r["own"].applied == 1 and r["end"].rollout_id == "r1"


def test_only_the_manager_grants():
    may = {s for s in ("env", "relay", "node", "pool", "trainer", "manager", "rollout", "rollout.r0")
           if not auth.request_refusal(s, GrantPartials(["a"], "r0"))}
    assert may == {"manager"}
