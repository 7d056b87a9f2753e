"""Scoped keys: a compromised rollout host's key cannot stop the cluster, join the relay chain
(and so become its master) or write another rollout's trajectories; a role stopped by an
operator's command exits with a code of its own, which the supervisor does not restart.

Real CURVE sockets throughout: a broker and request/reply servers with scoped keys, clients with
the keys a rollout host, a relay host and the operator would hold.
"""
from __future__ import annotations

import asyncio
import sys
import time

import numpy as np
import pytest
import structlog.testing
from laminar.bus import auth
from laminar.bus.broker import Broker
from laminar.bus.errors import Refused
from laminar.bus.inproc import InprocHub
from laminar.bus.zmq_transport import ZmqTransport

from laminar.protocol import Ack, Heartbeat, PutResult, PutTrajectory, RelayJoin, Shutdown, Trajectory, TrajectorySpec
from laminar.role_base import Role, RoleContext
from laminar.shell import EXIT_STOPPED_BY_OPERATOR, run_role
from tests.support import free_port

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def keys_dir(tmp_path):
    d = tmp_path / "keys"
    auth.generate_keys(d)
    for ident in ("operator", "node", "broker", "manager", "pool", "relay", "rollout.r0", "rollout.r1"):
        auth.generate_client_key(d, ident)
    return d


def transport(keys_dir, scope=None, name=None, pub="tcp://127.0.0.1:1", sub="tcp://127.0.0.1:2") -> ZmqTransport:
    return ZmqTransport(pub, sub, auth.load_keys(keys_dir, scope, name))


def trajectory(rollout_id: str) -> Trajectory:
    spec = TrajectorySpec("t1", "p1", "g1", 0, 1, np.arange(3, dtype=np.int32))
    return Trajectory(spec, np.arange(2, dtype=np.int32), np.zeros(2, dtype=np.float32), 0, rollout_id, 1.0)


def test_topic_policy():
    allowed = [("rollout.r0", b"hb.rollout.r0"), ("rollout.r0", b"rollout.stats.r0"), ("rollout.r0", b"log.rollout"),
               ("manager", b"weights.chain"), ("relay", b"weights.version"), ("relay", b"relay.progress.r1"),
               ("pool", b"metrics.experience_buffer"), ("pool", b"data.gate_open"), ("operator", b"ctrl.all"),
               (None, b"ctrl.all")]
    refused = [("rollout.r0", b"ctrl.all"), ("rollout.r0", b"ctrl.trainer.0"), ("rollout.r0", b"hb.rollout.r1"),
               ("rollout.r0", b"hb.relay.r1"), ("rollout.r0", b"weights.chain"), ("rollout.r0", b"weights.version"),
               ("rollout.r0", b"rollout.stats.r1"), ("rollout", b"metrics.experience_buffer"),
               ("relay", b"ctrl.all"), ("env", b"hb.manager.0"), ("rollout.r0", b"data.gate_open")]
    assert [(i, t) for i, t in allowed if auth.topic_refusal(i, t)] == []
    assert [(i, t) for i, t in refused if not auth.topic_refusal(i, t)] == []


def test_keys_identify_their_holder(keys_dir):
    assert auth.load_keys(keys_dir, "rollout", "r0").identity == "rollout.r0"
    assert auth.load_keys(keys_dir, "relay", "h3").identity == "relay"       # no key of its own: the scope's
    assert auth.load_keys(keys_dir).identity == "operator"                   # the CLI on the operator's machine
    k = auth.load_keys(keys_dir, "rollout", "r0")
    assert k.scoped and k.client_public != k.public                         # the cluster key is the server's only
    with pytest.raises(FileNotFoundError, match="env"):
        auth.load_keys(keys_dir, "env", "e0")


