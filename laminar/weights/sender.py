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
chunk it lacks, so a re-linked chain resumes there) -> chunks k..n-1, each sent as soon as the
source holds the contiguous prefix up to it (so a relay forwards chunk i while chunk i+1 is still
arriving) -> NACKed chunks again -> DONE.
A version abandoned by the source (superseded before it completed) is dropped mid-way and the
newest one offered instead; so is an older version a relay is still forwarding when a newer one
starts arriving (`source.preempt`). The publisher sends each version it started to completion, so
a fast trainer cannot starve the chain (intermediate versions are skipped, never half-sent).

Every CHUNK carries its MAC (wire.py, chunk MACs): the one a relay's receiver verified and kept
with the chunk, or, from the publisher, one computed here over the trainer's bytes.

Backpressure: the kernel's socket buffer; nothing is queued in Python beyond the events the
downstream sends back (bounded by the chunk count). Failures: any LinkError (including no WANT
or DONE within `ack_timeout_s`) ends `run()` with that error; the owner reports the link down.
"""
from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

from laminar.weights import wire
from laminar.weights.manifest import checksum, manifest_to_bytes, with_version
from laminar.weights.transport import Conn, LinkError


class Sender:
    def __init__(self, source: Any, conn: Conn, name: str = "sender", ack_timeout_s: float = 30.0,
                 on_delivered: Callable[[int], None] = lambda v: None, key: bytes | None = None):
        self.source, self.conn, self.name = source, conn, name
        # chunk MACs: a relay forwards the MAC it verified with each chunk; the publisher (whose
        # `key` is the data-plane key) computes them from the trainer's bytes
        self.mac_key = wire.mac_key(getattr(source, "key", b"") if key is None else key)
        self.cond: threading.Condition = source.cond
        self.ack_timeout_s = ack_timeout_s
        self.on_delivered = on_delivered
        self.events: collections.deque[wire.Header] = collections.deque()
        self.failed: BaseException | None = None
        self.stopping = False
        # ident (run, lineage, number) of the version delivered last; -1 before the first, which
        # a source written for plain numbers (`version > delivered`) still understands
        self.delivered: tuple | int = -1
        self.stats = {"chunks": 0, "bytes": 0, "resent": 0, "versions": 0}
        # A relay drops an older version mid-stream when a newer one starts arriving (its
        # upstream always completes what it streams, so the chain cannot starve); the publisher
        # never does (a trainer publishing faster than the link must not starve the master).
        self.preempt = getattr(source, "preempt", False)

    def stop(self) -> None:
        self.stopping = True
        self.conn.close()
        with self.cond:
            self.cond.notify_all()

    # -- reader: the downstream's WANT / NACK / DONE -----------------------------------------
    def _read(self) -> None:
        try:
            while True:
                h = wire.recv(self.conn)
                wire.recv_small(self.conn, h)
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
        try:
            while True:
                with self.cond:
                    self.cond.wait_for(lambda: self.stopping or self.source.stopped or self.failed
                                       or self.source.pick(self.delivered) is not None)
                    self._check()
                    vb = self.source.pick(self.delivered)
                    self.source.acquire(vb)
                try:
                    if self._send_version(vb):
                        self.delivered = vb.ident
                        self.stats["versions"] += 1
                        self.on_delivered(vb.version)
                finally:
                    self.source.release(vb)
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

    def _offer(self, vb) -> tuple[wire.Header, bytes]:
        """OFFER `vb` (its manifest without MACs) and wait for the WANT: (the WANT, the digest
        of the offered manifest that every MAC of this version binds)."""
        layout = dataclasses.replace(with_version(vb.manifest, vb.version), macs=[])
        wire.send(self.conn, wire.OFFER, vb.version, a=vb.n, b=vb.manifest.lineage, payload=manifest_to_bytes(layout))
        deadline = time.monotonic() + self.ack_timeout_s
        with self.cond:
            while True:
                self._check()
                h = self._next_event(vb, deadline)
                if h is not None and h.type == wire.WANT:
                    return h, wire.manifest_digest(layout)
                self.cond.wait(timeout=0.5)

    def _send_version(self, vb) -> bool:
        """Deliver one version; False if the source abandoned it first."""
        macs = getattr(vb, "macs", None)
        h, mdigest = self._offer(vb)
        deadline = time.monotonic() + self.ack_timeout_s
        nxt, resend, done = h.a, collections.deque(), h.a >= vb.n
        lazy = getattr(vb, "lazy_checksums", False)
        while not done:
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
                    if done or resend or (nxt < vb.n and vb.prefix > nxt):
                        break
                    if vb.abandoned or (self.preempt and self.source.pick(vb.ident) is not None):
                        return False
                    if nxt < vb.n:
                        deadline = time.monotonic() + self.ack_timeout_s  # waiting on upstream
                    self.cond.wait(timeout=0.5)
            if done:
                break
            if resend:
                i = resend.popleft()
                self.stats["resent"] += 1
            else:
                i, nxt = nxt, nxt + 1
            view = vb.chunk(i)
            if lazy and not vb.hashed[i]:
                vb.checksums[i], vb.hashed[i] = checksum(view), 1
            tag = macs[i] if macs is not None and macs[i] else wire.chunk_mac(self.mac_key, mdigest, i, view)
            self.conn.send(wire.Header(wire.CHUNK, vb.version, i, vb.checksums[i], len(view), tag).pack(), view)
            deadline = time.monotonic() + self.ack_timeout_s  # it accepted data: it is alive
            self.stats["chunks"] += 1
            self.stats["bytes"] += len(view)
        return True


class _Stopped(Exception):
    pass
