"""Weights come from the trainer or from nowhere: a host that holds the cluster secret (every
host does; a compromised rollout host is the case in point) cannot get its own bytes loaded by
rollouts, neither through a part upstream at the master (where, first writer winning, its ranges
used to become the version and the master then computed valid MACs over them) nor as a whole
upstream. Each version carries seals signed by a key only trainer hosts hold, checked by every
relay before it makes the version visible and by the rollout before it loads it; part upstreams
must prove they hold that key in their handshake. Real relay nodes and publishers on loopback.
"""
from __future__ import annotations

import shutil
import time
import uuid

import pytest

torch = pytest.importorskip("torch")

from laminar.weights import seal, wire  # noqa: E402
from laminar.weights.node import RelayNode  # noqa: E402
from laminar.weights.publisher import WeightPublisher  # noqa: E402
from laminar.weights.pull import LocalWeights  # noqa: E402
from laminar.weights.transport import get_transport  # noqa: E402

pytestmark = pytest.mark.timeout(60)
KEY = wire.derive_key(b"f" * 32)   # the cluster's data-plane key: every host has it
CHUNK = 4096
SIGNER = seal.Signer(bytes(range(32)))  # the trainer's signing key: on trainer hosts only
TRAINER = {"signer": SIGNER}                   # what makes a publisher the trainer's
CHECKED = {"verifier": SIGNER.public}          # what makes a relay check seals (the public key)
READER = {"verify_key": SIGNER.public.raw}     # ... and a rollout's reader


@pytest.fixture
def node():
    n = RelayNode("m", f"/dev/shm/laminar-test-sign-{uuid.uuid4().hex[:8]}", get_transport("tcp"), KEY, **CHECKED)
    n.start()
    yield n
    n.stop()
    shutil.rmtree(n.store.dir, ignore_errors=True)


def weights(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(97, 33, generator=g), "norm": torch.randn(33, generator=g),
            "head": torch.randn(50, 33, generator=g)}


def part(state: dict, node: RelayNode, rows: dict, version: int, **kw) -> WeightPublisher:
    """A part publisher sending, of each tensor, the rows `rows[name]` = (first, stop)."""
    pub = WeightPublisher(chunk_bytes=CHUNK, key=KEY, part=True, reconnect_s=0.2, **kw)
    pub.run_id, pub.lineage = "run", 1
    layout = pub.layout_of((k, t.dtype, t.shape, True) for k, t in state.items())
    _, slot = pub.begin(layout, version)
    buf, ranges = memoryview(pub.slots[slot]), []
    for name, (first, stop) in rows.items():
        i = layout.names.index(name)
        t = state[name]
        row = (t[0].numel() if t.dim() > 1 else 1) * t.element_size()
        data = t[first:stop].contiguous().numpy().tobytes()
        off = layout.offsets[i] + first * row
        buf[off:off + len(data)] = data
        ranges.append((off, len(data)))
    pub.commit(slot, layout, version, ranges=ranges)
    pub.set_target(node.address, node.id)
    return pub


HOST0 = {"embed": (0, 49), "norm": (0, 17), "head": (0, 25)}
HOST1 = {"embed": (49, 97), "norm": (17, 33), "head": (25, 50)}


def test_a_host_without_the_trainer_key_cannot_forge_a_part(node):
    honest = weights(0)
    forged = {k: torch.full_like(t, 7.0) for k, t in honest.items()}
    evil = part(forged, node, HOST1, 1)  # a rollout host, holding the cluster secret, is first
    evil.wait_delivered(1, 3.0)
    pubs = [part(honest, node, HOST0, 1, **TRAINER), part(honest, node, HOST1, 1, **TRAINER)]
    try:
        assert all(p.wait_delivered(1, 20) for p in pubs), node.status()
        with node.store.cond:
            assert node.store.cond.wait_for(lambda: node.store.current is not None, 10)
        with LocalWeights(node.store.dir, **READER).latest() as pulled:
            got = pulled.state_dict()
            for k in honest:
                assert torch.equal(got[k], honest[k]), f"{k}: forged bytes were loaded"
        assert not evil.wait_delivered(1, 0.1)
        assert node.status()["handshakes_refused"] >= 1  # its part link never got past the handshake
    finally:
        evil.close()
        for p in pubs:
            p.close()


