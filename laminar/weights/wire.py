"""The chunk protocol spoken over a ChunkTransport connection, and its authentication handshake.

Every message is one 56-byte header `!4sB3xqqQQ16s` = magic, type, version, a, b, length, tag,
plus `length` payload bytes. `tag` is zero except in CHUNK, where it is the chunk's MAC.
Upstream U sends, downstream D answers on the same connection:

    U -> D  OFFER  (version, a=chunks, b=lineage)        payload: manifest (no checksums needed)
    D -> U  WANT   (version, a=first missing, b=lineage) U resumes there; a == chunks: D has it already
    U -> D  CHUNK  (version, a=index, b=xxh3, tag=MAC)   payload: the chunk bytes
    D -> U  NACK   (version, a=index, b=lineage)         MAC mismatch: U sends that chunk again
    D -> U  DONE   (version, b=lineage)                  every chunk arrived and verified

A part upstream (handshake purpose PART: one host of a trainer whose ranks span several hosts,
laminar/weights/part_sender.py) sends only the byte ranges its host's ranks hold, and the master
relay assembles the version from every host's parts (laminar/weights/part_receiver.py):

    U -> D  OFFER    (version, a=chunks, b=lineage)      payload: manifest, as above
    D -> U  WANT     (version, a=0 or chunks, b=lineage) a == chunks: D has the version already;
                                                        a == -1: busy with an older one, offer again
    U -> D  RANGE    (version, a=byte offset, b=lineage, tag=MAC)  payload: bytes [a, a + length)
    D -> U  NACK     (version, a=byte offset, b=lineage) MAC mismatch: U sends that range again
    U -> D  PART_END (version, a=ranges sent, b=lineage) every range of this part was sent
    D -> U  DONE     (version, a=ranges, b=lineage)      every range of this part arrived, verified
                                                        (or the master dropped that version for a newer one)

A RANGE's MAC is `range_mac`: like a chunk MAC, over the manifest digest, the byte offset and the
bytes (a range never spans more than one chunk). When every byte of a chunk has arrived in
verified ranges the relay computes the chunk's MAC itself (it holds the key) and the chunk is
present, forwarded and checked by rollouts exactly as one that came whole.

OFFER carries the lineage epoch of the version in `b`; WANT, NACK and DONE echo it, and the
sender takes an answer only when its version and lineage both match what it is sending (a late
answer about an abandoned version of another lineage is never taken for the current one). CHUNK
keeps `b` for the checksum: an abandoned version's chunks always precede the next OFFER on the
connection.

Chunk MACs: the handshake authenticates the peer, not the bytes that follow it, and `b` (xxh3)
is no protection against anyone who can change the bytes on the way, since they can recompute
it. So every CHUNK carries `chunk_mac`: keyed BLAKE3 (a key derived from the cluster secret)
over the version's identity and layout (`manifest_digest`: run, lineage, number, every tensor's
name, dtype, shape and extent, the chunk size), the chunk's index and its bytes, cut to 16 bytes.
A relay checks it before a chunk counts as present and keeps the verified MAC with the chunk: it
forwards it and writes it into the shared-memory manifest, where a rollout checks every chunk
again before loading (laminar/weights/pull.py). An altered byte, or an OFFER whose manifest was
changed (other shapes, dtypes, offsets, version or lineage), fails every MAC it touches.

Authentication (before anything else; mutual, HMAC-SHA256 over fresh nonces with a key derived
from the cluster secret, so the secret itself never crosses the wire):

    C -> A  HELLO (a=PROTOCOL_VERSION, b=purpose, payload nonce_c)
    A -> C  HELLO (a=PROTOCOL_VERSION, payload nonce_a + mac(key, "A" + nonce_c))
    C -> A  PROOF (payload mac(key, "C" + nonce_a), or mac(key, "P" + nonce_a) for a probe)
    A -> C  WELCOME
A peer with another protocol version or a wrong proof gets its connection closed with a
LinkError naming the reason; the handshake runs under a deadline. `purpose` is LINK (an upstream
that will stream versions), PART (one host's part of a multi-host trainer: it never displaces the
upstream, several stream at once) or PROBE (the manager checking that the port really serves: the
relay answers the handshake and closes, leaving its upstream alone); the proof covers it.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import struct
from dataclasses import dataclass

import blake3
import msgpack

from laminar.protocol import PROTOCOL_VERSION
from laminar.weights.transport import ChunkTransport, Conn, LinkError

HEADER = struct.Struct("!4sB3xqqQQ16s")
HEADER_SIZE = HEADER.size
MAGIC = b"LMW2"  # LMW1 had a 40-byte header without a MAC: such a peer is refused by name
MAC_BYTES = 16
NO_TAG = bytes(MAC_BYTES)
MAX_CONTROL_PAYLOAD = 16 << 20  # a manifest / handshake payload larger than this is garbage

HELLO, PROOF, WELCOME, OFFER, WANT, CHUNK, NACK, DONE, RANGE, PART_END = range(1, 11)
PURPOSE_LINK, PURPOSE_PROBE, PURPOSE_PART = 0, 1, 2
_PROOF_TAG = {PURPOSE_LINK: b"C", PURPOSE_PROBE: b"P", PURPOSE_PART: b"S"}
NAMES = {HELLO: "HELLO", PROOF: "PROOF", WELCOME: "WELCOME", OFFER: "OFFER", WANT: "WANT",
         CHUNK: "CHUNK", NACK: "NACK", DONE: "DONE", RANGE: "RANGE", PART_END: "PART_END"}


@dataclass(frozen=True)
class Header:
    type: int
    version: int = 0
    a: int = 0
    b: int = 0
    length: int = 0
    tag: bytes = NO_TAG

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, self.type, self.version, self.a, self.b, self.length, self.tag)


def unpack(raw: bytes) -> Header:
    if raw[:4] == b"LMW1":
        raise LinkError("peer speaks the chunk protocol without MACs (LMW1): update it")
    magic, typ, version, a, b, length, tag = HEADER.unpack(raw)
    if magic != MAGIC or typ not in NAMES:
        raise LinkError(f"not a Laminar chunk message (magic {magic!r}, type {typ})")
    return Header(typ, version, a, b, length, tag)


def send(conn: Conn, typ: int, version: int = 0, a: int = 0, b: int = 0, payload=None) -> None:
    n = len(payload) if payload is not None else 0
    conn.send(Header(typ, version, a, b, n).pack(), payload)


def recv(conn: Conn) -> Header:
    return unpack(conn.recv_header(HEADER_SIZE))


def recv_small(conn: Conn, h: Header) -> bytes:
    """Read the payload of a control message (bounded)."""
    if h.length > MAX_CONTROL_PAYLOAD:
        raise LinkError(f"{NAMES[h.type]} payload of {h.length} bytes is too large")
    buf = bytearray(h.length)
    if h.length:
        conn.recv_into(memoryview(buf))
    return bytes(buf)


def expect(conn: Conn, typ: int) -> tuple[Header, bytes]:
    h = recv(conn)
    if h.type != typ:
        raise LinkError(f"expected {NAMES[typ]}, got {NAMES[h.type]}")
    return h, recv_small(conn, h)


def derive_key(secret: bytes | None) -> bytes:
    """The HMAC key of the data plane, derived from the cluster secret (b'' when auth is off)."""
    return hashlib.sha256(b"laminar-weights-v1\0" + secret).digest() if secret else b""


def mac_key(key: bytes) -> bytes:
    """The chunk-MAC key, derived (BLAKE3's key derivation) from the data-plane key, itself derived
    from the cluster secret; with auth off (b"") a fixed key: the MAC is then an integrity check only."""
    return blake3.blake3(key, derive_key_context="laminar 2026-11 weight chunk MAC v1").digest()


def manifest_digest(m) -> bytes:
    """What a chunk MAC binds besides the chunk: the version's identity and layout (not its checksums)."""
    body = [m.run_id, int(m.lineage), int(m.version), int(m.total_bytes), int(m.chunk_bytes), list(m.names),
            list(m.dtypes), [list(map(int, s)) for s in m.shapes], list(map(int, m.offsets)), list(map(int, m.nbytes))]
    return blake3.blake3(msgpack.packb(body)).digest()


def chunk_mac(mkey: bytes, mdigest: bytes, index: int, data) -> bytes:
    """The MAC of chunk `index` of the version whose `manifest_digest` is `mdigest` (16 bytes).
    BLAKE3 in keyed mode: several GB/s on one core (docs/security.md has the number)."""
    h = blake3.blake3(key=mkey)
    h.update(mdigest)
    h.update(struct.pack("!Q", index))
    h.update(data)
    return h.digest(MAC_BYTES)


def range_mac(mkey: bytes, mdigest: bytes, offset: int, data) -> bytes:
    """The MAC of the bytes at `offset` of the version whose `manifest_digest` is `mdigest`, as a
    part upstream sends them (16 bytes; "R" keeps it apart from any chunk MAC)."""
    h = blake3.blake3(key=mkey)
    h.update(b"R")
    h.update(mdigest)
    h.update(struct.pack("!Q", offset))
    h.update(data)
    return h.digest(MAC_BYTES)


def verify_macs(mkey: bytes, m, buf) -> list[int]:
    """Indices of the chunks of `buf` whose MAC differs from `m.macs` (all of them when `m` has none)."""
    from laminar.weights.manifest import chunk_count, chunk_range
    n = chunk_count(m)
    if len(m.macs) != n:
        return list(range(n))
    md, view, bad = manifest_digest(m), memoryview(buf), []
    for i in range(n):
        s, k = chunk_range(m, i)
        if not hmac.compare_digest(chunk_mac(mkey, md, i, view[s:s + k]), bytes(m.macs[i])):
            bad.append(i)
    return bad


def _mac(key: bytes, who: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, who + nonce, hashlib.sha256).digest()


def _check_protocol(h: Header) -> None:
    if h.a != PROTOCOL_VERSION:
        raise LinkError(f"protocol mismatch: peer speaks protocol {h.a}, this side speaks protocol {PROTOCOL_VERSION}")


def client_handshake(conn: Conn, key: bytes, timeout: float = 5.0, purpose: int = PURPOSE_LINK) -> None:
    conn.set_handshake_timeout(timeout)
    nonce_c = os.urandom(32)
    send(conn, HELLO, a=PROTOCOL_VERSION, b=purpose, payload=nonce_c)
    h, body = expect(conn, HELLO)
    _check_protocol(h)
    if len(body) != 64 or not hmac.compare_digest(body[32:], _mac(key, b"A", nonce_c)):
        raise LinkError("peer failed to prove it holds the cluster key")
    send(conn, PROOF, payload=_mac(key, _PROOF_TAG[purpose], body[:32]))
    expect(conn, WELCOME)
    conn.set_handshake_timeout(None)


def server_handshake(conn: Conn, key: bytes, timeout: float = 5.0) -> int:
    """Authenticate the connecting peer; returns its purpose (PURPOSE_LINK or PURPOSE_PROBE)."""
    conn.set_handshake_timeout(timeout)
    h, nonce_c = expect(conn, HELLO)
    _check_protocol(h)
    if len(nonce_c) != 32 or h.b not in _PROOF_TAG:
        raise LinkError("bad HELLO")
    nonce_a = os.urandom(32)
    send(conn, HELLO, a=PROTOCOL_VERSION, payload=nonce_a + _mac(key, b"A", nonce_c))
    _, proof = expect(conn, PROOF)
    if not hmac.compare_digest(proof, _mac(key, _PROOF_TAG[h.b], nonce_a)):
        raise LinkError("connection refused: peer does not hold the cluster key")
    send(conn, WELCOME)
    conn.set_handshake_timeout(None)
    return h.b


def probe(transport: ChunkTransport, address: str, key: bytes, timeout: float) -> None:
    """Connect, complete a PROBE handshake and close: raises LinkError unless the relay at
    `address` accepts, answers and proves it holds the key within `timeout`."""
    conn = transport.connect(address, timeout)
    try:
        client_handshake(conn, key, timeout, purpose=PURPOSE_PROBE)
    finally:
        conn.close()


def connect(transport: ChunkTransport, address: str, key: bytes, timeout: float,
            purpose: int = PURPOSE_LINK) -> Conn:
    """Connect and authenticate (client side); the connection is closed if the handshake fails."""
    conn = transport.connect(address, timeout)
    try:
        client_handshake(conn, key, timeout, purpose=purpose)
    except BaseException:
        conn.close()
        raise
    return conn
