"""Request kinds are denied by default per key scope, and a rollout key named after a rollout acts
only as that rollout; events whose body names another role than their topic are dropped.

Before: only a few kinds were scoped, so env, relay and node keys could sample the buffer, requeue
prompts, take batches, migrate work out of rollouts and read every in-flight partial; a named
rollout key could read another rollout's partial; and a rollout key could publish, on its own
topic, a heartbeat naming another rollout (the manager then declared that one dead).
Real CURVE sockets for the server and the broker; the partial pool is the real role.
"""
from __future__ import annotations

import asyncio
import time

import pytest
from laminar.bus import auth
from laminar.bus.broker import Broker
from laminar.bus.errors import Refused
from laminar.bus.inproc import InprocHub
from laminar.bus.zmq_transport import ZmqTransport

from laminar.protocol import (
    Ack,
    AppendDeltas,
    Batch,
    BufferStatsRequest,
    CompletePartial,
    EnvClose,
    EnvReset,
    EnvStep,
    ErrorReply,
    GetPartial,
    GroupPresence,
    HandedGroups,
    Heartbeat,
    InFlightOf,
    LinkDown,
    MasterQuery,
    MigrateIn,
    MigrateOut,
    PartialList,
    RelayJoin,
    RequeueGroups,
    RolloutStats,
    SampleGroups,
    Samples,
    SetDownstream,
    TakeBatch,
)
from tests.support import ROOT, free_port
from tests.unit.roles.test_pool_write_failures import two_owner_pool

pytestmark = pytest.mark.timeout(60)

SCOPED = ("env", "relay", "node", "evaluator", "broker", "pool", "trainer", "manager", "rollout", "rollout.r0")


def test_every_request_kind_is_in_the_table_and_the_rest_is_denied():
    # every kind a role serves (the `route` calls of roles/) has a row
    served = [TakeBatch, RequeueGroups, HandedGroups, AppendDeltas, InFlightOf, GetPartial, GroupPresence,
              CompletePartial, SampleGroups, BufferStatsRequest, MigrateOut, MigrateIn, RelayJoin, SetDownstream,
              LinkDown, MasterQuery, EnvReset, EnvStep, EnvClose]
    assert [c.kind for c in served if c.kind not in auth.REQUESTS] == []
    unknown = type("Unlisted", (), {"kind": "data.something_new"})()
    assert [s for s in SCOPED if not auth.request_refusal(s, unknown)] == []     # not listed: nobody
    assert auth.request_refusal("operator", unknown) == "" and auth.request_refusal(None, unknown) == ""
    # docs/security.md has the table in words: a row per kind
    doc = (ROOT / "docs" / "security.md").read_text()
    rows = [line for line in doc.splitlines() if line.startswith("| `") and "| Scopes" not in line]
    assert [k for k in auth.REQUESTS if not any(line.split("|")[1].count(f"`{k}`") for line in rows)] == []


@pytest.mark.parametrize("req, allowed", [
    (SampleGroups(0, 0, lineage=999999), {"trainer"}),
    (BufferStatsRequest(), {"trainer"}),
    (RequeueGroups(["g1"]), {"manager", "pool"}),
    (HandedGroups(), {"manager"}),
    (TakeBatch("r0", 4), {"rollout", "rollout.r0"}),
    (MigrateOut([], everything=True), {"manager"}),
    (MigrateIn([]), {"manager"}),
    (InFlightOf("*"), {"manager"}),
    (GroupPresence(["g1"]), {"manager"}),
    (GetPartial("t1"), {"manager", "rollout", "rollout.r0"}),
])
def test_default_deny_per_scope(req, allowed):
    may = {s for s in SCOPED if not auth.request_refusal(s, req)}
    assert may == allowed


def test_a_named_rollout_key_acts_only_as_its_rollout():
    assert auth.request_refusal("rollout.r0", TakeBatch("r1", 4)) != ""
    assert auth.request_refusal("rollout.r0", AppendDeltas("r1", [])) != ""
    assert auth.request_refusal("rollout.r0", TakeBatch("r0", 4)) == ""


@pytest.fixture
def keys_dir(tmp_path):
    d = tmp_path / "keys"
    auth.generate_keys(d)
    for ident in ("operator", "node", "broker", "manager", "pool", "relay", "env", "trainer", "rollout.r0",
                  "rollout.r1"):
        auth.generate_client_key(d, ident)
    return d


def transport(keys_dir, scope=None, name=None, pub="tcp://127.0.0.1:1", sub="tcp://127.0.0.1:2") -> ZmqTransport:
    return ZmqTransport(pub, sub, auth.load_keys(keys_dir, scope, name))