def test_server_refuses_and_logs_what_a_rollout_key_may_not_send(keys_dir):
    async def main():
        port = free_port()
        srv_t = transport(keys_dir, "manager")
        server = srv_t.server(f"tcp://127.0.0.1:{port}", "manager", "0")
        seen = []

        async def on_join(req):
            seen.append(("join", req.relay_id))
            return Ack()

        async def on_put(req):
            seen.append(("put", req.trajectory.rollout_id))
            return PutResult("stored")
        server.route(RelayJoin, on_join)
        server.route(PutTrajectory, on_put)
        await server.start()
        rollout_t, relay_t = transport(keys_dir, "rollout", "r0"), transport(keys_dir, "relay", "h1")
        rollout, relay = rollout_t.client(server.address), relay_t.client(server.address)
        try:
            with structlog.testing.capture_logs() as logs:
                with pytest.raises(Refused, match="forbidden"):      # a master-relay claim from a rollout key
                    await rollout.call(RelayJoin("evil", "h9", "10.0.0.9:1", "tcp://10.0.0.9:2"))
                with pytest.raises(Refused, match="rollout r1"):     # another rollout's trajectory
                    await rollout.call(PutTrajectory(trajectory("r1")))
                assert (await rollout.call(PutTrajectory(trajectory("r0")))).status == "stored"
                assert isinstance(await relay.call(RelayJoin("r-h1", "h1", "10.0.0.1:1", "tcp://10.0.0.1:2")), Ack)
            refused = [e for e in logs if e["event"] == "request_refused"]
            assert [(e["peer"], e["kind"]) for e in refused] == [("rollout.r0", "relay.join"),
                                                                 ("rollout.r0", "data.put_trajectory")]
            assert seen == [("put", "r0"), ("join", "r-h1")]      # the refused ones never reached a handler
            assert server.dispatcher.stats["forbidden"] == 2
        finally:
            for c in (rollout, relay):
                c.close()
            await server.close()
            for t in (rollout_t, relay_t, srv_t):
                await t.close()
    asyncio.run(main())


