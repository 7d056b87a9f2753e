"""In-flight trajectory state on a rollout, and its delta outbox.

Deltas are frozen once cut: a delta with sequence number s always carries the same tokens, so a
retry after a lost reply is exactly the same write (the partial pool applies each seq once).
New tokens go into the next seq. The outbox is emptied only by acknowledgements.

A multi-turn trajectory (multiturn.py) also appends environment observations: their tokens get
loss mask 0 and logprob 0, and each environment reply is recorded as a span [start, end) of the
response (`obs_spans`, the reset's first). Mask and spans travel in the deltas and in the
partial state, so a migrated or recovered trajectory resumes its episode where it was.

Every delta carries the trajectory's ownership epoch (`epoch`, kept from the PartialState it was
resumed from): a write from an owner the partial pool has fenced off is refused, and the rollout
then drops the trajectory (`fenced`), since its new owner continues it. Each delta also names the
lineage epoch of its version (`lineage`), which the partial pool hands back in the PartialState.

Mixture-of-experts routing (`routing`, laminar/models/routing.py): the experts the engine chose for
each processed position, appended as the engine reports them (routing_capture.py's puller), cut
into deltas like the tokens but on its own counter (`routing_cut`: a position's row comes a step
after its token), carried by the partial state and kept on resume: rows recorded by an earlier
rollout are never replaced. `request_id` names the engine request now generating it (the puller
asks the engine for that request's rows).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np

from laminar.models.routing import append_rows
from laminar.protocol import PartialState, TokenDelta, TrajectorySpec


def _mask_array(mask: list[int]) -> np.ndarray | None:
    """uint8 array of a mask, None when every token is the policy's (the single-turn case)."""
    return None if all(mask) else np.asarray(mask, dtype=np.uint8)


