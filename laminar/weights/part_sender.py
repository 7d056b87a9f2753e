"""PartSender: streams one host's byte ranges of each version to the master relay.

The hosts of a trainer whose FSDP2 ranks span several hosts each hold, in their staging, only the
rows their own ranks own (roles/trainer/sharded_publish.py, mode `hosts`). Each host's publisher
(laminar.weights.publisher, `part=True`) runs a PartSender over a connection authenticated with
purpose PART, and the master relay assembles the version from every host's ranges
(part_receiver.py). Per version (wire.py has the messages):

    OFFER (manifest) -> WANT (HAVE: the relay holds it, nothing to send; BUSY: the relay still
    assembles an older version, so offer the newest again in BUSY_RETRY_S; REFUSED: it holds a
    newer lineage of the run) -> RANGE for each (offset, length) of `vb.ranges`, each with its
    content digest -> PART_END (a = number of ranges; payload: this host's seal, its ranges and
    their digests signed with the trainer's key) -> NACKed ranges again -> DONE (this part is in)

`vb.ranges` are cut at chunk boundaries (a range lies inside one chunk; `split_ranges`). The
version counts as delivered for this host when its DONE arrives; the version is whole at the
relay when every host's part is in. Like the single publisher's Sender, a part sender finishes
each version it started (a faster trainer only makes it skip intermediate versions).
"""
from __future__ import annotations

import collections
import time

from laminar.weights import wire
from laminar.weights.sender import DELIVERED, SKIPPED, Sender

BUSY_RETRY_S = 0.2


def split_ranges(ranges, chunk_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) byte ranges merged where they touch, then cut at chunk boundaries."""
    merged: list[list[int]] = []
    for off, n in sorted((int(o), int(k)) for o, k in ranges if k > 0):
        if merged and off <= merged[-1][0] + merged[-1][1]:
            end = max(merged[-1][0] + merged[-1][1], off + n)
            merged[-1][1] = end - merged[-1][0]
        else:
            merged.append([off, n])
    out = []
    for off, n in merged:
        end = off + n
        while off < end:
            stop = min(end, (off // chunk_bytes + 1) * chunk_bytes)
            out.append((off, stop - off))
            off = stop
    return out


class PartSender(Sender):
    """A Sender whose versions carry `ranges`: only those bytes are sent, as RANGE messages."""

    def _send_version(self, vb) -> str:
        ranges = list(getattr(vb, "ranges", ()))
        lengths = dict(ranges)
        lineage = vb.manifest.lineage
        h = self._offer(vb)
        if h.a == wire.REFUSED:
            return self._refused(vb, h)
        if h.a == wire.BUSY:  # the master still assembles an older version: offer the newest again soon
            with self.cond:
                self.cond.wait(timeout=BUSY_RETRY_S)
            self.stats["busy"] = self.stats.get("busy", 0) + 1
            return SKIPPED
        if h.a == wire.HAVE:  # the relay holds this version already
            return DELIVERED
        deadline = time.monotonic() + self.ack_timeout_s
        pending = collections.deque(ranges)
        resend: collections.deque[int] = collections.deque()
        digests: dict[int, bytes] = {}
        ended = done = False
        while not done:
            with self.cond:
                while True:
                    self._check()
                    h = self._next_event(vb, deadline)
                    if h is None:
                        break
                    deadline = time.monotonic() + self.ack_timeout_s
                    if h.type == wire.NACK and h.a in lengths:
                        resend.append(h.a)
                    elif h.type == wire.DONE:
                        done = True
                if done:
                    break
                if not (pending or resend):
                    if not ended:
                        seal = self.source.make_part_seal(vb, [(o, lengths[o], digests[o]) for o, _ in ranges])
                        self.conn.send(wire.PART_END, vb.version, a=len(ranges), b=lineage, payload=seal)
                        ended = True
                    self.cond.wait(timeout=0.5)
                    continue
            if resend:
                off = resend.popleft()
                self.stats["resent"] += 1
            else:
                off = pending.popleft()[0]
            view = vb.view[off:off + lengths[off]]
            if off not in digests:
                digests[off] = wire.content_digest(view)
            self.conn.send(wire.RANGE, vb.version, a=off, b=lineage, payload=view, digest=digests[off])
            deadline = time.monotonic() + self.ack_timeout_s
            self.stats["chunks"] += 1
            self.stats["bytes"] += len(view)
        return DELIVERED
