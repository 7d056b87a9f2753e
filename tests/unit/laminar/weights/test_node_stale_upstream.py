"""A relay never stays tied to an upstream that is gone: an upstream that stopped (a SIGSTOPped
old master: its connection open, nothing sent, no FIN) is dropped after the link's idle timeout,
a relay that becomes master drops the relay upstream it still has, and a relay that re-joins the
chain drops both its old links. Otherwise a promoted master refuses every part upstream for as
long as the stale link lasts (hours, with the system's keep-alive), and the weights freeze.

Real relay nodes and publishers on loopback TCP; the stopped upstream is an authenticated
connection that goes silent, which is what a stopped process looks like on the wire.
"""
from __future__ import annotations

import asyncio
import shutil
import time
import types
import uuid

import pytest
import structlog

torch = pytest.importorskip("torch")

from laminar.roles.relay.role import RelayRole  # noqa: E402

from laminar.protocol import ChainAssignment, ChainState  # noqa: E402
from laminar.weights import handshake, wire  # noqa: E402
from laminar.weights.node import RelayNode  # noqa: E402
from laminar.weights.publisher import WeightPublisher  # noqa: E402
from laminar.weights.transport import get_transport  # noqa: E402

pytestmark = pytest.mark.timeout(60)
KEY = wire.derive_key(b"u" * 32)
CHUNK = 4096


@pytest.fixture
def nodes():
    made: list[RelayNode] = []

    def make(name: str) -> RelayNode:
        n = RelayNode(name, f"/dev/shm/laminar-test-stale-{uuid.uuid4().hex[:8]}", get_transport("tcp"), KEY)
        n.idle_timeout_s = 1.0  # a link silent this long is dead (heartbeats go every fraction of it)
        n.start()
        made.append(n)
        return n
    yield make
    for n in made:
        n.stop()
        shutil.rmtree(n.store.dir, ignore_errors=True)


def weights(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(97, 33, generator=g), "w1": torch.randn(301, 7, generator=g)}


