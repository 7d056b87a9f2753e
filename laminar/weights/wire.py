"""The chunk protocol spoken over a ChunkTransport connection: message format and the Channel.

Every message is one 88-byte header `!4sB3xqqQQ32s16s` = magic, type, version, a, b, length,
digest, mac, plus `length` payload bytes. After the handshake (handshake.py) every message
travels through a `Channel`, which authenticates each one with a key only the two ends derived
in that handshake: `mac` is keyed BLAKE3 (16 bytes) over the message's sequence number on the
link (each direction counts its own), every other header field and, for a control message, its
payload. For a CHUNK or RANGE the payload (up to a chunk of weights) is not hashed a second time
for the MAC: `digest` is the BLAKE3 hash of those bytes, the MAC covers the digest, and the
receiver hashes the bytes it received and compares. So nobody without the link's key can inject,
alter, replay, reorder or drop a message unnoticed, and the bytes cost one hash pass per hop,
the same as the keyed chunk MACs of protocol 2.

Upstream U sends, downstream D answers on the same connection:

    U -> D  OFFER  (version, a=chunks, b=lineage)        payload: manifest (without checksums or seals)
    D -> U  WANT   (version, a, b=lineage)               a >= 0: the first chunk D lacks (U resumes
                                                         there; a == chunks: D has every chunk and
                                                         needs only the seal); a == HAVE: D holds
                                                         this version or a newer one as current;
                                                         a == REFUSED: D holds a newer lineage of
                                                         this run (payload says which: it names both)
    U -> D  CHUNK  (version, a=index, b=lineage, digest) payload: the chunk bytes
    D -> U  NACK   (version, a=index, b=lineage)         the bytes did not match the digest: again
    U -> D  SEAL   (version, b=lineage)                  payload: the version's seals (seal.py)
    D -> U  DONE   (version, b=lineage)                  every chunk arrived, the seals verified,
                                                         the version is visible at D
    either  PING                                          nothing else sent for heartbeat_s

A version becomes visible at a relay only when its chunks are all there and its seals (signed by
a key only trainer hosts hold) vouch for every byte; until then chunks are forwarded as they
arrive (the pipeline is unchanged), and a relay sends SEAL downstream only after it verified it.

A part upstream (handshake purpose PART: one host of a trainer whose ranks span several hosts,
part_sender.py) sends only its own byte ranges, and the master relay assembles the version from
every host's parts (part_receiver.py):

    U -> D  OFFER    (version, a=chunks, b=lineage)      payload: manifest, as above
    D -> U  WANT     (version, a=0, HAVE, BUSY or REFUSED, b=lineage)   BUSY: D still assembles an
                                                         older version; offer the newest again soon
    U -> D  RANGE    (version, a=byte offset, b=lineage, digest)  payload: bytes [a, a + length)
    D -> U  NACK     (version, a=byte offset, b=lineage)
    U -> D  PART_END (version, a=ranges sent, b=lineage) payload: this host's seal (its ranges)
    D -> U  DONE     (version, a=ranges, b=lineage)      this part arrived (or D dropped the version)

WANT, NACK and DONE echo the lineage in `b`, and a sender takes an answer only when its version
and lineage match what it is sending. A peer speaking another protocol (the header's magic, or
HELLO's `a`) is refused with an error naming both versions.
"""
from __future__ import annotations

import hashlib
import hmac
import struct
import threading
import time
from dataclasses import dataclass

import blake3
import msgpack

from laminar.weights.transport import Conn, LinkError

DATA_PROTOCOL = 3  # 1: no MACs; 2: chunk MACs under the cluster key; 3: MAC'd messages, signed versions
MAGIC = b"LMW3"
HEADER = struct.Struct("!4sB3xqqQQ32s16s")
HEADER_SIZE = HEADER.size
SEQ = struct.Struct("!Q")  # a message's number on the link, first in what its MAC covers
DIGEST_BYTES, MAC_BYTES = 32, 16
NO_DIGEST = bytes(DIGEST_BYTES)
NO_MAC = bytes(MAC_BYTES)
MAX_CONTROL_PAYLOAD = 16 << 20  # a manifest / seal / handshake payload larger than this is garbage

