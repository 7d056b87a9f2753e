"""DeltaStream: the active trajectories' new tokens to the partial pool, and what fencing stops.

Every `delta_interval_s` (the `flush` task), and whenever a trajectory must be durable (before an
environment step, before a MigrateOut hands it over, at stop), each active trajectory's new tokens
are cut into a delta (trajectory.py) and sent in columns (AppendDeltaBatch: a few arrays per request,
whatever the number of deltas): single-turn ones in requests of their own, without a loss mask (the
partial pool's fast path), multi-turn ones (loss masks, observation spans: env steps, agent calls)
in requests that carry both columns. A request is bounded (the bus
limits a message's frames, containers and body: bus/codec.py), so a large flush is paged; a
trajectory's deltas never straddle two pages. A delta leaves its outbox only when acknowledged,
so a page that fails is sent again by the next flush (the pool applies each seq once).

`make_durable(a)` is a group commit (group_commit.py): callers that ask at once (agent calls that end at the same
engine step, env steps) join one flush, one request and so one pool transaction; one that asks
while that flush is in flight goes in the next, with everyone who asked meanwhile. Each returns
only once a flush that covered its trajectory was acknowledged.

A mixture-of-experts policy's routing rows (routing.py) are pulled from the engine right before
each cut, so they go with the tokens they follow.

Fencing: the partial pool refuses the writes of an owner it has fenced off (the manager gave the
trajectory to another rollout while this one was cut off). Such a trajectory stops here: it is
aborted in the engine, dropped from the active set, and never offered to the buffer (its new
owner stores it). This is the one place outside the trajectory's own task that removes it.

Hand-outs: the pool creates a trajectory only from a seq 0 whose spec was handed to this rollout
(roles/handout.py). An honest rollout is refused so only if the pools' hand-out keys disagree (a
misconfiguration): such deltas stay in the outbox, sent again each flush and logged as errors
(`deltas_refused`), never acknowledged and never dropped.
"""
from __future__ import annotations

import asyncio

import numpy as np
from laminar.bus.errors import PeerUnavailable, RemoteError
from laminar.bus.retry import ACKED_BACKOFF, Backoff
from laminar.roles.handout import NOT_HANDED
from laminar.roles.rollout.group_commit import GroupCommit
from laminar.roles.rollout.trajectory import Active
from laminar.roles.rollout.work import Work

from laminar.models.routing import routing_columns
from laminar.protocol import AppendDeltaBatch


