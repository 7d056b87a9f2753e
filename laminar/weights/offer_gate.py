"""OfferGate: what a relay asks about an OFFER before it takes it (the receiver's `gate`).

Two kinds of upstream, two rules:

- the trainer's own links (PUBLISH, PART: proven with the trainer's signing key when the relay
  has its public key) are authoritative: the run they offer is the run (`RunPin.announce`), and
  their layout is the model's;
- a relay upstream (LINK) holds only the cluster secret, which every host has. Its offer is
  refused (WANT REFUSED, its `why` in the payload, `offer_refused` logged naming the peer):
  * of another run than the pinned one (run_pin.py), after waiting `run_wait_s` for the trainer
    to announce it: a recorded version of an earlier run is sealed by the same key and would
    otherwise roll the weights back;
  * too large: above `max_bytes` when it is set; otherwise, for the run held, above twice the
    held version (room for a change of the published dtype, never a 16 GiB slot on a relay
    holding 1 GiB), and for a first version or a new run, above what the shared-memory
    filesystem can hold. A slot is allocated and the offer forwarded down the chain before any
    seal can be checked, so the bound has to come first.

Constant work per offer (a comparison, one statvfs), nothing per chunk.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import structlog

from laminar.protocol import Manifest
from laminar.weights.run_pin import RunPin
from laminar.weights.store import ShmStore

log = structlog.get_logger("laminar.weights.offer_gate")
MiB = 1 << 20


def size_refusal(m: Manifest, held: Manifest | None, max_bytes: int | None, room: int) -> str:
    """Why a relay link's offer of `m` is too large ("" = it is not). `held`: the current version's
    manifest; `room`: bytes the shared-memory filesystem can still give a slot."""
    if max_bytes and m.total_bytes > max_bytes:
        return (f"v{m.version} is {m.total_bytes / MiB:.1f} MiB, above this relay's max_version_mb "
                f"({max_bytes / MiB:.1f} MiB)")
    if held is not None and held.run_id == m.run_id:
        if m.total_bytes > 2 * held.total_bytes:
            return (f"v{m.version} is {m.total_bytes / MiB:.1f} MiB, more than twice the version held "
                    f"({held.total_bytes / MiB:.1f} MiB) of the same run (set roles.relay.max_version_mb to allow it)")
        return ""
    if not max_bytes and m.total_bytes > room:
        return (f"v{m.version} is {m.total_bytes / MiB:.1f} MiB; the relay's shared memory can give "
                f"{room / MiB:.1f} MiB")
    return ""


class OfferGate:
    """The run pin and the size bound of one relay (node.py hands `link` or `trainer` to a receiver)."""

    def __init__(self, relay_id: str, store: ShmStore, pin: RunPin, run_wait_s: float = 5.0,
                 max_bytes: int | None = None):
        self.relay_id, self.store, self.pin = relay_id, store, pin
        self.run_wait_s, self.max_bytes = run_wait_s, max_bytes
        self.refused = {"run": 0, "size": 0}

    def trainer(self, m: Manifest) -> tuple[str, str] | None:
        """A trainer's offer: its run is the run."""
        if self.pin.announce(m.run_id):
            log.info("run_pinned", relay=self.relay_id, run_id=m.run_id, by="the trainer's own link")
        return None

    def link(self, m: Manifest) -> tuple[str, str] | None:
        """A relay upstream's offer: None to take it, else (kind, why)."""
        held = self._held()
        held_run = held.run_id if held is not None else ""
        if not self.pin.wait(m.run_id, held_run, self.run_wait_s):
            self.refused["run"] += 1
            return "run", (f"v{m.version} is of run {m.run_id!r}; this relay is pinned to run "
                           f"{self.pin.pinned(held_run)!r} (the trainer announces its run; weights sealed for "
                           f"another run are refused)")
        why = size_refusal(m, held, self.max_bytes, self._room())
        if why:
            self.refused["size"] += 1
            return "size", why
        return None

    def _held(self) -> Manifest | None:
        with self.store.cond:
            cur = self.store.current
            return cur.manifest if cur is not None else None

    def _room(self) -> int:
        """Free bytes of the store's filesystem, plus the slot files a new version may replace."""
        try:
            room = shutil.disk_usage(self.store.dir).free
        except OSError:
            return 0
        cur = self.store.current
        for slot in (0, 1):
            if cur is not None and cur.slot == slot:
                continue
            try:
                room += os.stat(Path(self.store.slot_path(slot))).st_size
            except OSError:
                pass
        return room