HELLO, PROOF, WELCOME, OFFER, WANT, CHUNK, NACK, DONE, RANGE, PART_END, SEAL, PING = range(1, 13)
NAMES = {HELLO: "HELLO", PROOF: "PROOF", WELCOME: "WELCOME", OFFER: "OFFER", WANT: "WANT", CHUNK: "CHUNK",
         NACK: "NACK", DONE: "DONE", RANGE: "RANGE", PART_END: "PART_END", SEAL: "SEAL", PING: "PING"}
DATA = frozenset({CHUNK, RANGE})  # payload authenticated through `digest`, not hashed into the MAC
BUSY, HAVE, REFUSED = -1, -2, -3  # WANT's `a` besides a chunk index


@dataclass(frozen=True)
class Header:
    type: int
    version: int = 0
    a: int = 0
    b: int = 0
    length: int = 0
    digest: bytes = NO_DIGEST
    mac: bytes = bytes(MAC_BYTES)
    payload: bytes = b""  # a control message's payload, read and authenticated with it (not packed)

    def body(self) -> bytes:
        """The header as it is packed, without its MAC."""
        return HEADER.pack(MAGIC, self.type, self.version, self.a, self.b, self.length, self.digest,
                           bytes(MAC_BYTES))[:-MAC_BYTES]

    def pack(self) -> bytes:
        return self.body() + self.mac


def unpack(raw: bytes) -> Header:
    if raw[:3] == b"LMW" and raw[:4] != MAGIC:
        old = raw[3:4].decode("ascii", "replace")
        raise LinkError(f"peer speaks chunk protocol {old} ({raw[:4].decode('ascii', 'replace')}); this side speaks "
                        f"{DATA_PROTOCOL} (authenticated messages, signed versions): update it")
    magic, typ, version, a, b, length, digest, mac = HEADER.unpack(raw)
    if magic != MAGIC or typ not in NAMES:
        raise LinkError(f"not a Laminar chunk message (magic {magic!r}, type {typ})")
    return Header(typ, version, a, b, length, digest, mac)


def content_digest(data) -> bytes:
    """The BLAKE3 hash of a chunk's or range's bytes (32 bytes): what CHUNK and RANGE carry, and
    what a version's seals list. Several GB/s on one core (docs/security.md has the number)."""
    return blake3.blake3(data).digest()


def manifest_digest(m) -> bytes:
    """A version's identity and layout (not its checksums or seals): run, lineage, number, every
    tensor's name, dtype, shape and extent, the chunk size. Seals sign it with the pieces."""
    body = [m.run_id, int(m.lineage), int(m.version), int(m.total_bytes), int(m.chunk_bytes), list(m.names),
            list(m.dtypes), [list(map(int, s)) for s in m.shapes], list(map(int, m.offsets)), list(map(int, m.nbytes))]
    if getattr(m, "content", "full") != "full":  # an adapter: what it is and which base it is for are signed too
        body += [m.content, m.adapter_config, m.base_id]
    return blake3.blake3(msgpack.packb(body)).digest()


def derive_key(secret: bytes | None) -> bytes:
    """The data plane's handshake key, derived from the cluster secret (b'' when auth is off)."""
    return hashlib.sha256(b"laminar-weights-v1\0" + secret).digest() if secret else b""


def recv_header(conn: Conn) -> Header:
    return unpack(conn.recv_header(HEADER_SIZE))


def recv_payload(conn: Conn, h: Header) -> bytes:
    """Read the payload of a control message (bounded)."""
    if h.length > MAX_CONTROL_PAYLOAD:
        raise LinkError(f"{NAMES[h.type]} payload of {h.length} bytes is too large")
    buf = bytearray(h.length)
    if h.length:
        conn.recv_into(memoryview(buf))
    return bytes(buf)


def send_plain(conn: Conn, typ: int, a: int = 0, b: int = 0, payload: bytes | None = None) -> None:
    """A handshake message (before the link has keys: HELLO and PROOF are proofs themselves)."""
    conn.send(Header(typ, 0, a, b, len(payload or b"")).pack(), payload)