class DeltaStream:
    """Pages of token deltas to the partial pool, acknowledged or fenced off."""

    FLUSH_DELTAS = 4096       # deltas per request (a seq-0 spec is one more frame and a few containers)
    FLUSH_TOKENS = 1 << 20    # tokens per request (4 MiB of tokens and 4 of logprobs)

    def __init__(self, rollout_id: str, work: Work, partials, timeout_s: float, log, routing=None):
        self.rollout_id, self.work, self.partials, self.timeout_s, self.log = rollout_id, work, partials, timeout_s, log
        self.routing = routing  # RoutingPuller (routing.py): MoE routing rows pulled in before each cut
        self.fenced_off = 0  # trajectories dropped because the partial pool fenced this rollout off them
        self.refused = 0     # flushes of a trajectory the pool refused as not handed to this rollout
        self._groups = GroupCommit(lambda ids: self.flush(ids))  # make_durable's groups: one flush each

    async def run(self, interval_s: float) -> None:
        """The `flush` task."""
        while True:
            await asyncio.sleep(interval_s)  # the streaming period
            await self.flush()

    async def flush(self, only: list[str] | None = None) -> bool:
        """Send every unacknowledged delta of `only` (or all active trajectories), in pages of at
        most FLUSH_DELTAS deltas and FLUSH_TOKENS tokens. True when all were acknowledged; a page
        that fails stops the flush (the rest is sent next time: deltas stay in their outboxes)."""
        active = self.work.active
        items = [active[t] for t in only if t in active] if only else list(active.values())
        if self.routing is not None:
            await self.routing.pull(items)
        for a in items:
            a.cut_delta()
        items = [a for a in items if a.outbox]
        if not items:
            return True
        single, multi = [], []
        for a in items:
            (multi if _multi_turn(a) else single).append(a)
        for group in (single, multi):
            for page in self._pages(group):
                deltas = [d for a in page for d in a.outbox]
                req = _columns(self.rollout_id, deltas, multi_turn=group is multi)
                try:
                    res = await self.partials.call(req, timeout=self.timeout_s)
                except (PeerUnavailable, RemoteError) as exc:
                    self.log.warning("flush_failed", deltas=len(deltas), error=str(exc))
                    return False
                self._flushed(page, res)
        return True

    async def make_durable(self, a: Active) -> None:
        """Until every token of `a` is acknowledged by the partial pool (before an env step, before
        an agent call's reply). Group commit: the trajectories asked for while a flush of this
        kind is in flight go together in the next one, one request for all of them."""
        wait = Backoff(*ACKED_BACKOFF)
        while not await self._groups.join(a.id):
            await wait.sleep()  # backoff: the partial pool is unreachable

    def _pages(self, items: list[Active]) -> list[list[Active]]:
        pages, page, n, toks = [], [], 0, 0
        for a in items:
            dn, dt = len(a.outbox), sum(len(d.tokens) for d in a.outbox)
            if page and (n + dn > self.FLUSH_DELTAS or toks + dt > self.FLUSH_TOKENS):
                pages.append(page)
                page, n, toks = [], 0, 0
            page.append(a)
            n, toks = n + dn, toks + dt
        return pages + [page] if page else pages

    def _flushed(self, page: list[Active], res) -> None:
        """A page was answered: its deltas are acknowledged; a trajectory whose writes were refused as
        fenced off stops here (another owner continues it)."""
        rejected = getattr(res, "rejected", None) or {}
        for a in page:
            why = rejected.get(a.id, "")
            if why.startswith("fenced off"):
                self._fenced(a, why)
            elif why.startswith(NOT_HANDED):  # never acknowledged: kept and sent again (loud, not lost)
                self.refused += 1
                if self.refused & (self.refused - 1) == 0:
                    self.log.error("deltas_refused", trajectory=a.id, why=why, refused=self.refused)
            elif a.outbox:
                a.acked(max(d.seq for d in a.outbox))

    def _fenced(self, a: Active, why: str) -> None:
        """The partial pool gave `a` to another owner (this rollout was cut off meanwhile): abort it in
        the engine and drop it; it is never offered to the buffer (its new owner stores it)."""
        a.fenced = True
        a.outbox = []
        self.fenced_off += 1
        self.log.warning("trajectory_fenced_off", trajectory=a.id, epoch=a.epoch, why=why,
                         tokens=len(a.tokens), fenced_off=self.fenced_off)
        if a.task is not None and not a.task.done():
            a.task.cancel()  # cancelling the consumer aborts the request in the engine
        self.work.left(a)


def _multi_turn(a: Active) -> bool:
    """A trajectory whose deltas may carry a loss mask or observation spans."""
    return bool(a.obs_spans) or any(d.loss_mask is not None or d.obs_spans is not None for d in a.outbox)


def _columns(rollout_id: str, deltas: list, multi_turn: bool = False) -> AppendDeltaBatch:
    """TokenDeltas as one columnar AppendDeltaBatch (the partial pool's chunk format); `multi_turn`:
    with the loss mask (1 where a delta had none) and the observation spans columns."""
    n = len(deltas)
    lengths = np.fromiter((len(d.tokens) for d in deltas), np.int64, n)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    cat = lambda xs, dt: np.concatenate([np.asarray(x, dt) for x in xs]) if xs else np.zeros(0, dt)  # noqa: E731
    routing, routing_offsets = routing_columns([d.routing for d in deltas])
    mask = spans = span_offsets = None
    if multi_turn:  # the spans as rows with offsets, as routing rows travel (None, None: no delta has any)
        mask = cat([np.ones(len(d.tokens), np.uint8) if d.loss_mask is None else d.loss_mask for d in deltas],
                   np.uint8)
        spans, span_offsets = routing_columns([None if d.obs_spans is None else
                                               np.asarray(d.obs_spans, np.int32).reshape(-1, 2) for d in deltas])
    return AppendDeltaBatch(
        rollout_id, [d.trajectory_id for d in deltas], np.fromiter((d.seq for d in deltas), np.int64, n),
        np.fromiter((d.version for d in deltas), np.int64, n), offsets,
        cat([d.tokens for d in deltas], np.int32), cat([d.logprobs for d in deltas], np.float32),
        [d.spec for d in deltas if d.seq == 0], epochs=np.fromiter((d.epoch for d in deltas), np.int64, n),
        loss_mask=mask, lineages=np.fromiter((d.lineage for d in deltas), np.int64, n), routing=routing,
        routing_offsets=routing_offsets, obs_spans=spans, obs_offsets=span_offsets)
