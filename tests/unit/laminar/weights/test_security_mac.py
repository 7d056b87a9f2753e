"""Weight bytes are authenticated end to end: a chunk changed on the way is asked for again; an
on-path attacker who changes a chunk and fixes up the digest beside it, or forges the manifest,
breaks the link's message MAC, so the relay ends the link and takes nothing of it; and a rollout
pull refuses a version whose bytes or manifest are not what the trainer sealed.

The attacker is a chunk transport wrapper on the link between two relays: it sees every message
of the wire protocol after the handshake and may rewrite any of it, but it does not hold the
cluster key (nor the link's keys derived from it).
"""
from __future__ import annotations

import dataclasses
import shutil
import threading
import uuid

import msgpack
import pytest

torch = pytest.importorskip("torch")

from laminar.testing.transports import WrappedConn  # noqa: E402
from laminar.weights import seal, wire  # noqa: E402
from laminar.weights.manifest import manifest_from_bytes, manifest_to_bytes  # noqa: E402
from laminar.weights.node import RelayNode  # noqa: E402
from laminar.weights.publisher import WeightPublisher  # noqa: E402
from laminar.weights.pull import LocalWeights, WeightsRefused  # noqa: E402
from laminar.weights.store import CURRENT, read_pointer  # noqa: E402
from laminar.weights.transport import get_transport  # noqa: E402
from laminar.weights.transport.tcp import TcpTransport  # noqa: E402

KEY = wire.derive_key(b"s" * 32)
SIGNER = seal.Signer(bytes(range(32)))
CHUNK = 64 << 10


class _Mitm(WrappedConn):
    """A connection whose outgoing messages an attacker rewrites (see the module docstring)."""

    def __init__(self, inner, owner):
        super().__init__(inner)
        self.owner = owner

    def send(self, header, payload=None):
        h = wire.unpack(header)
        if h.type == wire.CHUNK and payload is not None and self.owner.flip(h.version, h.a):
            bad = bytearray(payload)
            bad[len(bad) // 3] ^= 0x40
            payload = bytes(bad)
            if self.owner.fix_digest:  # the unkeyed digest, fixed up: the header's MAC then fails
                header = dataclasses.replace(h, digest=wire.content_digest(payload)).pack()
            self.owner.flipped.append((h.version, h.a))
        elif h.type == wire.OFFER and payload is not None and self.owner.forge_shape:
            m = manifest_from_bytes(bytes(payload))
            i = m.names.index("m")
            shapes = [list(s) for s in m.shapes]
            shapes[i] = list(reversed(shapes[i]))  # same bytes, another tensor: what a forger would do
            payload = manifest_to_bytes(dataclasses.replace(m, shapes=shapes))
            header = dataclasses.replace(h, length=len(payload)).pack()
            self.owner.forged += 1
        self.inner.send(header, payload)


class MitmTcp(TcpTransport):
    def __init__(self, flip_chunk: int = -1, forge_shape: bool = False, fix_digest: bool = False, **kw):
        super().__init__(**kw)
        self.flip_chunk, self.forge_shape, self.fix_digest = flip_chunk, forge_shape, fix_digest
        self.flipped: list = []
        self.forged = 0
        self.lock = threading.Lock()

    def flip(self, version: int, index: int) -> bool:
        with self.lock:
            return index == self.flip_chunk and (version, index) not in self.flipped

    def connect(self, address, timeout):
        return _Mitm(super().connect(address, timeout), self)


@pytest.fixture
def chain():
    made, nodes = [], []

    def make(upstream_transport):
        events: list = []
        for i, tr in enumerate((upstream_transport, get_transport("tcp"))):
            d = f"/dev/shm/laminar-unit-mac-{uuid.uuid4().hex[:10]}"
            made.append(d)
            node = RelayNode(f"n{i}", d, tr, KEY, on_event=lambda kind, _i=i, **kw: events.append((_i, kind, kw)),
                             verifier=SIGNER.public)
            node.start()
            nodes.append(node)
        nodes[0].set_downstream(nodes[1].address, nodes[1].id)
        return nodes[0], nodes[1], events
    yield make
    for n in nodes:
        n.stop()
    for d in made:
        shutil.rmtree(d, ignore_errors=True)


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(96 << 10, generator=g), "m": torch.randn(4, 8, generator=g)}


def wait(node: RelayNode, pred, timeout: float = 20.0) -> bool:
    with node.store.cond:
        return node.store.cond.wait_for(pred, timeout)


def publisher() -> WeightPublisher:
    return WeightPublisher(chunk_bytes=CHUNK, key=KEY, signer=SIGNER)


