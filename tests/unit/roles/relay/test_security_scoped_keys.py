"""The relay tier runs with scoped keys (real processes: broker, manager, two relays; the trainer
side in this process with the trainer key): the chain forms, a version reaches both relays with
its seal in shared memory and loads under the seal check, while a rollout key's master-relay
claim is refused and its forged Shutdown stops nobody."""
from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch")

from laminar.bus import auth  # noqa: E402
from laminar.bus.errors import Refused  # noqa: E402
from laminar.bus.zmq_transport import ZmqTransport  # noqa: E402

from laminar.protocol import RelayJoin, Shutdown  # noqa: E402
from laminar.testing.relay_cluster import RelayCluster  # noqa: E402
from laminar.weights.pull import LocalWeights  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def test_relay_tier_with_scoped_keys(tmp_path):
    c = RelayCluster(tmp_path, ["r0", "r1"])
    keys_dir = tmp_path / "keys"
    for ident in ("operator", "node", "broker", "manager", "relay", "trainer", "rollout.x"):
        auth.generate_client_key(keys_dir, ident)
    c.keys = auth.load_keys(keys_dir, "trainer")      # what the trainer side presents
    sd = {"w": torch.randn(1 << 18), "b": torch.randn(7, 5)}
    with c:
        async def main():
            async with c.trainer(chunk_bytes=256 << 10) as t:
                v = t.publisher.publish(sd)
                await t.wait_versions(v, ["r0", "r1"])
                rollout = ZmqTransport(f"tcp://127.0.0.1:{c.broker_ports[0]}",
                                       f"tcp://127.0.0.1:{c.broker_ports[1]}", auth.load_keys(keys_dir, "rollout", "x"))
                try:
                    with pytest.raises(Refused, match="forbidden"):
                        await rollout.client(f"tcp://127.0.0.1:{c.manager_port}").call(
                            RelayJoin("evil", "h0", "127.0.0.1:9", "tcp://127.0.0.1:9"), timeout=10)
                    pub = rollout.publisher()
                    for _ in range(10):
                        pub.publish("ctrl.all", Shutdown("forged by a rollout key"))
                        await asyncio.sleep(0.1)
                    pub.close()
                finally:
                    await rollout.close()
                v2 = t.publisher.publish({k: x + 1 for k, x in sd.items()})
                await t.wait_versions(v2, ["r0", "r1"])     # the tier still works after the forgeries
                return v2
        v2 = asyncio.run(main())
        assert all(p.alive() for p in c.procs.values())      # nobody was stopped
        for r in ("r0", "r1"):
            with LocalWeights(c.shm[r], verify_key=c.keys.weights_public).latest() as pulled:  # the seal checked
                assert pulled.version == v2 and len(pulled.manifest.seals) == 1
                assert torch.equal(pulled.state_dict()["b"], sd["b"] + 1)
