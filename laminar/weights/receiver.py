"""Receiver: takes versions from one upstream connection into a ShmStore, verifying every chunk.

A chunk is received straight into its place in the incoming version's shared-memory file (no
copy), then its MAC (wire.py, chunk MACs: keyed by the cluster secret, over the offered
manifest's identity and layout, the index and the bytes) is computed and compared with the one in
the header, which the publisher computed from the trainer's own bytes. A mismatch is counted,
logged, answered with NACK (the sender sends the chunk again) and the chunk stays absent: it is
never marked present, so it is never forwarded and never becomes visible. A chunk refused
MAX_MAC_FAILURES times in a row ends the link (LinkError): the bytes keep being changed on the
way (or the offer's manifest was), so the relay's owner reports the link and the chain is
re-linked around it. The xxh3 digest kept for local checks is computed here from the verified
bytes, never taken from the header. Chunks the store already holds (a resend, a
resumed stream after a repair) are drained into scratch memory and dropped.

`on_event(kind, **info)` is called from this thread: "offer", "progress", "complete", "corrupt".
"""
from __future__ import annotations

import hmac
from collections.abc import Callable

import structlog

from laminar.weights import wire
from laminar.weights.manifest import checksum, chunk_count, ident, manifest_from_bytes
from laminar.weights.store import ShmStore, VersionBuffer
from laminar.weights.transport import Conn, LinkError

log = structlog.get_logger("laminar.weights.receiver")
MAX_MAC_FAILURES = 4


class UpstreamReceiver:
    """What a connection from an upstream needs, whole (Receiver) or a part (part_receiver.py):
    the store, the connection, the MAC key, a scratch buffer for bytes that are read and dropped
    (or checked before they are placed), and a loop that hands each message to `HANDLERS[type]`."""

    HANDLERS: dict[int, str] = {}  # message type -> name of the method that handles it
    WHO = "upstream"               # how errors name the peer

    def __init__(self, store: ShmStore, conn: Conn, on_event: Callable[..., None] = lambda kind, **kw: None,
                 key: bytes = b""):
        self.store, self.conn, self.on_event = store, conn, on_event
        self.mac_key = wire.mac_key(key)
        self.mdigest = b""
        self.failures: dict[int, int] = {}  # chunk (or range offset) -> MAC failures in a row
        self.vb: VersionBuffer | None = None
        self.scratch = bytearray(0)

    def stop(self) -> None:
        self.conn.close()

    def run(self) -> None:
        """Receive until the connection ends (raises LinkError; a closed conn is the normal end)."""
        while True:
            h = wire.recv(self.conn)
            name = self.HANDLERS.get(h.type)
            if name is None:
                raise LinkError(f"unexpected {wire.NAMES[h.type]} from {self.WHO} {self.conn.peer}")
            getattr(self, name)(h)

    def _read(self, n: int) -> memoryview:
        """The next `n` bytes of the connection, in scratch memory (valid until the next read)."""
        if len(self.scratch) < n:
            self.scratch = bytearray(n)
        view = memoryview(self.scratch)[:n]
        self.conn.recv_into(view)
        return view

    def _take_offer(self, h: wire.Header, hold=None) -> tuple:
        """Read an OFFER's manifest and get the store's buffer for it: (manifest, buffer, whether
        the buffer is that version's, its first missing chunk, whether it is complete), the last
        two read under the store's lock; the buffer is None when `hold(manifest)` (asked under
        the lock) says the offer must wait. Raises LinkError on a bad manifest."""
        try:
            m = manifest_from_bytes(wire.recv_small(self.conn, h))
        except ValueError as exc:
            raise LinkError(f"{self.WHO} {self.conn.peer} offered a bad manifest: {exc}") from None
        if m.version != h.version:
            raise LinkError(f"OFFER header says v{h.version}, manifest says v{m.version}")
        with self.store.cond:
            if hold is not None and hold(m):
                return m, None, False, 0, False
            vb = self.store.begin(m)
            return m, vb, vb.ident == ident(m), vb.prefix, vb.complete


class Receiver(UpstreamReceiver):
    HANDLERS = {wire.OFFER: "_offer", wire.CHUNK: "_chunk"}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stats = {"chunks": 0, "bytes": 0, "corrupt": 0, "duplicates": 0, "versions": 0}

    def _offer(self, h: wire.Header) -> None:
        m, vb, same, prefix, complete = self._take_offer(h)
        have = prefix if same else chunk_count(m)
        self.vb = vb if same and not complete else None
        self.mdigest, self.failures = wire.manifest_digest(m), {}
        # b = the offer's lineage: the sender tells answers about A:v from answers about B:v
        wire.send(self.conn, wire.WANT, m.version, a=have, b=m.lineage)
        self.on_event("offer", version=m.version, first_missing=have, chunks=chunk_count(m), lineage=m.lineage)

    def _chunk(self, h: wire.Header) -> None:
        vb, i = self.vb, h.a
        if vb is not None and h.version == vb.version and not vb.abandoned and 0 <= i < vb.n:
            dst = vb.chunk(i)
            if h.length != len(dst):
                raise LinkError(f"chunk {i} of v{h.version}: {h.length} bytes, expected {len(dst)}")
            if not vb.have[i]:
                self.conn.recv_into(dst)
                self._verify(vb, i, dst, h.tag)
                return
        if h.length > (vb.manifest.chunk_bytes if vb is not None else 1 << 30):
            raise LinkError(f"chunk of {h.length} bytes exceeds the chunk size")
        self.stats["duplicates"] += 1
        self._read(h.length)  # dropped

    def _verify(self, vb: VersionBuffer, i: int, dst: memoryview, tag: bytes) -> None:
        mac = wire.chunk_mac(self.mac_key, self.mdigest, i, dst)
        if not hmac.compare_digest(mac, tag):
            self.stats["corrupt"] += 1
            n = self.failures[i] = self.failures.get(i, 0) + 1
            log.warning("chunk_mac_refused", peer=self.conn.peer, version=vb.version, chunk=i, in_a_row=n)
            self.on_event("corrupt", version=vb.version, chunk=i)
            if n >= MAX_MAC_FAILURES:
                raise LinkError(f"chunk {i} of v{vb.version} from {self.conn.peer} failed its MAC {n} times in a row: "
                                "the bytes or the offered manifest are being changed on the way")
            wire.send(self.conn, wire.NACK, vb.version, a=i, b=vb.manifest.lineage)
            return
        self.failures.pop(i, None)
        digest = checksum(dst)
        self.stats["chunks"] += 1
        self.stats["bytes"] += len(dst)
        with self.store.cond:
            if vb.abandoned:
                return
            vb.mark(i, digest, mac)
            self.store.cond.notify_all()
            done = vb.complete
            if done:
                self.store.commit(vb)
        if done:
            self.stats["versions"] += 1
            self.vb = None
            wire.send(self.conn, wire.DONE, vb.version, b=vb.manifest.lineage)
            self.on_event("complete", version=vb.version, chunks=vb.n, lineage=vb.manifest.lineage,
                          run_id=vb.manifest.run_id)
        else:
            self.on_event("progress", version=vb.version, have=vb.count, chunks=vb.n)
