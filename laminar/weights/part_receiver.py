"""PartReceiver: takes one host's byte ranges of a version into a relay's ShmStore.

A trainer whose FSDP2 ranks span several hosts publishes without gathering: each host's ranks
write their own rows into their host's staging, and each host streams just those byte ranges to
the master relay over a connection of its own (wire.py, handshake purpose PART; part_sender.py).
Every such connection has a PartReceiver; all of them write into the one incoming VersionBuffer
of the store (`ShmStore.begin` hands every offer of the same version the same buffer), and a
chunk becomes present when every one of its bytes has arrived in verified ranges, whoever sent
them. The relay then computes that chunk's checksum and content digest itself, and from there on
the chunk is forwarded exactly like one that arrived whole. Each host ends its part with its seal
(PART_END's payload: its ranges and their digests, signed with the trainer's key, seal.py); the
version becomes visible when every byte has arrived and the hosts' seals together vouch for all
of them, and those seals travel down the chain with it.

Safety (a part upstream proved in its handshake that it holds the trainer's signing key, and its
bytes are checked anyway):
- a range is received into scratch memory, its digest checked against the RANGE header's (which
  the link's MAC authenticates), and only then copied into place; a mismatch is answered with NACK
  and the bytes are dropped; MAX_MAC_FAILURES in a row for one offset end the link;
- a range must lie inside one chunk, and inside the tensors' bytes: the alignment padding between
  tensors is zeroed by the relay, never sent; bytes already written are never written again: an exact
  repeat (a part resent after a reconnect) is dropped, a range that overlaps written bytes only
  in part ends the link (two hosts claiming the same bytes is a bug or an attack);
- one version at a time: a newer offer of the same lineage is answered BUSY while the incoming
  version's parts still arrive (`_hold`), so hosts that publish at different speeds converge on
  one version instead of each making the master drop the other's half-assembled one; only a
  range counts as arriving (an offer, even repeated, does not), so a host that keeps re-offering
  cannot hold the others off; an offer older than the incoming version is answered BUSY too
  (never 'have it': the host offers its newest next);
- the copy into the buffer and the bookkeeping happen under the store's condition, so a newer
  offer on another connection cannot reuse the buffer's file while a range is being written.
  That serializes the parts' copies at the relay (one memcpy of at most a chunk each), which is
  not the trainer's stall: the trainer has handed its staging to the sender by then.
"""
from __future__ import annotations

import bisect
import time
from collections.abc import Callable

import structlog

from laminar.weights import seal, wire
from laminar.weights.manifest import checksum, chunk_count, chunk_range, ident, same_lineage, supersedes
from laminar.weights.receiver import MAX_MAC_FAILURES, UpstreamReceiver
from laminar.weights.store import ShmStore, VersionBuffer
from laminar.weights.transport import LinkError

log = structlog.get_logger("laminar.weights.part_receiver")
BUSY = wire.BUSY   # WANT's `a` when an older version's parts are still arriving: offer again soon
PART_STALL_S = 10.0  # an incoming version no range has reached for this long can be superseded


class Coverage:
    """Which bytes of each chunk of a version have been written (disjoint intervals per chunk)."""

    def __init__(self):
        self.spans: dict[int, list[tuple[int, int]]] = {}  # chunk -> sorted [(start, end)) written
        self.filled: dict[int, int] = {}
        self.last = time.monotonic()  # when a range last arrived
    @classmethod
    def of(cls, vb: VersionBuffer) -> Coverage:
        """A version's coverage, its alignment padding (the bytes between tensors, which no part
        sends) written as zeros and counted, as a whole publish's zeroed staging has them."""
        cov, m = cls(), vb.manifest
        gaps, end = [], 0
        for off, n in sorted(zip(m.offsets, m.nbytes, strict=True)):
            if off > end:
                gaps.append((end, off))
            end = max(end, off + n)
        if m.total_bytes > end:
            gaps.append((end, m.total_bytes))
        for start, stop in gaps:
            while start < stop:
                i = start // m.chunk_bytes
                cut = min(stop, (i + 1) * m.chunk_bytes)
                vb.view[start:cut] = bytes(cut - start)
                cov.add(i, start, cut)
                start = cut
        return cov

    def check(self, i: int, start: int, end: int) -> str:
        """'new' (no byte of [start, end) written), 'repeat' (all of it written) or 'overlap'."""
        spans = self.spans.get(i, [])
        k = bisect.bisect_right(spans, (start, float("inf")))
        if k and spans[k - 1][0] <= start and end <= spans[k - 1][1]:
            return "repeat"
        if k and spans[k - 1][1] > start:
            return "overlap"
        if k < len(spans) and spans[k][0] < end:
            return "overlap"
        return "new"

    def add(self, i: int, start: int, end: int) -> int:
        """Record [start, end) of chunk i as written; returns the chunk's bytes written so far."""
        bisect.insort(self.spans.setdefault(i, []), (start, end))
        self.filled[i] = self.filled.get(i, 0) + (end - start)
        self.last = time.monotonic()
        return self.filled[i]


