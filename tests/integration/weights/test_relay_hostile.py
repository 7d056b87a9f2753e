"""The relay tier under hostile or broken data ports, with real processes (broker, manager, relays)
and the trainer side in the test process.

- 100 silent TCP connections held open to every relay's data port, then the middle relay is
  killed: the repair needs a new authenticated link into a relay whose port is being flooded, and
  the next version must still reach every live relay;
- a relay whose data port stops accepting reports it in its heartbeat and is taken out of the
  chain like a dead relay, so the relays behind it still get the next version.
"""
from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest

from tests.support import ROOT

torch = pytest.importorskip("torch")

from laminar.testing.relay_cluster import RelayCluster  # noqa: E402
from laminar.weights.transport import LinkError  # noqa: E402
from laminar.weights.transport.tcp import TcpTransport  # noqa: E402

pytestmark = pytest.mark.timeout(240)
RELAYS = ["r0", "r1", "r2", "r3"]


def make_state(version: int) -> dict:
    g = torch.Generator().manual_seed(7 + version)
    return {f"w{i}": torch.randn(256, 1024, generator=g) for i in range(8)}  # 8 MiB


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 200))


def hold_silent(address: str, n: int) -> list[socket.socket]:
    host, port = address.rsplit(":", 1)
    held = []
    for _ in range(n):
        try:
            held.append(socket.create_connection((host, int(port)), timeout=0.5))
        except OSError:
            pass
    return held


def test_silent_connections_do_not_stop_the_next_version(tmp_path: Path):
    s0, s1 = make_state(0), make_state(1)
    held: list[socket.socket] = []
    with RelayCluster(tmp_path, RELAYS) as c:
        async def go():
            async with c.trainer() as t:
                t.publisher.publish(s0, version=0)
                await t.wait_versions(0, RELAYS)
                await t.until(lambda: all(t.status.get(r, {}).get("data_address") for r in RELAYS), 20, "addresses")
                for r in RELAYS:
                    held.extend(await asyncio.to_thread(hold_silent, t.status[r]["data_address"], 100))
                print(f"\n{len(held)} silent connections held open ({len(RELAYS)} relays)")
                c.relay("r1").kill()   # the repair links r0 -> r2, into a flooded port
                await t.until(lambda: t.chain is not None and t.chain.order == ["r0", "r2", "r3"], 60, "repair")
                t.publisher.publish(s1, version=1)
                await t.wait_versions(1, ["r0", "r2", "r3"], timeout=60)
                await t.until(lambda: all(t.status.get(r, {}).get("version", -1) >= 1 for r in ("r0", "r2", "r3")),
                              20, "heartbeats after v1")
                return dict(t.status)
        try:
            status = run(go())
        finally:
            for s in held:
                s.close()
        assert len(held) >= 300, len(held)
        for r in ("r0", "r2", "r3"):
            assert status[r]["data_port_ok"] and "unhealthy" not in status[r], status[r]
        print({r: {k: status[r][k] for k in ("handshakes_refused", "handshakes_pending", "probes")} for r in status})
        repaired = c.manager.events("chain_repaired")
        assert repaired and repaired[0]["dead"] == "r1", c.manager.tail()


class DeafAfterOne(TcpTransport):
    """A relay transport whose listener goes deaf once the file named by LAMINAR_DEAF_FLAG exists
    (the test creates it when the chain is formed and v0 is everywhere): from then on every
    accept fails, on this listener and on any fresh one: a data port that is dead while the
    process lives. (Going deaf after the first accept instead raced the rest of the set-up: on a
    loaded machine the port was reported dead before the last relay had started.)"""

    def listen(self, host, port=0):
        inner = super().listen(host, port)
        flag = os.environ["LAMINAR_DEAF_FLAG"]

        class Deaf:
            address = inner.address

            def accept(self, timeout):
                if os.path.exists(flag):
                    raise LinkError(f"accept on {inner.address} failed: [Errno 24] Too many open files")
                return inner.accept(timeout)

            def close(self):
                inner.close()
        return Deaf()


def test_relay_with_a_dead_data_port_is_taken_out_and_the_rest_gets_the_next_version(tmp_path: Path):
    s0, s1 = make_state(0), make_state(1)
    per_relay = {"r2": {"transport": f"{__name__}:DeafAfterOne"}}
    flag = tmp_path / "deaf"
    env = {"PYTHONPATH": str(ROOT), "LAMINAR_DEAF_FLAG": str(flag)}
    with RelayCluster(tmp_path, RELAYS, per_relay=per_relay, env=env) as c:
        async def go():
            async with c.trainer() as t:
                t.publisher.publish(s0, version=0)
                await t.wait_versions(0, RELAYS)
                flag.touch()           # r2's data port dies, its process lives
                c.relay("r1").kill()   # r0 must now link to r2, whose port no longer accepts
                await t.until(lambda: "unhealthy" in t.status.get("r2", {}), 30, "r2 reports its dead port")
                await t.until(lambda: t.chain is not None and "r2" not in t.chain.order and "r1" not in t.chain.order,
                              60, "r2 taken out")
                t.publisher.publish(s1, version=1)
                await t.wait_versions(1, ["r0", "r3"], timeout=60)
                return t.status["r2"]
        st = run(go())
        assert not st["data_port_ok"] and "data port" in st["unhealthy"], st
        assert c.relay("r2").alive()   # the process lives: only its port is dead
