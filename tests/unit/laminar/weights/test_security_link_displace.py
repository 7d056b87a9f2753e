"""The tail of the relay chain cannot be frozen by a host that merely holds the cluster secret.

Before: a non-master relay took a LINK from anyone with the secret and dropped its real upstream
for it; each forged OFFER abandoned the version being assembled; an OFFER's size had no bound, so
a slot of any size was allocated, and the offer forwarded down the chain, before any seal could
be checked; and the stall alarm compared the trainer with the *newest* rollout, so three of four
rollouts 53 versions behind read as no lag.

Now a relay with a link key (the relay role always has one) takes a LINK only from the upstream
the manager named, proven by the manager's token in the handshake, never an older claim; a relay
link's offer is bounded by the version held (or a configured maximum, or what shared memory
holds); and the alarm looks at the slowest rollout (or a configured quantile) and names who lags.
Real relay nodes on loopback TCP and real shared-memory folders.
"""
from __future__ import annotations

import os
import shutil
import uuid

import pytest

torch = pytest.importorskip("torch")

from laminar.roles.manager.stall import StallAlarm  # noqa: E402

from laminar.weights import handshake, seal, wire  # noqa: E402
from laminar.weights.manifest import chunk_count, manifest_to_bytes, with_lineage, with_version  # noqa: E402
from laminar.weights.node import RelayNode  # noqa: E402
from laminar.weights.publisher import WeightPublisher, publish_layout  # noqa: E402
from laminar.weights.transport import LinkError, get_transport  # noqa: E402

pytestmark = pytest.mark.timeout(90)
KEY = wire.derive_key(b"d" * 32)
SIGNER = seal.Signer(bytes(range(3, 35)))
CHUNK = 8 << 10


@pytest.fixture
def nodes():
    made: list[RelayNode] = []

    def make(name: str, **kw) -> RelayNode:
        n = RelayNode(name, f"/dev/shm/laminar-test-disp-{uuid.uuid4().hex[:8]}", get_transport("tcp"), KEY,
                      verifier=SIGNER.public, **kw)
        n.start()
        made.append(n)
        return n
    yield make
    for n in made:
        n.stop()
        shutil.rmtree(n.store.dir, ignore_errors=True)


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(20_000, generator=g), "b": torch.randn(9, generator=g)}


def publish(node: RelayNode, version: int, sd: dict) -> WeightPublisher:
    pub = WeightPublisher(chunk_bytes=CHUNK, key=KEY, signer=SIGNER)
    pub.run_id, pub.lineage = "run", 1
    pub.set_target(node.address, node.id)
    pub.publish(sd, version)
    assert pub.wait_delivered(version, 20), node.status()
    return pub


def current(node: RelayNode):
    with node.store.cond:
        return None if node.store.current is None else node.store.current.version


def wait_current(node: RelayNode, version: int, timeout: float = 20.0) -> bool:
    with node.store.cond:
        return node.store.cond.wait_for(lambda: node.store.current is not None
                                        and node.store.current.version == version, timeout)


def test_link_displace_a_link_from_anyone_but_the_named_upstream_is_refused(nodes):
    """master -> tail, linked with the manager's token; a host with the cluster secret links into
    the tail (with no token, with a token for another relay id, with the upstream's old token):
    each refused at the handshake, the real upstream keeps its link and the next version arrives."""
    tail_key = os.urandom(32)
    master, tail = nodes("master"), nodes("tail", link_key=tail_key)
    master.set_downstream(tail.address, tail.id, handshake.link_token(tail_key, 7, "master"), 7)
    pub = publish(master, 1, state(1))
    try:
        assert wait_current(tail, 1), tail.status()
        upstream = tail.status()["upstream"]
        attempts = [None, (7, "evil", handshake.link_token(tail_key, 7, "master")),   # another id, stolen token
                    (6, "master", handshake.link_token(tail_key, 6, "master"))]       # an older link's token
        for claim in attempts:
            try:
                ch = handshake.connect(get_transport("tcp"), tail.address, KEY, 3.0, claim=claim)
            except LinkError:
                continue  # refused in the handshake
            with pytest.raises(LinkError):  # or taken in, then closed before it could displace anything
                ch.recv()
            ch.close()
        assert tail.status()["links_refused"] == 3
        assert tail.status()["upstream"] == upstream          # never displaced
        pub.publish(state(2), 2)
        assert pub.wait_delivered(2, 20) and wait_current(tail, 2), tail.status()
    finally:
        pub.close()


