"""A rollout key takes over (fences to itself) only a trajectory it owns, or one the manager
granted it for a MigrateIn. Before, a `rollout.r1` key that knew the id of r0's trajectory could
fence it to itself (r0's later writes refused: the work stolen), reassign it to itself without a
fence, or write the next delta into it and so become its owner. The pool and its dispatcher are
real; the caller's key identity, which the CURVE transport supplies in a scoped cluster
(tests/unit/bus/test_security_scopes.py), is handed to the dispatcher directly."""
from __future__ import annotations

import asyncio

import pytest
import structlog
from laminar.bus import auth
from laminar.roles.manager.fleet import Fleet, FleetSettings

from laminar.protocol import (
    AppendDeltas,
    ErrorReply,
    GetPartial,
    GrantPartials,
    MigrateIn,
    MigrateInResult,
    ReassignPartial,
    RolloutStats,
)
from laminar.testing.inproc_cluster import InprocCluster
from tests.unit.roles.test_pool_write_failures import cfg, delta, handed, two_owner_pool

pytestmark = pytest.mark.timeout(60)


def test_a_rollout_key_claims_only_its_own_or_granted_trajectories(tmp_path):
    async def go():
        c, _, client, d = await two_owner_pool(tmp_path)
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


def test_a_new_manager_grants_what_it_places_so_the_destination_may_claim_it(tmp_path):
    """The manager killed between MigrateOut and MigrateIn: the source released the work (owner
    none), a new manager's reconcile finds it and places it; its GrantPartials lets the destination's
    scoped key take it over, and nobody else's. The partial pool and the Fleet are real; the
    destination is a stub rollout whose MigrateIn claims through the pool as `rollout.r1`."""

    async def go():
        c = InprocCluster(cfg(tmp_path))
        pool = await c.start("partial_pool")
        d = pool.server.dispatcher
        d.authorize = auth.request_refusal
        await d.handle(AppendDeltas("r0", [handed(pool, delta("a", 0), "r0")]), {}, None, "rollout.r0")
        await d.handle(ReassignPartial("a", ""), {}, None, "rollout.r0")      # MigrateOut's release
        early = await d.handle(ReassignPartial("a", "r1", fence=True), {}, None, "rollout.r1")  # not granted yet
        claims = []

        async def migrate_in(req: MigrateIn) -> MigrateInResult:
            for p in req.partials:
                claims.append(await d.handle(ReassignPartial(p.spec.trajectory_id, "r1", fence=True), {}, None,
                                             "rollout.r1"))
            return MigrateInResult(accepted=[p.spec.trajectory_id for p in req.partials], version=0)
        t = c.hub.transport()
        dest = t.server("inproc://rollout.r1", "rollout", "r1")
        dest.route(MigrateIn, migrate_in)
        await dest.start()
        fleet = Fleet(t, structlog.get_logger("test"), FleetSettings(), lambda rid: f"inproc://rollout.{rid}",
                      c.config.endpoint("partial_pool", "0"))
        fleet.on_stats(RolloutStats("r1", "h0", 0, 0.0, 0, 0, 0, 0.0, "idle"))
        await fleet.recovery.reconcile()
        await fleet.recovery.place_orphans()
        thief = await d.handle(ReassignPartial("a", "r2", fence=True), {}, None, "rollout.r2")
        a = await c.client("partial_pool").call(GetPartial("a"))
        left = dict(fleet.orphans)
        fleet.close()
        await dest.close()
        await c.close()
        return early, claims, thief, a, left
    early, claims, thief, a, left = asyncio.run(go())
    assert isinstance(early, ErrorReply) and "may not take over" in early.message
    assert [x.detail for x in claims] == ["epoch 1"] and not left
    assert isinstance(thief, ErrorReply) and (a.rollout_id, a.epoch) == ("r1", 1)
