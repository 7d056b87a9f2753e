"""In-flight trajectory state on a rollout, and its delta outbox.

Deltas are frozen once cut: a delta with sequence number s always carries the same tokens, so a
retry after a lost reply is exactly the same write (the partial pool applies each seq once).
New tokens go into the next seq. The outbox is emptied only by acknowledgements.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np

from laminar.protocol import PartialState, TokenDelta, TrajectorySpec


@dataclass
class Active:
    spec: TrajectorySpec
    version: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    next_seq: int = 0          # seq of the next delta to cut
    cut: int = 0               # tokens already cut into deltas
    outbox: list[TokenDelta] = field(default_factory=list)
    task: asyncio.Task | None = None
    attempt: int = 0
    timings: dict[str, float] = field(default_factory=lambda: {"started": time.time()})

    @property
    def id(self) -> str:
        return self.spec.trajectory_id

    @property
    def remaining(self) -> int:
        return self.spec.max_tokens - len(self.tokens)

    def cut_delta(self) -> None:
        """Freeze tokens generated since the last cut into the next delta (seq 0 carries spec)."""
        if self.cut == len(self.tokens) and self.next_seq > 0:
            return
        self.outbox.append(TokenDelta(
            trajectory_id=self.id, seq=self.next_seq,
            tokens=np.asarray(self.tokens[self.cut:], dtype=np.int32),
            logprobs=np.asarray(self.logprobs[self.cut:], dtype=np.float32),
            version=self.version, spec=self.spec if self.next_seq == 0 else None))
        self.next_seq += 1
        self.cut = len(self.tokens)

    def acked(self, upto_seq: int) -> None:
        self.outbox = [d for d in self.outbox if d.seq > upto_seq]

    def partial(self, rollout_id: str) -> PartialState:
        return PartialState(spec=self.spec, tokens=np.asarray(self.tokens, dtype=np.int32),
                            logprobs=np.asarray(self.logprobs, dtype=np.float32),
                            version=self.version, rollout_id=rollout_id, next_seq=self.next_seq)

    @classmethod
    def resume(cls, p: PartialState) -> "Active":
        a = cls(spec=p.spec, version=p.version, tokens=[int(t) for t in p.tokens],
                logprobs=[float(x) for x in p.logprobs], next_seq=p.next_seq)
        a.cut = len(a.tokens)
        a.timings["migrated_in"] = time.time()
        return a
