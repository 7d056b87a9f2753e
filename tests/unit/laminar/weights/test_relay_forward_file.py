"""A relay forwards chunks straight from its shared-memory slot file (sendfile), and that changes
nothing of what the downstream checks: the bytes forwarded are the bytes received, a chunk whose
bytes differ from the digest it is sent with is refused downstream (NACK, never marked present,
the link ends when it keeps failing, nothing becomes visible), and a message's header and payload
still arrive whole when the socket takes them in pieces.

Real relays, real loopback sockets; the one fake is the socket under TcpConn in the test of its
partial-send logic.
"""
from __future__ import annotations

import os
import shutil
import socket
import threading
import uuid

import pytest

torch = pytest.importorskip("torch")

from laminar.weights import handshake, wire  # noqa: E402
from laminar.weights.manifest import build_manifest, with_version  # noqa: E402
from laminar.weights.node import RelayNode  # noqa: E402
from laminar.weights.publisher import WeightPublisher  # noqa: E402
from laminar.weights.receiver import MAX_MAC_FAILURES  # noqa: E402
from laminar.weights.seal import seal_whole  # noqa: E402
from laminar.weights.sender import Sender  # noqa: E402
from laminar.weights.store import VersionBuffer  # noqa: E402
from laminar.weights.transport import LinkError, get_transport  # noqa: E402
from laminar.weights.transport.tcp import TcpConn  # noqa: E402

pytestmark = pytest.mark.timeout(120)
KEY = wire.derive_key(b"f" * 32)
CHUNK = 64 << 10


@pytest.fixture
def relays():
    made, dirs = [], []

    def make(n: int) -> list[RelayNode]:
        out = []
        for i in range(n):
            d = f"/dev/shm/laminar-unit-ff-{uuid.uuid4().hex[:10]}"
            dirs.append(d)
            node = RelayNode(f"f{i}", d, get_transport("tcp"), KEY)
            node.start()
            made.append(node)
            out.append(node)
        for a, b in zip(out, out[1:], strict=False):
            a.set_downstream(b.address, b.id)
        return out
    yield make
    for node in made:
        node.stop()
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def visible(node: RelayNode, v: int, timeout: float = 30.0) -> bool:
    with node.store.cond:
        return node.store.cond.wait_for(
            lambda: node.store.current is not None and node.store.current.version >= v, timeout)


def test_a_relay_forwards_from_its_slot_file_the_bytes_it_received(relays):
    a, b = relays(2)
    pub = WeightPublisher(chunk_bytes=CHUNK, key=KEY)
    try:
        pub.set_target(a.address, a.id)
        sd = {"w": torch.randn(1 << 18), "i": torch.arange(1000)}  # ~1 MiB: 17 chunks, the last one short
        v = pub.publish(sd)
        assert visible(b, v)
        ca, cb = a.store.current, b.store.current
        assert bytes(cb.view) == bytes(ca.view)
        assert cb.digests == ca.digests and cb.checksums == ca.checksums
        sent = a.sender.stats
        assert sent["chunks"] == ca.n and sent["from_file"] == ca.n  # every chunk left from the slot file
        assert sent["bytes"] == ca.manifest.total_bytes
        assert b.receiver.stats["corrupt"] == 0
    finally:
        pub.close()


class _FileSource:
    """A one-version source whose `open_file` hands out a file where chunk `bad` differs from the
    bytes (and digest) the version holds: what a forwarder would send if its slot file changed
    after the chunk was verified."""

    def __init__(self, vb: VersionBuffer, path: str, bad: int):
        self.vb, self.path, self.cond, self.stopped = vb, path, threading.Condition(), False
        data = bytearray(vb.view)
        start = bad * vb.manifest.chunk_bytes
        data[start + 5] ^= 0x5A
        with open(path, "wb") as f:
            f.write(data)

    def pick(self, delivered):
        return self.vb if delivered != self.vb.ident else None

    def acquire(self, vb):
        pass

    def release(self, vb):
        pass

    def make_seals(self, vb):
        return seal_whole(vb, None)

    def open_file(self, vb):
        return os.open(self.path, os.O_RDONLY)


def test_a_chunk_sent_from_a_file_that_differs_is_refused_downstream(relays, tmp_path):
    (b,) = relays(1)
    total = 4 * CHUNK
    m = build_manifest([("w", "uint8", (total,))], 1, CHUNK)
    vb = VersionBuffer(with_version(m, 1), bytearray(os.urandom(total)))
    vb.mark_all([0] * vb.n)
    src = _FileSource(vb, str(tmp_path / "slot.bin"), bad=2)
    sender = Sender(src, handshake.connect(get_transport("tcp"), b.address, KEY, 5.0), name="file-src")
    with pytest.raises(LinkError):
        sender.run()  # the downstream NACKs chunk 2 each time, then ends the link
    assert sender.stats["from_file"] >= vb.n
    assert b.corrupt == MAX_MAC_FAILURES
    assert b.store.current is None  # nothing of the version became visible
    incoming = b.store.incoming
    assert incoming is None or not incoming.have[2]


class _ChunkySock:
    """A socket that takes at most `step` bytes per sendmsg (what a full send buffer or a signal
    does to a blocking send); sendall takes everything. Records the byte stream."""

    def __init__(self, step: int):
        self.step, self.out = step, bytearray()

    def setsockopt(self, *args):
        pass

    def getpeername(self):
        return ("127.0.0.1", 1)

    def sendmsg(self, buffers):
        joined = b"".join(bytes(x) for x in buffers)[: self.step]
        self.out += joined
        return len(joined)

    def sendall(self, data, flags=0):
        self.out += bytes(data)


@pytest.mark.parametrize("step", [10, 88, 100, 4096])
def test_a_partial_sendmsg_sends_the_rest_in_order(step):
    sock = _ChunkySock(step)
    conn = TcpConn(sock, 1.0)
    header, payload = bytes(range(88)), memoryview(os.urandom(3000))
    conn.send(header, payload)
    assert bytes(sock.out) == header + bytes(payload)


def test_send_file_sends_the_header_then_the_file_range(tmp_path):
    path = tmp_path / "f.bin"
    data = os.urandom(300_000)
    path.write_bytes(data)
    lst = socket.create_server(("127.0.0.1", 0))
    got = bytearray()

    def serve():
        c, _ = lst.accept()
        while chunk := c.recv(1 << 16):
            got.extend(chunk)
        c.close()
    t = threading.Thread(target=serve)
    t.start()
    conn = TcpConn(socket.create_connection(lst.getsockname()), 5.0)
    fd = os.open(path, os.O_RDONLY)
    try:
        conn.send_file(b"H" * 88, fd, 1000, memoryview(data)[1000:201_000])
        with pytest.raises(LinkError, match="short"):  # the file ends before the payload does
            conn.send_file(b"H" * 88, fd, 250_000, memoryview(data)[:100_000])
    finally:
        os.close(fd)
        conn.close()
        t.join(10)
        lst.close()
    assert bytes(got[:88 + 200_000]) == b"H" * 88 + data[1000:201_000]