def test_link_displace_a_relay_without_a_link_key_still_takes_any_link(nodes):
    """Benchmarks and tests drive nodes without a manager: no key, no check (as before)."""
    master, tail = nodes("master"), nodes("tail")
    master.set_downstream(tail.address, tail.id)
    pub = publish(master, 1, state(3))
    try:
        assert wait_current(tail, 1)
        assert tail.status()["links_refused"] == 0
    finally:
        pub.close()


def test_link_displace_an_oversized_offer_is_refused_before_any_slot_is_allocated(nodes):
    """The named upstream (a compromised relay host) offers a version of 64 GiB, then 1 GiB, to a
    relay holding a 80 KiB version: refused at the offer; no slot file grows; the link stays."""
    tail_key = os.urandom(32)
    master, tail = nodes("master"), nodes("tail", link_key=tail_key)
    master.set_downstream(tail.address, tail.id, handshake.link_token(tail_key, 1, "master"), 1)
    pub = publish(master, 1, state(4))
    pub.close()
    assert wait_current(tail, 1)
    held = tail.store.current.manifest.total_bytes
    ch = handshake.connect(get_transport("tcp"), tail.address, KEY, 3.0,
                           claim=(2, "evil-upstream", handshake.link_token(tail_key, 2, "evil-upstream")))
    try:
        for gib in (64, 1):
            big = publish_layout((("w", torch.float32, (gib << 28,), True),), None, 16 << 20)
            m = with_lineage(with_version(big, 9), "run", 1)
            ch.send(wire.OFFER, 9, a=chunk_count(m), b=1, payload=manifest_to_bytes(m))
            h = ch.recv()
            assert h.type == wire.WANT and h.a == wire.REFUSED, h
        assert tail.status()["offers_too_large"] == 2
        assert current(tail) == 1
        sizes = [os.stat(tail.store.slot_path(s)).st_size for s in (0, 1) if tail.store.slot_path(s).exists()]
        assert max(sizes) <= held, sizes
    finally:
        ch.close()


def test_link_displace_a_configured_maximum_bounds_even_the_first_version(nodes):
    tail = nodes("tail", max_version_bytes=1 << 20)
    ch = handshake.connect(get_transport("tcp"), tail.address, KEY, 3.0)
    try:
        big = publish_layout((("w", torch.float32, (1 << 20,), True),), None, 1 << 20)  # 4 MiB
        m = with_lineage(with_version(big, 0), "run", 1)
        ch.send(wire.OFFER, 0, a=chunk_count(m), b=1, payload=manifest_to_bytes(m))
        h = ch.recv()
        assert h.a == wire.REFUSED and b"max_version_mb" in h.payload
    finally:
        ch.close()


class Log:
    def __init__(self):
        self.events: list[tuple[str, dict]] = []

    def info(self, ev, **kw):
        self.events.append((ev, kw))

    warning = info


def test_link_displace_the_stall_alarm_sees_one_rollout_left_behind_and_names_it():
    t = [0.0]
    log = Log()
    a = StallAlarm(log, lag_versions=4, after_s=10.0, clock=lambda: t[0])
    a.on_trainer(1, 60)
    fleet = [(1, 60, "r0@h0"), (1, 59, "r1@h1"), (1, 7, "r2@h2"), (1, 60, "r3@h3")]
    a.update(fleet)
    t[0] = 11.0
    a.update(fleet)
    assert a.raised and a.lag == 53
    (ev, kw), = log.events
    assert ev == "weights_stalled" and kw["lagging"] == ["r2@h2"]
    # a quantile instead: the median of four is fine while one lags
    m = StallAlarm(Log(), lag_versions=4, after_s=0.0, clock=lambda: t[0], quantile=0.5)
    m.on_trainer(1, 60)
    m.update(fleet)
    assert m.lag <= 1 and not m.raised