def _spans_array(spans: list[tuple[int, int]]) -> np.ndarray | None:
    return np.asarray(spans, dtype=np.int32).reshape(-1, 2) if spans else None


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
    mask: list[int] = field(default_factory=list)           # 1 per policy token, 0 per observation token
    obs_spans: list[tuple[int, int]] = field(default_factory=list)  # environment replies, in order
    spans_cut: int = 0         # spans already cut into deltas
    epoch: int = 0             # ownership epoch in the partial pool (PartialState.epoch): on every delta
    fenced: bool = False       # the partial pool refused its writes (another owner continues it): never stored
    lineage: int = -1          # lineage epoch of `version` (-1: not known yet; the rollout sets its own at start)
    hold: bool = False         # agent episode before its first call: no delta yet (its prompt is still to come)
    busy: bool = False         # an agent call of it is running: it stays on this rollout until the call is done
    routing: np.ndarray | None = None  # MoE: expert ids of positions [0, n) of prompt + tokens (module docstring)
    routing_cut: int = 0       # routing rows already cut into deltas
    request_id: str | None = None  # the engine request generating it now (routing is asked for by this id)

    @property
    def id(self) -> str:
        return self.spec.trajectory_id

    @property
    def remaining(self) -> int:
        return self.spec.max_tokens - len(self.tokens)

    # -- multi-turn bookkeeping ---------------------------------------------------------------
    @property
    def env_step(self) -> int:
        """Environment steps answered so far (-1: no episode started)."""
        return len(self.obs_spans) - 1

    @property
    def turn_start(self) -> int:
        """Where the policy's current action starts (right after the last observation)."""
        return self.obs_spans[-1][1] if self.obs_spans else 0

    def add_generated(self, toks: list[int], lps: list[float]) -> None:
        self.tokens += toks
        self.logprobs += lps
        self.mask += [1] * len(toks)

    def add_observation(self, toks: list[int]) -> None:
        """Append an environment reply (possibly empty): masked out, logprob 0, one span."""
        start = len(self.tokens)
        self.tokens += toks
        self.logprobs += [0.0] * len(toks)
        self.mask += [0] * len(toks)
        self.obs_spans.append((start, len(self.tokens)))

    @property
    def positions(self) -> int:
        """Positions of prompt + tokens so far (a routing row can exist for each, once processed)."""
        return len(self.spec.prompt_tokens) + len(self.tokens)

    def add_routing(self, rows: np.ndarray, start: int) -> int:
        """Rows of positions [start, ...) from the engine: only those past the recorded ones are
        kept (module docstring); how many were added."""
        self.routing, n = append_rows(self.routing, rows, start)
        return n

    def action(self, k: int) -> list[int]:
        """The policy's k-th action (k >= 1): the tokens between replies k-1 and k."""
        return self.tokens[self.obs_spans[k - 1][1]:self.obs_spans[k][0]]

    def observation(self, k: int) -> list[int]:
        s, e = self.obs_spans[k]
        return self.tokens[s:e]

    def policy_tokens(self) -> list[int]:
        return [t for t, m in zip(self.tokens, self.mask, strict=False) if m]

    def loss_mask(self) -> np.ndarray | None:
        return _mask_array(self.mask)

    def spans(self) -> np.ndarray | None:
        return _spans_array(self.obs_spans)

    # -- deltas --------------------------------------------------------------------------------
    @property
    def stays(self) -> bool:
        """Not movable now (an agent episode held back, or in a call): MigrateOut leaves it here."""
        return self.hold or self.busy

    def cut_delta(self) -> None:
        """Freeze tokens and replies since the last cut into the next delta (seq 0 carries spec)."""
        if self.hold:
            return
        rows = 0 if self.routing is None else len(self.routing)
        if (self.cut == len(self.tokens) and self.spans_cut == len(self.obs_spans) and self.routing_cut == rows
                and self.next_seq > 0):
            return
        self.outbox.append(TokenDelta(
            trajectory_id=self.id, seq=self.next_seq,
            tokens=np.asarray(self.tokens[self.cut:], dtype=np.int32),
            logprobs=np.asarray(self.logprobs[self.cut:], dtype=np.float32),
            version=self.version, spec=self.spec if self.next_seq == 0 else None,
            loss_mask=_mask_array(self.mask[self.cut:]), obs_spans=_spans_array(self.obs_spans[self.spans_cut:]),
            epoch=self.epoch, lineage=self.lineage,
            routing=self.routing[self.routing_cut:] if rows > self.routing_cut else None))
        self.next_seq += 1
        self.cut = len(self.tokens)
        self.spans_cut = len(self.obs_spans)
        self.routing_cut = rows

    def acked(self, upto_seq: int) -> None:
        self.outbox = [d for d in self.outbox if d.seq > upto_seq]

    def partial(self, rollout_id: str) -> PartialState:
        return PartialState(spec=self.spec, tokens=np.asarray(self.tokens, dtype=np.int32),
                            logprobs=np.asarray(self.logprobs, dtype=np.float32),
                            version=self.version, rollout_id=rollout_id, next_seq=self.next_seq,
                            loss_mask=self.loss_mask(), obs_spans=self.spans(), epoch=self.epoch,
                            lineage=self.lineage, routing=self.routing)

    @classmethod
    def resume(cls, p: PartialState) -> Active:
        # tolist(): Python ints and floats at C speed (a repack moves thousands of long trajectories)
        a = cls(spec=p.spec, version=p.version, tokens=np.asarray(p.tokens).tolist(),
                logprobs=np.asarray(p.logprobs).tolist(), next_seq=p.next_seq, epoch=p.epoch,
                lineage=p.lineage)
        a.mask = [1] * len(a.tokens) if p.loss_mask is None else np.asarray(p.loss_mask).tolist()
        spans = np.zeros((0, 2), np.int32) if p.obs_spans is None else np.asarray(p.obs_spans).reshape(-1, 2)
        a.obs_spans = [(int(s), int(e)) for s, e in spans]
        a.cut, a.spans_cut = len(a.tokens), len(a.obs_spans)
        if p.routing is not None and len(p.routing):
            a.routing = np.asarray(p.routing).copy()
            a.routing_cut = len(a.routing)
        a.timings["migrated_in"] = time.time()
        return a