def part_publishers(state: dict, node: RelayNode, version: int = 1) -> list[WeightPublisher]:
    """Two hosts' part publishers (each its own half of every tensor's rows), linked to `node`."""
    pubs = []
    for p in range(2):
        pub = WeightPublisher(chunk_bytes=CHUNK, key=KEY, part=True, reconnect_s=0.2)
        pub.run_id, pub.lineage = "run", 1
        layout = pub.layout_of((k, t.dtype, t.shape, True) for k, t in state.items())
        _, slot = pub.begin(layout, version)
        buf, ranges = memoryview(pub.slots[slot]), []
        for i, name in enumerate(layout.names):
            t = state[name]
            per = -(-t.shape[0] // 2)
            first, stop = p * per, min(t.shape[0], (p + 1) * per)
            row = t[0].numel() * t.element_size()
            data = t[first:stop].contiguous().numpy().tobytes()
            off = layout.offsets[i] + first * row
            buf[off:off + len(data)] = data
            ranges.append((off, len(data)))
        pub.commit(slot, layout, version, ranges=ranges)
        pubs.append(pub)
    for pub in pubs:
        pub.set_target(node.address, node.id)
    return pubs


def wait(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)  # polling another thread's state
    return False


def test_a_stopped_upstream_does_not_keep_a_promoted_master_from_taking_parts(nodes):
    """The old master was stopped while it streamed to this relay, which the manager then made
    master: the parts of a multi-host trainer must get in once the silent link is given up."""
    m = nodes("m")
    stale = handshake.connect(get_transport("tcp"), m.address, KEY, 3.0)  # the old master, then SIGSTOP
    pubs = []
    try:
        assert wait(lambda: m.upstream != "", 5.0)
        t0 = time.monotonic()
        pubs = part_publishers(weights(1), m)
        assert all(p.wait_delivered(1, 15) for p in pubs), f"parts refused: {m.status()}"
        print(f"\nparts in {time.monotonic() - t0:.2f} s after the old master went silent")
        assert m.status()["version"] == 1
    finally:
        stale.close()
        for p in pubs:
            p.close()


def test_a_relay_made_master_drops_the_relay_upstream_it_still_has(nodes):
    """The manager took the old master out while it was alive (e.g. stopped past dead_after_s and
    continued): its forwarder still streams to the new master. The new master drops it."""
    old, new = nodes("old"), nodes("new")
    old.set_downstream(new.address, new.id)
    assert wait(lambda: new.upstream != "", 5.0)
    new.become_master()
    assert wait(lambda: new.upstream == "", 5.0), new.status()
    pubs = part_publishers(weights(2), new)
    try:
        assert all(p.wait_delivered(1, 15) for p in pubs), f"parts refused: {new.status()}"
    finally:
        for p in pubs:
            p.close()


class _Sub:
    def __init__(self):
        self.q: asyncio.Queue = asyncio.Queue()

    async def recv(self):
        return "weights.chain", await self.q.get()


class _Node:
    """The relay role's view of its node (a unit test of the role's wiring)."""

    def __init__(self):
        self.calls: list[str] = []
        self.master = False

    def status(self) -> dict:
        return {"version": 3}

    def become_master(self) -> None:
        self.calls.append("master")
        self.master = True

    link_key = b"k" * 32

    def reset_links(self, link_key: bytes = b"") -> None:
        self.calls.append("reset")
        self.master = False


def _relay() -> RelayRole:
    r = RelayRole.__new__(RelayRole)
    r.ctx = types.SimpleNamespace(id="r1", role="relay", host="h0")
    r.settings = types.SimpleNamespace(rejoin_grace_s=0.0, join_timeout_s=5.0)
    r.log = structlog.get_logger("test")
    r.joined_at = -1e9
    r.epoch = 2
    r.chain_sub = _Sub()
    r.node = _Node()
    r.data_address, r.control_address, r.shm_dir = "127.0.0.1:1", "tcp://127.0.0.1:2", "/dev/shm/x"
    return r


def test_the_role_tells_its_node_when_it_becomes_master_and_resets_links_before_rejoining():
    async def go():
        r = _relay()
        joined: list = []

        class Manager:
            async def call(self, req, timeout):
                joined.append(list(r.node.calls))  # what the node had done when the join went out
                return ChainAssignment(epoch=9, upstream_id="r0", is_master=False)
        r.manager = Manager()
        task = asyncio.create_task(r._follow_chain())
        await r.chain_sub.q.put(ChainState(epoch=3, order=["r1", "r2"], master_id="r1", master_address="x:1"))
        for _ in range(100):
            if "master" in r.node.calls:
                break
            await asyncio.sleep(0.01)
        assert r.node.calls == ["master"]  # the old master is gone: this relay has no upstream now
        await r.chain_sub.q.put(ChainState(epoch=4, order=["r2"], master_id="r2", master_address="x:1"))
        for _ in range(100):
            if joined:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        assert joined == [["master", "reset"]]  # old links dropped before it joined at the tail
    asyncio.run(go())


def test_a_master_takes_no_relay_upstream_so_nobody_pushes_the_trainers_link_off(nodes):
    """Only the trainer feeds a master: a relay link to it (a stale old master reconnecting, or a
    relay host trying to displace the trainer's link) is closed, and the trainer's stays."""
    m = nodes("m")
    m.become_master()
    pub = WeightPublisher(chunk_bytes=CHUNK, key=KEY)
    pub.run_id, pub.lineage = "run", 1
    try:
        pub.set_target(m.address, m.id)
        pub.publish(weights(3), 1)
        assert pub.wait_delivered(1, 15)
        trainer_link = m.upstream
        pusher = handshake.connect(get_transport("tcp"), m.address, KEY, 3.0)  # purpose LINK
        assert wait(lambda: m.status()["links_refused_as_master"] == 1, 5.0)
        assert m.upstream == trainer_link
        pusher.close()
        pub.publish(weights(4), 2)
        assert pub.wait_delivered(2, 15)
    finally:
        pub.close()


def test_a_sender_gives_up_a_downstream_that_stopped(nodes):
    """The forwarder's side: a downstream that completed its handshake and then stopped (no
    heartbeat, nothing read) is reported as a lost link in about the idle timeout."""
    import socket
    import threading

    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)
    held = []

    def stopped_downstream():
        from laminar.weights.transport.tcp import TcpConn
        s, _ = lst.accept()
        conn = TcpConn(s, 30.0)
        handshake.server_handshake(conn, KEY)  # then it is stopped: never reads or sends again
        held.append(conn)
    threading.Thread(target=stopped_downstream, daemon=True).start()
    events: list = []
    a = nodes("a")
    a.on_event = lambda kind, **kw: events.append(kind)
    t0 = time.monotonic()
    a.set_downstream(f"127.0.0.1:{lst.getsockname()[1]}", "stopped")
    assert wait(lambda: "link_down" in events, 10.0), events
    print(f"\nstopped downstream given up after {time.monotonic() - t0:.2f} s (idle timeout {a.idle_timeout_s} s)")
    for c in held:
        c.close()
    lst.close()
