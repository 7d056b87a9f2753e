"""An OFFER cannot pin a relay: "have it" means the relay holds that version (or a newer one) as
current, complete and verified, never that something newer is merely announced; and no message
on an established chunk link can be injected or altered by someone without the key, because
every message carries a MAC under a key only the two ends derived in their handshake.

Before: one OFFER(version=10**9) with no bytes left the relay `receiving: 1000000000`, every real
version was answered "have it" (and counted delivered by the sender), and rollouts froze; an
on-path attacker could inject that OFFER into a link, since control messages carried no MAC.
Real relay nodes and publishers on loopback TCP.
"""
from __future__ import annotations

import dataclasses
import shutil
import threading
import time
import uuid

import pytest

torch = pytest.importorskip("torch")

from laminar.testing.transports import WrappedConn  # noqa: E402
from laminar.weights import handshake, wire  # noqa: E402
from laminar.weights.manifest import chunk_count, manifest_to_bytes, with_lineage, with_version  # noqa: E402
from laminar.weights.node import RelayNode  # noqa: E402
from laminar.weights.publisher import WeightPublisher, publish_layout  # noqa: E402
from laminar.weights.transport import get_transport  # noqa: E402
from laminar.weights.transport.tcp import TcpTransport  # noqa: E402

pytestmark = pytest.mark.timeout(60)
KEY = wire.derive_key(b"p" * 32)
CHUNK = 16 << 10
HUGE = 10 ** 9


@pytest.fixture
def node():
    n = RelayNode("r", f"/dev/shm/laminar-test-pin-{uuid.uuid4().hex[:8]}", get_transport("tcp"), KEY)
    n.start()
    yield n
    n.stop()
    shutil.rmtree(n.store.dir, ignore_errors=True)


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(30_000, generator=g), "b": torch.randn(7, generator=g)}


def inflated_offer() -> tuple[wire.Header, bytes]:
    layout = publish_layout((("w", torch.float32, (30_000,), True), ("b", torch.float32, (7,), True)), None, CHUNK)
    m = with_lineage(with_version(layout, HUGE), "run", 1)
    payload = manifest_to_bytes(m)
    return wire.Header(wire.OFFER, HUGE, chunk_count(m), 1, len(payload)), payload


def wait_current(node: RelayNode, version: int, timeout: float) -> bool:
    with node.store.cond:
        return node.store.cond.wait_for(lambda: node.store.current is not None
                                        and node.store.current.version == version, timeout)


def test_an_inflated_offer_without_bytes_does_not_pin_the_relay(node):
    """A peer that holds the key (any relay host) offers version 10**9 and sends nothing."""
    header, payload = inflated_offer()
    pinner = handshake.connect(get_transport("tcp"), node.address, KEY, 3.0)
    pinner.send(wire.OFFER, HUGE, a=header.a, b=header.b, payload=payload)
    assert pinner.recv().type == wire.WANT  # the relay took the offer in
    pinner.close()
    pub = WeightPublisher(chunk_bytes=CHUNK, key=KEY)
    pub.run_id, pub.lineage = "run", 1
    try:
        pub.set_target(node.address, node.id)
        pub.publish(state(0), 1)
        assert wait_current(node, 1, 15.0), f"the relay stayed pinned: {node.status()}"
        assert pub.wait_delivered(1, 5)
        assert node.status()["receiving"] != HUGE
    finally:
        pub.close()


class _Injector(WrappedConn):
    """An on-path attacker (no key) who slips an inflated OFFER into the publisher's link right
    after the handshake, ahead of the publisher's own first message."""

    def __init__(self, inner, owner):
        super().__init__(inner)
        self.owner, self.welcomed = owner, False

    def recv_header(self, size):
        raw = self.inner.recv_header(size)
        if not self.welcomed and wire.unpack(raw).type == wire.WELCOME:
            self.welcomed = True
            with self.owner.lock:
                if not self.owner.injected:
                    self.owner.injected = True
                    header, payload = inflated_offer()
                    self.inner.send(header.pack(), payload)
        return raw


class InjectingTcp(TcpTransport):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.injected = False
        self.lock = threading.Lock()

    def connect(self, address, timeout):
        return _Injector(super().connect(address, timeout), self)


def test_an_injected_offer_on_an_established_link_is_refused(node):
    tr = InjectingTcp()
    pub = WeightPublisher(chunk_bytes=CHUNK, transport=tr, key=KEY, reconnect_s=0.2)
    pub.run_id, pub.lineage = "run", 1
    seen = []
    try:
        pub.set_target(node.address, node.id)
        pub.publish(state(1), 1)
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline and not wait_current(node, 1, 0.05):
            seen.append(node.status()["receiving"])
        assert tr.injected
        assert HUGE not in seen, "the relay took an OFFER nobody with the key sent"
        assert wait_current(node, 1, 1.0), f"{node.status()}"
    finally:
        pub.close()


def test_have_it_means_held_as_current(node):
    """The store's rule, directly: an offer older than what is incoming but newer than what is
    current is not 'have it'."""
    from laminar.weights.manifest import build_manifest
    m = with_lineage(build_manifest([("w", "float32", (4096,))], 0, 4096), "run", 1)
    with node.store.cond:
        kind, inc = node.store.begin(with_version(m, 50))
        assert (kind, inc.version) == ("take", 50)
        kind, got = node.store.begin(with_version(m, 7))
        assert (kind, got.version) == ("take", 7), "an offer newer than current was answered 'have it' (v50 incoming)"
        assert inc.abandoned and node.store.incoming is got
        kind, _ = node.store.begin(with_version(m, 5), older="busy")  # parts: an older offer waits, never 'have it'
        assert kind == "busy"
        m6 = dataclasses.replace(with_version(m, 6), lineage=0)
        assert node.store.begin(m6)[0] == "take"
