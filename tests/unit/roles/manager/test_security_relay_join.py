"""`relay.join` cannot take over another relay's place in the chain. A relay key named after a
relay (`relay.r1`, on r1's host only) joins as that relay and no other; a key without a name
cannot displace a relay that is alive at another data address (a restarted relay is not alive,
and a relay re-joining from the same address is itself). Before, any relay key (every rollout
host has one) could join as any id: the real relay was unlinked but still listed, so it never
joined again, and the attacker's relay fed its rollouts.

Real processes (broker, manager, two relays) with scoped keys; the attacker is a bus client in
this process holding r1's key, with a relay node of its own as the data address it announces.
"""
from __future__ import annotations

import asyncio
import shutil
import uuid

import pytest

torch = pytest.importorskip("torch")

from laminar.bus import auth  # noqa: E402
from laminar.bus.errors import Refused  # noqa: E402
from laminar.bus.zmq_transport import ZmqTransport  # noqa: E402

from laminar.protocol import RelayJoin  # noqa: E402
from laminar.testing.relay_cluster import RelayCluster  # noqa: E402
from laminar.weights.node import RelayNode  # noqa: E402
from laminar.weights.transport import get_transport  # noqa: E402
from laminar.weights.wire import derive_key  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def test_a_relay_key_joins_only_as_its_own_relay_and_cannot_displace_a_live_one(tmp_path):
    c = RelayCluster(tmp_path, ["r0", "r1"])
    keys_dir = tmp_path / "keys"
    for ident in ("operator", "node", "broker", "manager", "relay", "relay.r0", "relay.r1", "trainer"):
        auth.generate_client_key(keys_dir, ident)
    c.keys = auth.load_keys(keys_dir, "trainer")
    evil_node = RelayNode("evil", f"/dev/shm/laminar-test-join-{uuid.uuid4().hex[:8]}", get_transport("tcp"),
                          derive_key(c.keys.secret))
    evil_node.start()
    sd = {"w": torch.randn(1 << 16)}
    try:
        with c:
            async def main():
                async with c.trainer(chunk_bytes=64 << 10) as t:
                    v = t.publisher.publish(sd)
                    await t.wait_versions(v, ["r0", "r1"])
                    order = list(t.chain.order)
                    bus = f"tcp://127.0.0.1:{c.broker_ports[0]}", f"tcp://127.0.0.1:{c.broker_ports[1]}"
                    manager = f"tcp://127.0.0.1:{c.manager_port}"
                    fake = RelayJoin("r0", "h0", evil_node.address, "tcp://127.0.0.1:9")
                    for who in (("relay", "r1"), ("relay", None)):   # r1's own key; a key without a name
                        evil = ZmqTransport(*bus, auth.load_keys(keys_dir, *who))
                        try:
                            with pytest.raises(Refused):
                                await evil.client(manager).call(fake, timeout=10)
                        finally:
                            await evil.close()
                    await asyncio.sleep(1.0)  # a ChainState or two: nothing moved
                    assert list(t.chain.order) == order == ["r0", "r1"]
                    assert evil_node.status()["upstream"] == ""   # nobody links to the attacker
                    v2 = t.publisher.publish({"w": sd["w"] + 1})
                    await t.wait_versions(v2, ["r0", "r1"])
            asyncio.run(main())
    finally:
        evil_node.stop()
        shutil.rmtree(evil_node.store.dir, ignore_errors=True)


def test_a_key_without_a_name_takes_over_an_id_only_from_a_relay_dead_for_the_whole_window():
    """Before: a `relay` key without a name took over relay r0's id after one failed probe of r0
    (1 s: a loaded host, or a flood of connections at its port, is enough). Now such a key must
    find r0 unanswering for the whole takeover window (the heartbeat deadline); r0's own key
    (a restart at a new port) still needs only one failed probe."""
    import structlog
    from laminar.bus.rpc import current_peer
    from laminar.roles.manager.chain_host import ChainHost

    class Pub:
        def publish(self, topic, ev):
            pass

    async def main():
        host = ChainHost(None, Pub(), structlog.get_logger("test"))
        host.takeover_s = 1.0  # the heartbeat deadline (dead_after_s) in a cluster
        answers = {"tcp-a": [True]}

        async def probe(address):  # r0 at tcp-a: slow once, then answering again
            seq = answers.setdefault(address, [])
            return seq.pop(0) if seq else address == "tcp-a"
        host.probe = probe
        token = current_peer.set("relay.r0")
        try:
            await host.on_join(RelayJoin("r0", "h0", "tcp-a", "tcp://c-a"))
        finally:
            current_peer.reset(token)
        answers["tcp-a"] = [False]  # one probe fails
        token = current_peer.set("relay")  # a key without a name
        try:
            with pytest.raises(Exception, match="alive"):
                await host.on_join(RelayJoin("r0", "h9", "tcp-evil", "tcp://c-evil"))
        finally:
            current_peer.reset(token)
        assert host.coord.relays["r0"].data_address == "tcp-a"
        answers["tcp-a"] = [False] * 1000   # r0 really gone: the id is free after the window
        token = current_peer.set("relay")
        try:
            await host.on_join(RelayJoin("r0", "h1", "tcp-b", "tcp://c-b"))
        finally:
            current_peer.reset(token)
        assert host.coord.relays["r0"].data_address == "tcp-b"
        answers["tcp-b"] = [False]          # r0's own key, restarted at a new port: one failed probe will do
        token = current_peer.set("relay.r0")
        try:
            await host.on_join(RelayJoin("r0", "h1", "tcp-c", "tcp://c-c"))
        finally:
            current_peer.reset(token)
        assert host.coord.relays["r0"].data_address == "tcp-c"
    asyncio.run(main())