def test_server_refuses_what_env_relay_node_and_rollout_keys_may_not_send(keys_dir):
    async def main():
        srv_t = transport(keys_dir, "pool")
        server = srv_t.server(f"tcp://127.0.0.1:{free_port()}", "experience_buffer", "0")
        served: list[str] = []

        def handler(reply):
            async def h(req):
                served.append(type(req).kind)
                return reply
            return h
        server.route(SampleGroups, handler(Samples([], 0)))
        server.route(RequeueGroups, handler(Ack()))
        server.route(TakeBatch, handler(Batch([])))
        server.route(InFlightOf, handler(PartialList([])))
        server.route(MigrateOut, handler(PartialList([])))
        await server.start()
        ts = {s: transport(keys_dir, *s.split(".")) for s in ("env", "relay", "node", "rollout.r0", "trainer",
                                                               "manager")}
        clients = {s: t.client(server.address) for s, t in ts.items()}
        attacks = [SampleGroups(0, 0, lineage=999999), RequeueGroups(["g1"]), TakeBatch("r1", 4), InFlightOf("*"),
                   MigrateOut([], everything=True)]
        try:
            for s in ("env", "relay", "node", "rollout.r0"):
                for req in attacks:
                    with pytest.raises(Refused, match="forbidden"):
                        await clients[s].call(req)
            assert served == []
            await clients["trainer"].call(SampleGroups(1, 0))
            await clients["manager"].call(RequeueGroups(["g1"]))
            await clients["manager"].call(InFlightOf("*"))
            await clients["rollout.r0"].call(TakeBatch("r0", 4))
            assert served == ["data.sample_groups", "data.requeue_groups", "data.in_flight_of", "data.take_batch"]
        finally:
            for c in clients.values():
                c.close()
            await server.close()
            for t in (*ts.values(), srv_t):
                await t.close()
    asyncio.run(main())


def test_a_named_rollout_key_reads_only_its_own_partials(tmp_path):
    async def go():
        c, _, client, d = await two_owner_pool(tmp_path)
        theirs = await d.handle(GetPartial("b"), {}, None, "rollout.r0")
        own = await d.handle(GetPartial("a"), {}, None, "rollout.r0")
        listing = await d.handle(InFlightOf("*"), {}, None, "rollout.r0")
        manager = await d.handle(GetPartial("b"), {}, None, "manager")
        await c.close()
        return theirs, own, listing, manager
    theirs, own, listing, manager = asyncio.run(go())
    assert isinstance(theirs, ErrorReply) and theirs.code == "refused" and "of rollout r1" in theirs.message
    assert not isinstance(own, ErrorReply) and own.rollout_id == "r0"
    assert isinstance(listing, ErrorReply) and listing.code == "refused"
    assert not isinstance(manager, ErrorReply) and manager.rollout_id == "r1"


def hb(role, rid, seq=0, pid=1):
    return Heartbeat(role, rid, "h", pid, seq, 0.0, "ready")


def stats(rid, address):
    return RolloutStats(rid, "h", 3, 0.1, 1, 0, 1, 1.0, "generating", control_address=address, ts=time.time())


def test_events_naming_another_role_than_their_topic_are_dropped(keys_dir):
    """A rollout.r0 key, on its own topics, forges r1's heartbeat (a new pid: the manager would
    declare r1 dead and fence its work) and r1's statistics (pointing r1's control address at
    itself): the broker forwards them (the topics are r0's), the subscriber drops them."""
    pub_port, sub_port = free_port(), free_port()
    broker = Broker(f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{sub_port}", auth.load_keys(keys_dir, "broker"))
    broker.start()
    endpoints = {"pub": f"tcp://127.0.0.1:{pub_port}", "sub": f"tcp://127.0.0.1:{sub_port}"}

    async def main():
        listener_t = transport(keys_dir, "manager", **endpoints)
        rollout_t = transport(keys_dir, "rollout", "r0", **endpoints)
        sub = listener_t.subscriber(["hb.", "rollout.stats."])
        rp = rollout_t.publisher()
        got: list[tuple[str, object]] = []
        try:
            deadline = time.monotonic() + 20
            seq = 0
            while time.monotonic() < deadline:  # until two rounds of markers came through
                seq += 1
                rp.publish("hb.rollout.r0", hb("rollout", "r1", seq, pid=999))       # r1 "restarted"
                rp.publish("rollout.stats.r0", stats("r1", "tcp://10.6.6.6:1"))      # r1 "moved"
                rp.publish("hb.rollout.r0", hb("rollout", "r0", seq))                # its own: the marker
                try:
                    while True:
                        topic, ev = await asyncio.wait_for(sub.recv(), 0.2)
                        got.append((topic, ev))
                except TimeoutError:
                    pass
                if sum(1 for _, e in got if isinstance(e, Heartbeat) and e.id == "r0") >= 2:
                    break
            assert sum(1 for _, e in got if isinstance(e, Heartbeat) and e.id == "r0") >= 2
            assert [(t, e) for t, e in got if getattr(e, "id", None) == "r1" or getattr(e, "rollout_id", "") == "r1"] \
                == []
            assert sub.dropped >= 2
        finally:
            sub.close()
            rp.close()
            for t in (listener_t, rollout_t):
                await t.close()
    try:
        asyncio.run(main())
    finally:
        broker.stop()


def test_inproc_subscribers_drop_forged_identities_too():
    async def main():
        hub = InprocHub()
        t = hub.transport()
        sub = t.subscriber(["hb.", "rollout.stats."])
        pub = t.publisher()
        pub.publish("hb.rollout.r0", hb("rollout", "r1"))
        pub.publish("rollout.stats.r0", stats("r1", "x"))
        pub.publish("hb.rollout.r0", hb("rollout", "r0"))
        topic, ev = await asyncio.wait_for(sub.recv(), 2)
        return topic, ev, sub.dropped
    topic, ev, dropped = asyncio.run(main())
    assert (topic, ev.id, dropped) == ("hb.rollout.r0", "r0", 2)