class PartReceiver(UpstreamReceiver):
    HANDLERS = {wire.OFFER: "_offer", wire.RANGE: "_range", wire.PART_END: "_part_end"}
    WHO = "part upstream"

    def __init__(self, store: ShmStore, ch: wire.Channel, on_event: Callable[..., None] = lambda kind, **kw: None,
                 verifier: seal.Verifier | None = None, heartbeat_s: float = 0.0,
                 siblings: Callable[[], list] = lambda: [], gate=None):
        super().__init__(store, ch, on_event, verifier, heartbeat_s, gate)
        self.siblings = siblings  # the relay's part receivers (this one among them), for _hold
        self.working: tuple | None = None  # ident of the version this part is being sent for (None: done)
        self.version = -1
        self.lineage = 0
        self.nacked: set[int] = set()       # offsets refused and not yet received again
        self.ended: int | None = None       # PART_END seen: the number of ranges the part holds
        self.stats = {"ranges": 0, "bytes": 0, "corrupt": 0, "repeats": 0, "chunks": 0, "parts": 0}

    def _part_end(self, h: wire.Header) -> None:
        if h.version != self.version or h.b != self.lineage:
            return
        vb = self.vb
        if vb is not None and not vb.abandoned:
            try:
                seal.open_seal(h.payload, self.verifier, self.mdigest)  # its signature, now: fail early
            except seal.SealError as exc:
                raise LinkError(f"part upstream {self.conn.peer}: bad seal for v{h.version}: {exc}") from None
            with self.store.cond:
                if h.payload not in vb.seals:  # a host that reconnected sends the same seal again
                    vb.seals.append(h.payload)
            self._complete(vb)
        self.ended = h.a
        self._maybe_done()

    def _offer(self, h: wire.Header) -> None:
        others = [r for r in self.siblings() if r is not self]  # taken before the store's lock
        m, kind, vb = self._take_offer(h, older="busy", hold=lambda m: self._hold(m, others))
        self.vb, self.working, self.ended = None, None, None
        self.version, self.lineage = m.version, m.lineage
        if kind == "refuse":
            return
        if kind == "busy" and vb.ident == ident(m):  # the same version, other layout (begin resumes a same one)
            raise LinkError(f"part upstream {self.conn.peer} offered v{m.version} with another layout than "
                            "the one being assembled")
        if kind in ("hold", "busy"):  # another version's parts are still arriving: the upstream offers again
            self.conn.send(wire.WANT, m.version, a=BUSY, b=m.lineage)
            return
        mdigest = wire.manifest_digest(m)
        if kind == "take":
            with self.store.cond:
                if wire.manifest_digest(vb.manifest) != mdigest:
                    raise LinkError(f"part upstream {self.conn.peer} offered v{m.version} with another layout than "
                                    "the one being assembled")
                if not vb.abandoned:
                    self._cover(vb)  # made at the first offer; later offers are not progress (_hold)
            self.vb, self.working = vb, ident(m)
        self.mdigest, self.failures, self.nacked = mdigest, {}, set()
        self.conn.send(wire.WANT, m.version, a=0 if kind == "take" else wire.HAVE, b=m.lineage)
        self.on_event("offer", version=m.version, first_missing=0 if kind == "take" else chunk_count(m),
                      chunks=chunk_count(m), lineage=m.lineage, part=True)

    def _hold(self, m, others: list) -> bool:
        """Whether a newer offer of the same lineage must wait (caller holds the store's lock).
        While another host is still sending its part of the incoming version, a host that is done
        with it (or skipped it) and offers the next one would otherwise make the master drop it
        half-assembled, and a host whose link is slower than the trainer's publish rate would
        never complete one. Not held: once no other part upstream is working on the incoming
        version (it cannot complete: this host does not have it), or when no range has reached
        it for PART_STALL_S (a host gone silent), or for a new lineage."""
        inc = self.store.incoming
        cov = getattr(inc, "coverage", None) if inc is not None else None
        if (cov is None or inc.ident == ident(m) or inc.complete or not same_lineage(inc.manifest, m)
                or not supersedes(m, inc.manifest) or time.monotonic() - cov.last >= PART_STALL_S):
            return False
        return any(r.working == inc.ident for r in others)

    def _cover(self, vb: VersionBuffer) -> Coverage:
        """The coverage record of the incoming version (caller holds the store's condition),
        made at its first offer or range: alignment padding zeroed and counted, and a chunk of
        padding only marked present at once."""
        cov = getattr(vb, "coverage", None)
        if cov is None:
            cov = vb.coverage = Coverage.of(vb)
            vb.pieces = {}  # (offset, length) -> digest of each range placed (what the hosts' seals list)
            for i, filled in cov.filled.items():
                if not vb.have[i] and filled == chunk_range(vb.manifest, i)[1]:
                    self._mark(vb, i)
        return cov

    def _mark(self, vb: VersionBuffer, i: int) -> None:
        """Chunk i is whole: its checksum and content digest, computed here (caller holds the condition)."""
        chunk = vb.chunk(i)
        vb.mark(i, checksum(chunk), wire.content_digest(chunk))
        self.stats["chunks"] += 1
        self.store.cond.notify_all()

    def _range(self, h: wire.Header) -> None:
        vb, off, n = self.vb, h.a, h.length
        limit = vb.manifest.chunk_bytes if vb is not None else 1 << 30
        if n > limit:
            raise LinkError(f"range of {n} bytes exceeds the chunk size {limit}")
        data, digest = self.conn.read_data(h)
        if vb is None or h.version != vb.version or h.b != vb.manifest.lineage:
            self.stats["repeats"] += 1  # a version we have, or an older one: dropped
            return
        if n == 0 or off < 0 or off + n > vb.manifest.total_bytes:
            raise LinkError(f"range [{off}, {off + n}) outside v{vb.version}'s {vb.manifest.total_bytes} bytes")
        i = off // vb.manifest.chunk_bytes
        start, size = chunk_range(vb.manifest, i)
        if off + n > start + size:
            raise LinkError(f"range [{off}, {off + n}) spans chunks {i} and {i + 1}: a range lies inside one chunk")
        if digest is None:
            self._refused(vb, off)
            return
        self.failures.pop(off, None)
        self.nacked.discard(off)
        complete = False
        with self.store.cond:
            if not vb.abandoned:
                complete = self._place(vb, i, off, data, size, digest)
        if complete:
            self._complete(vb)
        self._maybe_done()

    def _place(self, vb: VersionBuffer, i: int, off: int, data: memoryview, size: int, digest: bytes) -> bool:
        """Write a verified range into the version (caller holds the condition); True when every
        chunk of the version is now present."""
        n = len(data)
        cov = self._cover(vb)
        seen = cov.check(i, off, off + n) if not vb.have[i] else "repeat"
        if seen == "overlap":
            raise LinkError(f"range [{off}, {off + n}) of v{vb.version} overlaps bytes another range wrote")
        if seen == "repeat":
            if vb.view[off:off + n] != data:
                raise LinkError(f"range [{off}, {off + n}) of v{vb.version} repeats written bytes with other bytes")
            self.stats["repeats"] += 1
            return False
        vb.view[off:off + n] = data
        vb.pieces[(off, n)] = digest
        self.stats["ranges"] += 1
        self.stats["bytes"] += n
        if cov.add(i, off, off + n) == size:
            self._mark(vb, i)
            return vb.complete
        return False

    def _complete(self, vb: VersionBuffer) -> None:
        """Commit the version once every byte is here and the hosts' seals cover all of them."""
        with self.store.cond:
            if not vb.complete or vb.sealed or vb.abandoned:
                return
            seals = list(vb.seals)
            known = {**vb.known_digests(), **vb.pieces}
        try:
            pieces = seal.pieces_of(vb.manifest, seals, self.verifier, self.mdigest)
        except seal.SealError:
            pieces = None  # checked in full (and refused) below
        if pieces is not None and seal.uncovered_tensor_bytes(vb.manifest, seal.gaps(vb.manifest, pieces)):
            return  # another host's seal (its PART_END) is still to come
        if self._finish(vb, known):
            self.on_event("complete", version=vb.version, chunks=vb.n, lineage=vb.manifest.lineage,
                          run_id=vb.manifest.run_id)

    def _refused(self, vb: VersionBuffer, off: int) -> None:
        self.stats["corrupt"] += 1
        k = self.failures[off] = self.failures.get(off, 0) + 1
        log.warning("range_mac_refused", peer=self.conn.peer, version=vb.version, offset=off, in_a_row=k)
        self.on_event("corrupt", version=vb.version, chunk=off // vb.manifest.chunk_bytes, offset=off)
        if k >= MAX_MAC_FAILURES:
            raise LinkError(f"range at {off} of v{vb.version} from {self.conn.peer} failed its MAC {k} times in a row")
        self.nacked.add(off)
        self.conn.send(wire.NACK, vb.version, a=off, b=vb.manifest.lineage)

    def _maybe_done(self) -> None:
        """DONE once PART_END came and every refused range arrived again. (Also for a version the
        master abandoned meanwhile, superseded by a newer one: nothing of it is wanted any more.)"""
        if self.ended is None or self.nacked:
            return
        self.working = None
        self.conn.send(wire.DONE, self.version, a=self.ended, b=self.lineage)
        self.stats["parts"] += 1
        self.on_event("part_in", version=self.version, ranges=self.ended, peer=self.conn.peer)
        self.ended = None
