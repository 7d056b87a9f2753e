"""In-memory state of the partial pool, and the exactly-once delta logic (no I/O here).

Per trajectory: spec, owner rollout, version, tokens and logprobs applied so far, and `next_seq`.
A delta with seq < next_seq is a duplicate (ignored); seq == next_seq is applied, then any held
successors are applied in order; seq > next_seq is held until the gap fills (at most
`max_held` per trajectory, beyond which it is rejected). A trajectory is created by its seq 0,
which carries the spec; later deltas for a trajectory never seen are held the same way, and a
delta for a completed trajectory is rejected. The result of any interleaving, duplication or
reordering of one stream is the state of the in-order stream.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from laminar.protocol import PartialState, TokenDelta, TrajectorySpec


@dataclass
class Entry:
    spec: TrajectorySpec | None
    owner: str
    version: int
    tokens: list[np.ndarray] = field(default_factory=list)
    logprobs: list[np.ndarray] = field(default_factory=list)
    next_seq: int = 0
    held: dict[int, TokenDelta] = field(default_factory=dict)

    def state(self) -> PartialState:
        cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)  # noqa: E731
        return PartialState(spec=self.spec, tokens=cat(self.tokens, np.int32),
                            logprobs=cat(self.logprobs, np.float32), version=self.version,
                            rollout_id=self.owner, next_seq=self.next_seq)


@dataclass
class Outcome:
    applied: list[tuple[str, TokenDelta]] = field(default_factory=list)  # to persist, in order
    duplicates: int = 0
    held: int = 0
    rejected: dict[str, str] = field(default_factory=dict)


class PartialBook:
    def __init__(self, max_held: int = 256):
        self.entries: dict[str, Entry] = {}
        self.completed: set[str] = set()
        self.max_held = max_held

    def apply(self, owner: str, deltas: list[TokenDelta], out: Outcome | None = None) -> Outcome:
        out = out or Outcome()
        for d in deltas:
            tid = d.trajectory_id
            if tid in self.completed:
                out.rejected[tid] = "trajectory already completed"
                continue
            e = self.entries.get(tid)
            if e is None:
                e = self.entries[tid] = Entry(spec=None, owner=owner, version=d.version)
            if d.seq < e.next_seq or d.seq in e.held:
                out.duplicates += 1
                continue
            if d.seq > e.next_seq:
                if len(e.held) >= self.max_held:
                    out.rejected[tid] = f"more than {self.max_held} deltas held waiting for seq {e.next_seq}"
                    continue
                e.held[d.seq] = d
                out.held += 1
                continue
            if d.seq == 0 and (d.spec is None or d.spec.trajectory_id != tid):
                out.rejected[tid] = "seq 0 must carry the trajectory's own spec"
                continue
            self._apply_one(e, owner, d, out)
            while e.next_seq in e.held:
                out.held -= 1
                self._apply_one(e, owner, e.held.pop(e.next_seq), out)
        return out

    def _apply_one(self, e: Entry, owner: str, d: TokenDelta, out: Outcome) -> None:
        if d.seq == 0:
            e.spec = d.spec
        e.owner, e.version = owner, d.version
        e.tokens.append(np.asarray(d.tokens, dtype=np.int32))
        e.logprobs.append(np.asarray(d.logprobs, dtype=np.float32))
        e.next_seq = d.seq + 1
        out.applied.append((owner, d))

    def live(self) -> dict[str, Entry]:
        """Trajectories with a spec (seq 0 applied)."""
        return {t: e for t, e in self.entries.items() if e.spec is not None}

    def complete(self, tid: str) -> bool:
        self.completed.add(tid)
        return self.entries.pop(tid, None) is not None