def test_a_flipped_chunk_is_asked_for_again(chain):
    mitm = MitmTcp(flip_chunk=1)
    a, b, events = chain(mitm)
    pub = publisher()
    try:
        pub.set_target(a.address, a.id)
        sd = state(1)
        v = pub.publish(sd)
        assert wait(b, lambda: b.store.current is not None and b.store.current.version >= v)
        assert mitm.flipped == [(v, 1)]
        # the relay refused the altered chunk, reported it, and the chunk came again intact
        assert b.corrupt >= 1 and ("corrupt" in [k for i, k, _ in events if i == 1])
        with LocalWeights(b.store.dir, verify_key=SIGNER.public.raw).latest() as pulled:
            got = pulled.state_dict()
            assert all(torch.equal(got[k], sd[k]) for k in sd)
    finally:
        pub.close()


def test_a_flipped_chunk_with_a_fixed_up_digest_ends_the_link_and_is_never_taken(chain):
    mitm = MitmTcp(flip_chunk=1, fix_digest=True)
    a, b, events = chain(mitm)
    pub = publisher()
    try:
        pub.set_target(a.address, a.id)
        sd = state(1)
        v = pub.publish(sd)
        assert wait(a, lambda: a.store.current is not None and a.store.current.version >= v)
        assert wait(b, lambda: b.receiver is None or not b.receiver_thread.is_alive(), 10)  # link ended
        assert mitm.flipped == [(v, 1)] and b.store.current is None
        a.set_downstream(b.address, b.id)  # the manager re-links; the attacker changes nothing now
        assert wait(b, lambda: b.store.current is not None and b.store.current.version >= v)
        with LocalWeights(b.store.dir, verify_key=SIGNER.public.raw).latest() as pulled:
            got = pulled.state_dict()
            assert all(torch.equal(got[k], sd[k]) for k in sd)
    finally:
        pub.close()


def test_forged_manifest_is_refused_by_the_relay(chain):
    mitm = MitmTcp(forge_shape=True)
    a, b, events = chain(mitm)
    pub = publisher()
    try:
        pub.set_target(a.address, a.id)
        v = pub.publish(state(2))
        assert wait(a, lambda: a.store.current is not None and a.store.current.version >= v)
        assert mitm.forged >= 1
        assert wait(b, lambda: b.receiver is None or not b.receiver_thread.is_alive(), 10)  # link ended
        assert b.store.current is None and b.store.incoming is None  # nothing of the forged offer taken
    finally:
        pub.close()


def _published(chain) -> tuple[RelayNode, dict]:
    a, b, _ = chain(get_transport("tcp"))
    pub = publisher()
    try:
        pub.set_target(a.address, a.id)
        sd = state(3)
        v = pub.publish(sd)
        assert wait(b, lambda: b.store.current is not None and b.store.current.version >= v)
    finally:
        pub.close()
    return b, sd


def test_pull_refuses_a_flipped_byte_in_shared_memory(chain):
    b, sd = _published(chain)
    lw = LocalWeights(b.store.dir, verify_key=SIGNER.public.raw)
    with lw.latest() as pulled:  # intact: verified and loaded
        assert torch.equal(pulled.state_dict()["m"], sd["m"])
    slot, _, m = read_pointer(b.store.dir)
    with open(b.store.dir / f"slot{slot}.bin", "r+b") as f:  # someone writes into the slot
        f.seek(m.offsets[1] + 3)
        byte = f.read(1)
        f.seek(m.offsets[1] + 3)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(WeightsRefused):
        lw.latest()


def test_pull_refuses_a_forged_pointer(chain):
    b, _ = _published(chain)
    ptr = msgpack.unpackb((b.store.dir / CURRENT).read_bytes())
    m = manifest_from_bytes(ptr["manifest"])
    shapes = [list(s) for s in m.shapes]
    shapes[1] = list(reversed(shapes[1]))
    forged = dataclasses.replace(m, shapes=shapes)
    ptr["manifest"] = manifest_to_bytes(forged)
    (b.store.dir / CURRENT).write_bytes(msgpack.packb(ptr))
    with pytest.raises(WeightsRefused):
        LocalWeights(b.store.dir, verify_key=SIGNER.public.raw).latest()
    # a pointer with no seal at all is refused too when the reader holds the key
    ptr["manifest"] = manifest_to_bytes(dataclasses.replace(m, seals=[]))
    (b.store.dir / CURRENT).write_bytes(msgpack.packb(ptr))
    with pytest.raises(WeightsRefused):
        LocalWeights(b.store.dir, verify_key=SIGNER.public.raw).latest()
