"""A relay's data port against hostile or broken peers, with real sockets in one process.

- silent TCP clients (no handshake) never delay an authenticated upstream: the handshake runs off
  the accepting thread, under a deadline, and the number waiting is bounded;
- accept() errors are survived (logged, backed off), and a data port that stays dead is reported
  in the relay's status, which turns its heartbeat into a death notice for the manager;
- the manager's probe is a real authenticated handshake that does not displace the relay's
  upstream, so a port that only accepts TCP (a backlog, a stalled relay) is not "alive".
"""
from __future__ import annotations

import asyncio
import shutil
import socket
import time
import uuid

import pytest
from laminar.bus.heartbeat import HeartbeatMonitor

from laminar.protocol import Heartbeat
from laminar.weights import handshake, wire
from laminar.weights.node import RelayNode
from laminar.weights.transport import LinkError
from laminar.weights.transport.tcp import TcpTransport

pytestmark = pytest.mark.timeout(60)
KEY = wire.derive_key(b"k" * 40)


@pytest.fixture
def shm_dir():
    d = f"/dev/shm/laminar-test-{uuid.uuid4().hex[:8]}"
    yield d
    shutil.rmtree(d, ignore_errors=True)


def wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.02)  # polling another thread's state, not synchronizing with a peer
    raise AssertionError(f"timed out waiting for {what}")


def silent_clients(address: str, n: int) -> list[socket.socket]:
    host, port = address.rsplit(":", 1)
    out = []
    for _ in range(n):
        try:
            out.append(socket.create_connection((host, int(port)), timeout=2))
        except OSError:
            pass
    return out


def test_silent_connections_do_not_block_an_authenticated_upstream(shm_dir):
    node = RelayNode("r", shm_dir, TcpTransport(), KEY, handshake_timeout_s=5.0)
    node.start()
    held = silent_clients(node.address, 100)
    try:
        print(f"\n{len(held)} silent connections held open")
        t0 = time.monotonic()
        conn = handshake.connect(TcpTransport(), node.address, KEY, timeout=3.0)  # a real upstream
        print(f"authenticated upstream connected in {time.monotonic() - t0:.3f} s")
        wait(lambda: node.upstream, 5, "upstream taken")
        st = node.status()
        assert st["data_port_ok"] and "unhealthy" not in st
        assert st["handshakes_pending"] <= node.max_pending_handshakes
        conn.close()
    finally:
        for s in held:
            s.close()
        node.stop()


class _FlakyListener:
    """Delegates to a real listener but raises for the first `fail` accepts (or always)."""

    def __init__(self, inner, fail: int):
        self.inner, self.fail, self.address = inner, fail, inner.address

    def accept(self, timeout):
        if self.fail != 0:
            self.fail -= 1
            time.sleep(0.01)
            raise LinkError(f"accept on {self.address} failed: [Errno 24] Too many open files")
        return self.inner.accept(timeout)

    def close(self):
        self.inner.close()


class FlakyTcp(TcpTransport):
    def __init__(self, fail: int):
        super().__init__()
        self.fail, self.listens = fail, 0

    def listen(self, host, port=0):
        self.listens += 1
        return _FlakyListener(super().listen(host, port), self.fail)


def test_accept_errors_are_survived(shm_dir):
    node = RelayNode("r", shm_dir, FlakyTcp(fail=3), KEY)
    node.start()
    try:
        conn = handshake.connect(TcpTransport(), node.address, KEY, timeout=5.0)
        wait(lambda: node.upstream, 5, "upstream taken")
        st = node.status()
        assert st["accept_errors"] == 3 and st["data_port_ok"], st
        conn.close()
    finally:
        node.stop()


def test_a_data_port_that_stays_dead_is_reported_unhealthy(shm_dir):
    t = FlakyTcp(fail=-1)                     # every accept fails, on every listener
    node = RelayNode("r", shm_dir, t, KEY)
    node.start()
    try:
        st = wait(lambda: (s := node.status()) and "unhealthy" in s and s, 20, "unhealthy status")
        assert not st["data_port_ok"] and "data port" in st["unhealthy"], st
        assert t.listens >= 2                 # it tried a fresh listener before giving up
    finally:
        node.stop()


def test_probe_is_a_handshake_and_does_not_displace_the_upstream(shm_dir):
    from laminar.roles.manager.chain_host import ChainHost
    node = RelayNode("r", shm_dir, TcpTransport(), KEY, idle_timeout_s=120.0)  # `up` below sends no heartbeats
    node.start()
    stalled = socket.socket()
    stalled.bind(("127.0.0.1", 0))
    stalled.listen(8)                         # accepts TCP in its backlog, never answers
    host = ChainHost(None, None, None, probe_timeout_s=0.5, data_key=KEY)
    try:
        up = handshake.connect(TcpTransport(), node.address, KEY, timeout=3.0)
        first = wait(lambda: node.upstream, 5, "upstream taken")

        async def probes():
            return (await host.probe(node.address),
                    await host.probe(f"127.0.0.1:{stalled.getsockname()[1]}"),
                    await host.probe("127.0.0.1:1"))
        alive, stalled_ok, refused = asyncio.run(probes())
        assert alive and not stalled_ok and not refused
        assert node.upstream == first and node.status()["probes"] == 1
        up.close()
    finally:
        stalled.close()
        node.stop()


def test_unhealthy_heartbeat_counts_as_dead():
    mon = HeartbeatMonitor(timeout_s=5.0)
    changes = []

    def hb(seq, status):
        return Heartbeat(role="relay", id="r1", host="h", pid=1, seq=seq, uptime_s=1.0, state="running",
                         status=status, dropped_frames=0)

    class Sub:
        def __init__(self, evs):
            self.evs = list(evs)

        async def recv(self):
            if not self.evs:
                raise asyncio.CancelledError
            return "hb.relay.r1", self.evs.pop(0)

    async def go():
        try:
            await mon.follow(Sub([hb(0, {"version": 1}), hb(1, {"unhealthy": "data port dead"}),
                                  hb(2, {"unhealthy": "data port dead"}), hb(3, {"version": 2})]),
                             lambda k, alive: changes.append((k, alive)))
        except asyncio.CancelledError:
            pass
    asyncio.run(go())
    assert changes == [("relay.r1", True), ("relay.r1", False), ("relay.r1", True)]