class Channel:
    """One authenticated chunk link: every message MAC'd under the direction's key, numbered.

    Sends are serialized by a lock (the heartbeat thread sends PINGs beside the owner's thread),
    so the sequence numbers are the order on the wire. `recv` returns the next message other than
    a PING (a control message with its payload, authenticated); for CHUNK and RANGE the caller
    then takes the payload with `recv_data` (into its place) or `skip_data`."""

    def __init__(self, conn: Conn, send_key: bytes, recv_key: bytes):
        self.conn, self.peer = conn, conn.peer
        self._send_key, self._recv_key = send_key, recv_key
        self._send_seq = self._recv_seq = 0
        self._lock = threading.Lock()
        self._last_send = time.monotonic()
        self._closed = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self.scratch = bytearray(0)
        self.claim: tuple[int, str] | None = None  # a LINK's proven (chain epoch, upstream id): handshake.py

    @staticmethod
    def _mac(key: bytes, seq: int, body: bytes, payload) -> bytes:
        h = blake3.blake3(SEQ.pack(seq) + body, key=key)
        if payload is not None:
            h.update(payload)
        return h.digest(MAC_BYTES)

    def send(self, typ: int, version: int = 0, a: int = 0, b: int = 0, payload=None,
             digest: bytes = NO_DIGEST, file: tuple[int, int] | None = None) -> None:
        """One message. For CHUNK and RANGE pass the bytes as `payload` and their content_digest;
        `file` = (fd, offset): the same bytes lie there in a file, which the connection may send
        them from (Conn.send_file)."""
        n = len(payload) if payload is not None else 0
        body = HEADER.pack(MAGIC, typ, version, a, b, n, digest, NO_MAC)[:-MAC_BYTES]
        with self._lock:
            mac = self._mac(self._send_key, self._send_seq, body, None if typ in DATA else (payload or b""))
            self._send_seq += 1
            if file is not None and n:
                self.conn.send_file(body + mac, file[0], file[1], payload)
            else:
                self.conn.send(body + mac, payload)
            self._last_send = time.monotonic()

    def recv(self) -> Header:
        while True:
            raw = self.conn.recv_header(HEADER_SIZE)
            h = unpack(raw)
            payload = None if h.type in DATA else recv_payload(self.conn, h)
            want = self._mac(self._recv_key, self._recv_seq, raw[:-MAC_BYTES], payload)  # every byte as sent
            if not hmac.compare_digest(want, h.mac):
                raise LinkError(f"{NAMES[h.type]} from {self.peer} fails its MAC: not sent by the peer that "
                                "completed the handshake (altered, injected, replayed or reordered on the way)")
            self._recv_seq += 1
            if h.type != PING:
                return h if payload is None else Header(h.type, h.version, h.a, h.b, h.length, h.digest, h.mac,
                                                        payload)

    def recv_data(self, h: Header, view: memoryview) -> bytes | None:
        """Receive a CHUNK's or RANGE's bytes into `view` (exactly h.length); their digest when it
        matches the header's, else None (the bytes were changed on the way: ask again)."""
        self.conn.recv_into(view)
        got = content_digest(view)
        return got if hmac.compare_digest(got, h.digest) else None

    def read_data(self, h: Header) -> tuple[memoryview, bytes | None]:
        """A CHUNK's or RANGE's bytes in scratch memory (valid until the next read), and their
        digest when it matches the header's."""
        if len(self.scratch) < h.length:
            self.scratch = bytearray(h.length)
        view = memoryview(self.scratch)[:h.length]
        return view, self.recv_data(h, view)

    def start_heartbeat(self, interval_s: float) -> None:
        """Send a PING whenever nothing else was sent for `interval_s`, until closed, so the peer
        (whose receive gives up after its idle timeout) knows this end is alive and well."""
        if interval_s <= 0 or self._heartbeat is not None:
            return
        self._heartbeat = threading.Thread(target=self._beat, args=(interval_s,), name=f"ping-{self.peer}",
                                           daemon=True)
        self._heartbeat.start()

    def _beat(self, interval_s: float) -> None:
        while not self._closed.wait(interval_s / 4):
            if time.monotonic() - self._last_send >= interval_s and self._lock.acquire(timeout=interval_s):
                try:  # a send in progress (a chunk on a slow link) is traffic enough: skip
                    if time.monotonic() - self._last_send >= interval_s:
                        mac = self._mac(self._send_key, self._send_seq, Header(PING).body(), b"")
                        self._send_seq += 1
                        self.conn.send(Header(PING).body() + mac)
                        self._last_send = time.monotonic()
                except LinkError:
                    return  # the owner's next receive or send fails too, and handles it
                finally:
                    self._lock.release()

    def set_idle_timeout(self, seconds: float | None) -> None:
        self.conn.set_idle_timeout(seconds)

    def close(self) -> None:
        self._closed.set()
        self.conn.close()