def test_a_whole_version_from_a_host_without_the_trainer_key_never_becomes_visible(node):
    """As a publisher its handshake is refused; as a relay upstream (what a relay host may be) its
    version arrives, but its seal is not the trainer's: never made visible, counted, link ended."""
    trainer = WeightPublisher(chunk_bytes=CHUNK, key=KEY, **TRAINER)
    trainer.run_id, trainer.lineage = "run", 1
    evil = WeightPublisher(chunk_bytes=CHUNK, key=KEY)
    evil.run_id, evil.lineage = "run", 1
    # the attacker's own relay (its code checks nothing), fed by its own publisher
    evil_relay = RelayNode("evil", f"/dev/shm/laminar-test-sign-{uuid.uuid4().hex[:8]}", get_transport("tcp"), KEY)
    evil_relay.start()
    honest = weights(1)
    forged = {k: torch.zeros_like(t) for k, t in honest.items()}
    try:
        trainer.set_target(node.address, node.id)
        trainer.publish(honest, 1)
        assert trainer.wait_delivered(1, 20)
        trainer.close()
        evil.set_target(node.address, node.id)      # as the master's publisher ...
        evil.publish(forged, 2)
        assert not evil.wait_delivered(2, 2.0)       # ... refused at the handshake
        assert node.status()["handshakes_refused"] >= 1
        evil.set_target(evil_relay.address, "evil")
        assert evil.wait_delivered(2, 20)
        evil_relay.set_downstream(node.address, node.id)   # as a relay upstream of the master
        deadline = time.monotonic() + 20
        while node.status()["seals_refused"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)  # polling the relay's counters
        assert node.status()["seals_refused"] >= 1
        with node.store.cond:
            assert node.store.current.version == 1
        with LocalWeights(node.store.dir, **READER).latest() as pulled:
            assert torch.equal(pulled.state_dict()["norm"], honest["norm"])
    finally:
        trainer.close()
        evil.close()
        evil_relay.stop()
        shutil.rmtree(evil_relay.store.dir, ignore_errors=True)


def test_a_reader_refuses_a_version_sealed_by_another_key_or_not_at_all(node):
    """A rollout's reader checks the seals itself: bytes a relay of another (or no) key let
    through, or a pointer someone rewrote, are never loaded."""
    import dataclasses

    import msgpack

    from laminar.weights.manifest import manifest_from_bytes, manifest_to_bytes
    from laminar.weights.pull import WeightsRefused
    from laminar.weights.store import CURRENT
    other = seal.Signer(bytes(range(1, 33)))
    pub = WeightPublisher(chunk_bytes=CHUNK, key=KEY, signer=SIGNER)
    pub.run_id, pub.lineage = "run", 1
    try:
        pub.set_target(node.address, node.id)
        pub.publish(weights(2), 1)
        assert pub.wait_delivered(1, 20)
    finally:
        pub.close()
    with LocalWeights(node.store.dir, **READER).latest() as pulled:
        assert len(pulled.manifest.seals) == 1
    with pytest.raises(WeightsRefused, match="signature"):
        LocalWeights(node.store.dir, verify_key=other.public.raw).latest()
    ptr = msgpack.unpackb((node.store.dir / CURRENT).read_bytes())
    m = manifest_from_bytes(ptr["manifest"])
    ptr["manifest"] = manifest_to_bytes(dataclasses.replace(m, seals=[]))
    (node.store.dir / CURRENT).write_bytes(msgpack.packb(ptr))
    with pytest.raises(WeightsRefused, match="no seal"):
        LocalWeights(node.store.dir, **READER).latest()


def test_a_multi_host_version_goes_down_the_chain_with_every_hosts_seal(node):
    """The master assembles the version from two hosts' parts, each sealed by its host; the relay
    after it checks those seals against the bytes (pieces, not chunks) before making it visible,
    and a reader after that again."""
    down = RelayNode("d", f"/dev/shm/laminar-test-sign-{uuid.uuid4().hex[:8]}", get_transport("tcp"), KEY, **CHECKED)
    down.start()
    honest = weights(3)
    pubs = []
    try:
        node.set_downstream(down.address, down.id)
        pubs = [part(honest, node, HOST0, 1, **TRAINER), part(honest, node, HOST1, 1, **TRAINER)]
        with down.store.cond:
            assert down.store.cond.wait_for(lambda: down.store.current is not None, 20), down.status()
        with LocalWeights(down.store.dir, **READER).latest() as pulled:
            assert len(pulled.manifest.seals) == 2
            got = pulled.state_dict()
            assert all(torch.equal(got[k], honest[k]) for k in honest)
        assert down.status()["seals_refused"] == 0 and node.status()["seals_refused"] == 0
    finally:
        for p in pubs:
            p.close()
        down.stop()
        shutil.rmtree(down.store.dir, ignore_errors=True)
