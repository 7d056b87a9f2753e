"""Sender: streams versions from a source to one downstream connection (relay forwarder and the
trainer's publisher both use it), pipelined chunk by chunk.

Source API (ShmStore for a relay, the publisher's staging for the trainer): `cond` (a
threading.Condition that is notified whenever a chunk becomes present or a version appears),
`pick(delivered)` (the newest version unless it is `delivered`, the ident (run, lineage,
number) of the version delivered last (-1 before the first), or None; a new lineage counts as
new whatever its number), `acquire(vb)` (called under `cond`) / `release(vb)` around streaming
it (so its memory is not reused meanwhile), `stopped`.

Per version: OFFER (b = lineage) -> the downstream's WANT k (b echoes the lineage, as do its
NACK and DONE: an answer about an abandoned A:v is never taken for one about B:v) (the first
chunk it lacks, so a re-linked chain resumes there; HAVE: it holds v or newer as current;
REFUSED: it holds a newer lineage of the run, or declined the offer (another run, too large:
offer_gate.py), never counted delivered) -> chunks k..n-1, each sent as soon as the source holds
the contiguous prefix up to it (so a relay forwards chunk i while chunk i+1 is still arriving) -> NACKed chunks again ->
SEAL, once the source's version is sealed (a relay: its own upstream's SEAL verified; the
publisher: signed here, over the digests of the chunks it sent) -> DONE.
A version abandoned by the source (superseded before it completed) is dropped mid-way and the
newest one offered instead; so is an older version a relay is still forwarding when a newer one
starts arriving (`source.preempt`). The publisher sends each version it started to completion, so
a fast trainer cannot starve the chain (intermediate versions are skipped, never half-sent).

Every CHUNK carries its content digest (wire.py): the one a relay's receiver verified and kept
with the chunk, or, from the publisher, one computed here over the trainer's bytes as it goes out
(the same pass gives the publisher the digests its seal signs). The link sends a PING when idle
(`heartbeat_s`) and gives up when the downstream sends nothing for its idle timeout.

A refusal for a newer lineage is taken at its word only with proof: given the trainer's public key
(`verifier`), the refusal must carry the held version's manifest with a seal that key signed, of
this run and a higher lineage; a claim without one (a hostile relay answering the trainer's
publisher with lineage 10**9, so that the trainer records it and fails at every restart) is
logged (`refusal_unproven`, naming the peer) and counted, and the version is not offered again,
but `on_refused` is not called. Declines of another kind (run, size) go to `on_declined` (by
default `on_refused`).

Backpressure: the kernel's socket buffer; nothing is queued in Python beyond the events the
downstream sends back (bounded by the chunk count). Failures: any LinkError (including no WANT
or DONE within `ack_timeout_s`) ends `run()` with that error; the owner reports the link down.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import structlog

from laminar.weights import seal, wire
from laminar.weights.manifest import chunk_range, manifest_from_bytes, manifest_to_bytes, with_version
from laminar.weights.transport import LinkError

log = structlog.get_logger("laminar.weights.sender")

DELIVERED, SKIPPED, REFUSED = "delivered", "skipped", "refused"  # what became of a version sent
BATCH = 16  # chunks sent per wake-up at most, so the downstream's answers are read between batches


class Sender:
    """Streams the source's newest versions to one downstream link (see the module docstring)."""

    def __init__(self, source: Any, conn: wire.Channel, name: str = "sender", ack_timeout_s: float = 30.0,
                 on_delivered: Callable[[int], None] = lambda v: None,
                 on_refused: Callable[[int, str], None] = lambda v, why: None, heartbeat_s: float = 0.0,
                 verifier: seal.Verifier | None = None, on_declined: Callable[[int, str], None] | None = None):
        self.source, self.conn, self.name = source, conn, name
        self.verifier = verifier  # the trainer's public key: a lineage refusal must prove itself with it
        self.on_declined = on_declined or on_refused
        self.cond: threading.Condition = source.cond
        self.ack_timeout_s, self.heartbeat_s = ack_timeout_s, heartbeat_s
        self.on_delivered, self.on_refused = on_delivered, on_refused
        self.events: collections.deque[wire.Header] = collections.deque()
        self.failed: BaseException | None = None
        self.stopping = False
        # ident (run, lineage, number) of the version delivered (or refused) last; -1 before the
        # first, which a source written for plain numbers (`version > delivered`) still understands
        self.delivered: tuple | int = -1
        self.stats = {"chunks": 0, "bytes": 0, "resent": 0, "versions": 0, "refused": 0, "refused_unproven": 0,
                      "from_file": 0}  # from_file: chunks sent straight from the source's file
        # A relay drops an older version mid-stream when a newer one starts arriving (its
        # upstream always completes what it streams, so the chain cannot starve); the publisher
        # never does (a trainer publishing faster than the link must not starve the master).
        self.preempt = getattr(source, "preempt", False)
        # the publisher seals its versions itself (signs them); a relay forwards the seals it verified
        self.make_seals = getattr(source, "make_seals", None)
        # a relay's store: chunks go out straight from the version's slot file (no copy into the socket)
        self.open_file = getattr(source, "open_file", None)
        self.file: int | None = None  # the descriptor of the version being sent, while it is

    def stop(self) -> None:
        self.stopping = True
        self.conn.close()
        with self.cond:
            self.cond.notify_all()

    # -- reader: the downstream's WANT / NACK / DONE -----------------------------------------
    def _read(self) -> None:
        try:
            while True:
                h = self.conn.recv()
                with self.cond:
                    self.events.append(h)
                    self.cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to run(), which raises it
            with self.cond:
                self.failed = exc
                self.cond.notify_all()

    def _check(self) -> None:
        if self.stopping or self.source.stopped:
            raise _Stopped()
        if self.failed is not None:
            raise LinkError(f"{self.name}: {self.failed}")

    def run(self) -> None:
        """Stream until stopped (returns) or the link fails (raises LinkError)."""
        reader = threading.Thread(target=self._read, name=f"{self.name}-reader", daemon=True)
        reader.start()
        self.conn.start_heartbeat(self.heartbeat_s)
        try:
            while True:
                with self.cond:
                    self.cond.wait_for(lambda: self.stopping or self.source.stopped or self.failed
                                       or self.source.pick(self.delivered) is not None)
                    self._check()
                    vb = self.source.pick(self.delivered)
                    self.source.acquire(vb)
                self.file = self.open_file(vb) if self.open_file is not None else None
                try:
                    result = self._send_version(vb)
                finally:
                    if self.file is not None:
                        os.close(self.file)
                        self.file = None
                    self.source.release(vb)
                if result == DELIVERED:
                    self.delivered = vb.ident
                    self.stats["versions"] += 1
                    self.on_delivered(vb.version)
                elif result == REFUSED:  # never offered again: the downstream will not take it
                    self.delivered = vb.ident
                    self.stats["refused"] += 1
        except _Stopped:
            return
        finally:
            self.conn.close()
            reader.join(timeout=5.0)

    def _next_event(self, vb, deadline: float) -> wire.Header | None:
        """Pop the next event about `vb` (caller holds cond); stale ones are dropped."""
        while self.events:
            h = self.events.popleft()
            if h.version == vb.version and h.b == vb.manifest.lineage:
                return h
        if time.monotonic() > deadline:
            raise LinkError(f"{self.name}: no answer from {self.conn.peer} within {self.ack_timeout_s}s")
        return None

    def _offer(self, vb) -> wire.Header:
        """OFFER `vb` (its manifest without checksums or seals) and wait for the WANT."""
        layout = dataclasses.replace(with_version(vb.manifest, vb.version), macs=[], seals=[])
        self.conn.send(wire.OFFER, vb.version, a=vb.n, b=vb.manifest.lineage, payload=manifest_to_bytes(layout))
        deadline = time.monotonic() + self.ack_timeout_s
        with self.cond:
            while True:
                self._check()
                h = self._next_event(vb, deadline)
                if h is not None and h.type == wire.WANT:
                    return h
                self.cond.wait(timeout=0.5)

    def _refused(self, vb, h: wire.Header) -> str:
        """The downstream refused `vb`: a newer lineage it holds (with proof), or a decline; say so."""
        try:
            held = msgpack.unpackb(h.payload)
        except Exception:  # noqa: BLE001 - the refusal stands; only its detail is unreadable
            held = None
        held = held if isinstance(held, dict) else {}
        kind = held.get("why", "lineage")
        if kind != "lineage":
            self.on_declined(vb.version, f"{self.conn.peer} refused v{vb.version} ({kind}): {held.get('detail', '')}")
            return REFUSED
        unproven, shown = self._unproven(vb, held)
        if shown is not None:  # checked: name what the seal shows, not what the payload says
            held = {"lineage": shown.lineage, "version": shown.version}
        if unproven:
            self.stats["refused_unproven"] += 1
            log.error("refusal_unproven", sender=self.name, peer=self.conn.peer, version=vb.version,
                      lineage=vb.manifest.lineage, claimed_lineage=held.get("lineage"), why=unproven)
            return REFUSED
        what = f"lineage {held.get('lineage', '?')} (v{held.get('version', '?')})" if held else "a newer lineage"
        why = (f"{self.conn.peer} refused v{vb.version} of lineage {vb.manifest.lineage}: it holds {what} of this "
               f"run, which is newer; a trainer's lineage only goes up (docs/weights.md)")
        self.on_refused(vb.version, why)
        return REFUSED

    def _unproven(self, vb, held: dict) -> tuple[str, object]:
        """Why a lineage refusal does not prove itself ("" = it does, or there is no key to check),
        and the manifest it shows once checked: of this run, a higher lineage, sealed by the trainer."""
        if self.verifier is None:
            return "", None
        try:
            m = manifest_from_bytes(bytes(held.get("manifest", b"")))
        except (ValueError, TypeError):
            return "the refusal carries no manifest of the version it holds", None
        if m.run_id != vb.manifest.run_id or m.lineage <= vb.manifest.lineage:
            return (f"the version it shows is of run {m.run_id!r} lineage {m.lineage}, not a newer lineage of "
                    "this run"), None
        if not m.seals:
            return "the version it shows carries no seal", None
        try:
            seal.open_seal(bytes(m.seals[0]), self.verifier, wire.manifest_digest(m))
        except seal.SealError as exc:
            return f"the seal it shows does not verify: {exc}", None
        return "", m

    def _seals(self, vb) -> list[bytes] | None:
        """The version's seals, or None while its source has not sealed it (caller holds cond)."""
        if getattr(vb, "sealed", False):
            return vb.seals
        return self.make_seals(vb) if self.make_seals is not None else None

    def _digest(self, vb, i: int, view) -> bytes:
        d = vb.digests[i]
        if not d:
            d = vb.digests[i] = wire.content_digest(view)
        return d

    def _send_version(self, vb) -> str:
        """Deliver one version: DELIVERED, SKIPPED (the source abandoned it first) or REFUSED.
        Each wake-up sends every chunk then ready (up to BATCH): the NACKed ones, else the
        present prefix beyond what went out; from `self.file` when the source gave one."""
        h = self._offer(vb)
        if h.a == wire.REFUSED:
            return self._refused(vb, h)
        if h.a == wire.HAVE:
            return DELIVERED
        if h.a < 0:
            raise LinkError(f"{self.name}: unexpected WANT {h.a} from {self.conn.peer}")
        deadline = time.monotonic() + self.ack_timeout_s
        nxt, resend, done, sealed = h.a, collections.deque(), False, False
        while not done:
            seals, batch = None, ()
            with self.cond:
                while True:
                    self._check()
                    h = self._next_event(vb, deadline)
                    if h is not None:
                        deadline = time.monotonic() + self.ack_timeout_s
                        if h.type == wire.NACK and 0 <= h.a < vb.n:
                            resend.append(h.a)
                        elif h.type == wire.DONE:
                            done = True
                        continue
                    if done:
                        break
                    if resend:
                        batch = [resend.popleft() for _ in range(min(len(resend), BATCH))]
                        self.stats["resent"] += len(batch)
                        break
                    if nxt < vb.n and vb.prefix > nxt:
                        upto = min(vb.prefix, nxt + BATCH)
                        batch, nxt = range(nxt, upto), upto
                        break
                    if nxt >= vb.n and not sealed:
                        seals = self._seals(vb)
                        if seals is not None:
                            break
                    if vb.abandoned or (self.preempt and self.source.pick(vb.ident) is not None):
                        return SKIPPED
                    if nxt < vb.n or not sealed:
                        deadline = time.monotonic() + self.ack_timeout_s  # waiting on upstream
                    self.cond.wait(timeout=0.5)
            if done:
                break
            if seals is not None and not batch:
                self.conn.send(wire.SEAL, vb.version, b=vb.manifest.lineage, payload=msgpack.packb(seals))
                sealed = True
                deadline = time.monotonic() + self.ack_timeout_s
                continue
            for i in batch:
                self._check()
                self._send_chunk(vb, i, self.file)
            if batch:
                deadline = time.monotonic() + self.ack_timeout_s  # it accepted data: it is alive
        return DELIVERED

    def _send_chunk(self, vb, i: int, fd: int | None) -> None:
        start, n = chunk_range(vb.manifest, i)
        view = vb.view[start:start + n]
        self.conn.send(wire.CHUNK, vb.version, a=i, b=vb.manifest.lineage, payload=view,
                       digest=self._digest(vb, i, view), file=None if fd is None else (fd, start))
        self.stats["chunks"] += 1
        self.stats["bytes"] += n
        self.stats["from_file"] += fd is not None


class _Stopped(Exception):
    pass