def test_broker_drops_control_commands_and_foreign_topics_from_a_rollout_key(keys_dir):
    pub_port, sub_port = free_port(), free_port()
    broker = Broker(f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{sub_port}", auth.load_keys(keys_dir, "broker"))
    broker.start()
    endpoints = {"pub": f"tcp://127.0.0.1:{pub_port}", "sub": f"tcp://127.0.0.1:{sub_port}"}

    def hb(role, rid, seq=0):
        return Heartbeat(role, rid, "h", 1, seq, 0.0, "ready")

    async def main():
        listener_t = transport(keys_dir, "node", **endpoints)
        rollout_t = transport(keys_dir, "rollout", "r0", **endpoints)
        op_t = transport(keys_dir, **endpoints)                   # the operator's CLI
        sub = listener_t.subscriber(["ctrl.", "hb.", "weights."])
        rp, op = rollout_t.publisher(), op_t.publisher()
        got: list[tuple[str, object]] = []

        async def until(pred, publish):
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                publish()
                try:
                    while True:
                        topic, ev = await asyncio.wait_for(sub.recv(), 0.2)
                        got.append((topic, ev))
                        if pred(topic, ev):
                            return
                except TimeoutError:
                    continue
            raise AssertionError(f"never received; got {got}")

        def forged(seq):
            def send():
                rp.publish("ctrl.all", Shutdown("from a rollout"))
                rp.publish("hb.relay.r-h1", hb("relay", "r-h1"))   # a relay's heartbeat, forged
                rp.publish("weights.chain", hb("manager", "0"))      # the manager's chain topic (any event)
                rp.publish("hb.rollout.r0", hb("rollout", "r0", seq))  # its own: allowed, and the marker
            return send
        try:
            # once the marker arrives the path is up; the next round's forgeries passed the
            # publisher's own filter and went to the broker before that round's marker
            await until(lambda t, e: t == "hb.rollout.r0", forged(1))
            got.clear()
            await until(lambda t, e: t == "hb.rollout.r0" and e.seq == 2, forged(2))
            assert [t for t, _ in got] == ["hb.rollout.r0"]
            await until(lambda t, e: t == "ctrl.all", lambda: op.publish("ctrl.all", Shutdown("operator")))
            assert got[-1][1].reason == "operator"
            assert not [t for t, e in got if t == "ctrl.all" and e.reason != "operator"]
            assert broker.refused["rollout.r0"] >= 3
        finally:
            sub.close()
            for p in (rp, op):
                p.close()
            for t in (listener_t, rollout_t, op_t):
                await t.close()
    try:
        with structlog.testing.capture_logs() as logs:
            asyncio.run(main())
        assert any(e["event"] == "publish_refused" and e["publisher"] == "rollout.r0" for e in logs)
    finally:
        broker.stop()


class Idle(Role):
    name = "idle"


def test_a_role_stopped_by_command_exits_with_its_own_code():
    async def main(stop_by_command: bool):
        hub = InprocHub()
        r = Idle(RoleContext(role="idle", id="0", host="h", transport=hub.transport()))
        ready = asyncio.Event()
        task = asyncio.create_task(run_role(r, heartbeat_s=0.05, stop_signals=False, on_ready=ready.set))
        await asyncio.wait_for(ready.wait(), 5)
        if stop_by_command:
            hub.transport().publisher().publish("ctrl.all", Shutdown("maintenance"))
        else:
            r.stopping.set()  # what SIGTERM does
        return await asyncio.wait_for(task, 5)
    assert asyncio.run(main(True)) == EXIT_STOPPED_BY_OPERATOR != 0
    assert asyncio.run(main(False)) == 0


def test_supervisor_keeps_a_child_stopped_by_the_operator_down(tmp_path):
    from laminar.supervisor import Child, Supervisor
    marker = tmp_path / "starts"
    code = (f"import os, sys; open({str(marker)!r}, 'a').write('x'); "
            f"os.write(int(sys.argv[2]), b'READY\\n'); sys.exit({EXIT_STOPPED_BY_OPERATOR})")
    child = Child("toy", "0", [sys.executable, "-c", code], ready_timeout_s=30)

    async def main():
        sup = Supervisor([child], shutdown_s=5)
        with structlog.testing.capture_logs() as logs:
            await sup.start()
            # every watcher ends only when its child stays down: a restarted child never lets wait() return
            await asyncio.wait_for(sup.wait(), 30)
            state = child.state
            await sup.stop()
        return logs, state
    logs, state = asyncio.run(main())
    assert state == "stopped_by_operator" and child.restarts == 0 and child.last_exit == EXIT_STOPPED_BY_OPERATOR
    assert marker.read_text() == "x"  # started once
    assert any(e["event"] == "child_stopped_by_operator" for e in logs)


def test_systemd_units_keep_a_role_stopped_by_the_operator_down(tmp_path):
    from laminar.systemd import render_units
    from tests.unit.laminar.test_security_systemd import _config, directives
    cfg, path = _config(tmp_path)
    for name, text in render_units(cfg, path, "h0", workdir=str(tmp_path), systemd_version=254).items():
        if name.endswith(".service"):
            d = directives(text)
            assert d["Restart"] == "on-failure"
            assert str(EXIT_STOPPED_BY_OPERATOR) in d["SuccessExitStatus"].split(), name
            assert str(EXIT_STOPPED_BY_OPERATOR) in d["RestartPreventExitStatus"].split(), name


def test_health_shows_a_role_stopped_by_the_operator_as_such_not_as_unhealthy():
    from tests.unit.laminar.test_health import child, fed, get, hb, parse
    c, clock = fed()
    clock.t += 4.0
    for role in ("broker", "manager", "trainer"):
        c.observe(hb(role, "0"))
    c.observe(hb("relay", "r0"))
    c.observe(hb("rollout", "1"))
    c.child_changed(child("rollout", "0", "stopped_by_operator"))
    clock.t += 2.0                                         # rollout.0 silent for 6 s: it was stopped
    s = parse(c.exposition())
    assert get(s, "laminar_role_state", role="rollout", id="0", state="stopped_by_operator") == 1
    assert "rollout.0" not in c.unhealthy()                # told to stop: not a failure to page on


def test_a_reward_key_named_after_its_scorer_publishes_its_replicas_heartbeats():
    """A reward replica's key is named after its scorer (`reward.rm`), not after the replica (rm1):
    its heartbeat on hb.reward.rm1 must pass the broker (before, every one was refused as
    another role's: with scoped keys no reward replica was ever seen up). Other roles' topics stay
    closed to it."""
    assert auth.topic_refusal("reward.rm", b"hb.reward.rm1") == ""
    assert auth.topic_refusal("reward.rm", b"metrics.reward") == ""
    for topic in (b"hb.rollout.r0", b"hb.relay.r1", b"rollout.stats.r0", b"ctrl.reward.rm1", b"weights.version"):
        assert auth.topic_refusal("reward.rm", topic), topic
