"""Receiver: takes versions from one upstream link into a ShmStore, checking every byte.

A chunk is received straight into its place in the incoming version's shared-memory file (no
copy) and hashed (wire.content_digest); the digest must equal the one in the CHUNK header, which
the link's MAC authenticates (wire.py). A mismatch (bytes changed on the way) is counted, logged,
answered with NACK (the sender sends the chunk again) and the chunk stays absent: it is never
marked present, so it is never forwarded and never becomes visible. A chunk refused
MAX_MAC_FAILURES times in a row ends the link (LinkError), so the relay's owner reports it and
the chain is re-linked around it. Chunks the store already holds (a resend, a resumed stream
after a repair) are drained into scratch memory and dropped.

Chunks are forwarded as soon as they arrive; the version becomes visible only when every chunk is
here and its seals (the SEAL message, signed by the trainer's key: seal.py) vouch for every byte.
A SEAL that does not verify means the upstream sent bytes the trainer did not: the version is
abandoned (nothing of it is kept), counted (`seals_refused`) and the link ended. The xxh3 digest
kept for local checks is computed here from the received bytes, never taken from the wire.

An offer of an older lineage of the run than the one held is refused by name (WANT REFUSED, with
the held lineage in its payload and, as proof, the held version's manifest and seals: the
trainer's signature over that lineage), logged and counted (`lineage_refused`): never 'have it'.
An offer the owner's `gate` declines (a relay link: another run than the pinned one, a layout too
large; node.py) is refused the same way, its payload saying why (`why`: run, size), and logged as
`offer_refused` naming the peer; nothing of it is allocated.

`on_event(kind, **info)` is called from this thread: "offer", "progress", "complete", "corrupt",
"refused" (an older lineage), "declined" (the gate refused it), "sealfail".
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import msgpack
import structlog

from laminar.protocol import Manifest
from laminar.weights import seal, wire
from laminar.weights.manifest import checksum, chunk_count, manifest_from_bytes, manifest_to_bytes
from laminar.weights.store import ShmStore, VersionBuffer
from laminar.weights.transport import LinkError

log = structlog.get_logger("laminar.weights.receiver")
MAX_MAC_FAILURES = 4


def refusal_payload(held) -> bytes:
    """What a refused offer's WANT carries: the version held, so the sender's error names it, and
    its manifest with its seals, so a sender holding the trainer's public key can check that the
    newer lineage exists (sender.py: a relay cannot make the trainer fail with a claim alone)."""
    m = held.manifest
    proof = dataclasses.replace(m, checksums=[], macs=[], seals=list(held.seals))
    return msgpack.packb({"run_id": m.run_id, "lineage": int(m.lineage), "version": int(m.version),
                          "manifest": manifest_to_bytes(proof)})


def decline_payload(kind: str, detail: str, held=None) -> bytes:
    """What an offer the gate refused carries in its WANT REFUSED: why (`kind`: run, size) and, when
    there is one, the version held."""
    out = {"why": kind, "detail": detail}
    if held is not None:
        out.update(run_id=held.manifest.run_id, lineage=int(held.manifest.lineage), version=int(held.version))
    return msgpack.packb(out)


class UpstreamReceiver:
    """What a link from an upstream needs, whole (Receiver) or a part (part_receiver.py): the
    store, the Channel, the trainer's public key to check seals with (None: unsigned seals, auth
    off), and a loop that hands each message to `HANDLERS[type]`."""

    HANDLERS: dict[int, str] = {}  # message type -> name of the method that handles it
    WHO = "upstream"               # how errors name the peer

    def __init__(self, store: ShmStore, ch: wire.Channel, on_event: Callable[..., None] = lambda kind, **kw: None,
                 verifier: seal.Verifier | None = None, heartbeat_s: float = 0.0,
                 gate: Callable[[Manifest], tuple[str, str] | None] | None = None):
        self.store, self.conn, self.on_event = store, ch, on_event
        self.verifier, self.heartbeat_s = verifier, heartbeat_s
        # asked about every offer before the store: None takes it, (kind, why) refuses it (node.py)
        self.gate = gate
        self.mdigest = b""
        self.failures: dict[int, int] = {}  # chunk (or range offset) -> digest failures in a row
        self.vb: VersionBuffer | None = None

    def stop(self) -> None:
        self.conn.close()

    def run(self) -> None:
        """Receive until the link ends (raises LinkError; a closed link is the normal end)."""
        self.conn.start_heartbeat(self.heartbeat_s)
        while True:
            h = self.conn.recv()
            name = self.HANDLERS.get(h.type)
            if name is None:
                raise LinkError(f"unexpected {wire.NAMES[h.type]} from {self.WHO} {self.conn.peer}")
            getattr(self, name)(h)

    def _take_offer(self, h: wire.Header, older: str = "take", hold=None) -> tuple:
        """Read an OFFER's manifest and ask the store what to do with it: (manifest, decision,
        buffer) (ShmStore.begin; decision "hold" when `hold(manifest)`, asked under the store's
        lock, says the offer must wait). Raises LinkError on a bad manifest."""
        try:
            m = manifest_from_bytes(h.payload)
        except ValueError as exc:
            raise LinkError(f"{self.WHO} {self.conn.peer} offered a bad manifest: {exc}") from None
        if m.version != h.version:
            raise LinkError(f"OFFER header says v{h.version}, manifest says v{m.version}")
        declined = self.gate(m) if self.gate is not None else None
        if declined is not None:
            self._decline(m, *declined)
            return m, "refuse", None
        with self.store.cond:
            if hold is not None and hold(m):
                return m, "hold", None
            kind, vb = self.store.begin(m, older)
        if kind == "refuse":
            self._refuse(m, vb)
        return m, kind, vb

    def _refuse(self, m, held: VersionBuffer) -> None:
        log.error("older_lineage_refused", peer=self.conn.peer, offered_lineage=m.lineage, offered_version=m.version,
                  held_lineage=held.manifest.lineage, held_version=held.version, run_id=m.run_id,
                  why="a trainer of this run published a newer lineage; this one is older (restored from an older "
                      "checkpoint folder, or a second trainer of the same run)")
        self.on_event("refused", version=m.version, lineage=m.lineage, held_lineage=held.manifest.lineage)
        self.conn.send(wire.WANT, m.version, a=wire.REFUSED, b=m.lineage, payload=refusal_payload(held))

    def _decline(self, m, kind: str, why: str) -> None:
        with self.store.cond:
            held = self.store.current
        log.error("offer_refused", peer=self.conn.peer, kind=kind, run_id=m.run_id, lineage=m.lineage,
                  version=m.version, total_bytes=m.total_bytes, why=why)
        self.on_event("declined", refusal=kind, version=m.version, run_id=m.run_id, peer=self.conn.peer, why=why)
        self.conn.send(wire.WANT, m.version, a=wire.REFUSED, b=m.lineage, payload=decline_payload(kind, why, held))

    def _finish(self, vb: VersionBuffer, known: dict) -> bool:
        """Check a complete version's seals against its bytes; commit it (True) or, when they do
        not vouch for it, abandon it and end the link (raises LinkError). False: not yet sealed,
        or superseded meanwhile."""
        if not vb.seals or not vb.complete:
            return False
        try:
            bad = seal.check(vb.manifest, vb.seals, vb.view, self.verifier, wire.manifest_digest(vb.manifest), known)
            why = f"chunks {bad[:8]} are not the bytes the trainer sealed" if bad else ""
        except seal.SealError as exc:
            why = str(exc)
        if why:
            with self.store.cond:
                self.store.abandon(vb)
            log.error("version_seal_refused", peer=self.conn.peer, version=vb.version, lineage=vb.manifest.lineage,
                      why=why)
            self.on_event("sealfail", version=vb.version, why=why)
            raise LinkError(f"v{vb.version} from {self.conn.peer} refused: {why}")
        with self.store.cond:
            if vb.abandoned or vb is not self.store.incoming:
                return False
            vb.sealed = True
            self.store.commit(vb)
        return True


class Receiver(UpstreamReceiver):
    HANDLERS = {wire.OFFER: "_offer", wire.CHUNK: "_chunk", wire.SEAL: "_seal"}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stats = {"chunks": 0, "bytes": 0, "corrupt": 0, "duplicates": 0, "versions": 0}

    def _offer(self, h: wire.Header) -> None:
        m, kind, vb = self._take_offer(h)
        self.vb, self.failures = None, {}
        if kind == "refuse":
            return
        if kind == "have":
            have = wire.HAVE
        else:
            self.vb, self.mdigest = vb, wire.manifest_digest(m)
            with self.store.cond:
                have = vb.prefix
        # b = the offer's lineage: the sender tells answers about A:v from answers about B:v
        self.conn.send(wire.WANT, m.version, a=have, b=m.lineage)
        self.on_event("offer", version=m.version, first_missing=have, chunks=chunk_count(m), lineage=m.lineage)
        if self.vb is not None and self.vb.complete and self.vb.seals:  # everything came before: seal it now
            self._complete(self.vb)

    def _chunk(self, h: wire.Header) -> None:
        vb, i = self.vb, h.a
        if (vb is not None and h.version == vb.version and h.b == vb.manifest.lineage and not vb.abandoned
                and 0 <= i < vb.n):
            dst = vb.chunk(i)
            if h.length != len(dst):
                raise LinkError(f"chunk {i} of v{h.version}: {h.length} bytes, expected {len(dst)}")
            if not vb.have[i]:
                digest = self.conn.recv_data(h, dst)
                self._verified(vb, i, dst, digest)
                return
        if h.length > (vb.manifest.chunk_bytes if vb is not None else 1 << 30):
            raise LinkError(f"chunk of {h.length} bytes exceeds the chunk size")
        self.stats["duplicates"] += 1
        self.conn.read_data(h)  # dropped

    def _verified(self, vb: VersionBuffer, i: int, dst: memoryview, digest: bytes | None) -> None:
        if digest is None:
            self.stats["corrupt"] += 1
            n = self.failures[i] = self.failures.get(i, 0) + 1
            log.warning("chunk_digest_refused", peer=self.conn.peer, version=vb.version, chunk=i, in_a_row=n)
            self.on_event("corrupt", version=vb.version, chunk=i)
            if n >= MAX_MAC_FAILURES:
                raise LinkError(f"chunk {i} of v{vb.version} from {self.conn.peer} failed its digest {n} times in a "
                                "row: the bytes are being changed on the way")
            self.conn.send(wire.NACK, vb.version, a=i, b=vb.manifest.lineage)
            return
        self.failures.pop(i, None)
        sum64 = checksum(dst)
        self.stats["chunks"] += 1
        self.stats["bytes"] += len(dst)
        with self.store.cond:
            if vb.abandoned:
                return
            vb.mark(i, sum64, digest)
            self.store.cond.notify_all()
        if vb.complete and vb.seals:
            self._complete(vb)
        else:
            self.on_event("progress", version=vb.version, have=vb.count, chunks=vb.n)

    def _seal(self, h: wire.Header) -> None:
        vb = self.vb
        if vb is None or h.version != vb.version or h.b != vb.manifest.lineage or vb.abandoned:
            return  # about a version this link is not receiving (a stale one): nothing to seal
        try:
            seals = [bytes(s) for s in msgpack.unpackb(h.payload)]
        except Exception:  # noqa: BLE001 - msgpack raises a zoo of types on garbage
            raise LinkError(f"malformed SEAL from {self.conn.peer}") from None
        with self.store.cond:
            vb.seals = seals
        if vb.complete:
            self._complete(vb)

    def _complete(self, vb: VersionBuffer) -> None:
        if not self._finish(vb, vb.known_digests()):
            return
        self.stats["versions"] += 1
        self.vb = None
        self.conn.send(wire.DONE, vb.version, b=vb.manifest.lineage)
        self.on_event("complete", version=vb.version, chunks=vb.n, lineage=vb.manifest.lineage,
                      run_id=vb.manifest.run_id)
