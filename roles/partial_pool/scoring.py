"""The partial pool's reward desk: leases to reward replicas, their scores, give-ups, and the hand-off
of scored trajectories to the experience buffer (docs/rewards.md; the book itself: awaiting.py).

    LeaseRewards   at most `lease_max_items` items and `page_bytes` of their arrays (at least one),
                   for at most `lease_max_s` (what was granted goes back in RewardWork.lease_s)
    SubmitScores   each score once, and only against the submitting replica's own lease
    give-up loop   every GIVE_UP_CHECK_S: the fallback for items their scorer failed on too often,
                   too long, or never leased at all (`reward_never_leased_s`: nobody serves it)
    forward loop   every fully scored item offered to the buffer, `forward_window` at a time, each
                   once per round: stored (or duplicate) ones are deleted here in one commit; one
                   the buffer refused for now (full, down) is offered again after its own backoff
                   (`forward_retry_s`, doubling to 5 s) while the others go on; one it refuses for
                   good (`refused`: it can never take it) is parked, logged `reward_parked` and
                   alarmed, and offered no more until the pool restarts

Why one offer per item per round, not a loop per item: an item the buffer will never take used to
hold its whole window, and every window after it, for ever (under `eviction: reject`, 3 of 8 items
stored, 5 never left).

The scorer a replica works for is bound to its key by the server (`reward.<scorer>` keys,
bus/auth.py); the replica id is its own word, so the lease check stops a replica scoring work it
never leased, not a scorer's key from leasing under any replica id. Backpressure: AwaitReward is
answered `busy` while the book is full (its `max_awaiting` items or bytes), and the rollout retries.
"""
from __future__ import annotations

import asyncio
import time

from laminar.bus.errors import PeerUnavailable, RemoteError
from laminar.bus.retry import Backoff
from laminar.bus.rpc import RequestError, current_peer

from laminar.protocol import LeaseRewards, PutTrajectory, RewardWork, ScoreResult, SubmitScores

GIVE_UP_CHECK_S = 1.0  # how often the pool looks for awaiting trajectories to give up on
FOREVER = ("refused", "bad_request", "unknown_kind")  # buffer answers that a later offer cannot change
FORWARD_RETRY_MAX_S = 5.0  # the longest wait between two offers of one scored trajectory


class RewardDesk:
    """Leases, scores, give-ups and forwarding of one partial pool's awaiting trajectories."""

    def __init__(self, book, settings, durable, buffer, log, refusals):
        self.book, self.settings, self.durable, self.log = book, settings, durable, log  # book(): the AwaitingBook
        self.buffer = buffer          # buffer(): the experience buffer's client (made on first use)
        self.refusals = refusals
        self.scored = asyncio.Event()  # an item became ready: the forward loop looks
        self.backoff: dict[str, tuple[float, Backoff]] = {}  # id -> (offer again at (monotonic), its waits)

    def _waits(self) -> Backoff:
        """An item's waits between offers the buffer refused for now: forward_retry_s doubling to 5 s."""
        return Backoff(self.settings.forward_retry_s, FORWARD_RETRY_MAX_S)

    @property
    def awaiting(self):
        """The pool's AwaitingBook now (a pool rebuilds it from its store after a failed write)."""
        return self.book()

    # -- requests ---------------------------------------------------------------------------------
    async def lease(self, req: LeaseRewards) -> RewardWork:
        s = self.settings
        if req.max_items < 1 or not req.lease_s > 0:
            raise RequestError("bad_request", f"max_items {req.max_items} and lease_s {req.lease_s} must be positive")
        lease_s = min(float(req.lease_s), s.lease_max_s)
        work = self.awaiting.lease(req.replica_id, req.scorer, min(req.max_items, s.lease_max_items), lease_s,
                                   max_bytes=s.page_bytes)
        return RewardWork(work, waiting=self.awaiting.waiting(req.scorer), lease_s=lease_s)

    async def submit(self, req: SubmitScores) -> ScoreResult:
        """Each score applied once (durable before the reply), only against the replica's own lease."""
        if len(req.trajectory_ids) != len(req.scores):
            raise RequestError("bad_request", f"{len(req.trajectory_ids)} trajectory ids but {len(req.scores)} scores")
        applied, refused = self.awaiting.submit(req.scorer, req.trajectory_ids, req.scores, req.parse_failed,
                                                replica=req.replica_id)
        if refused:
            self.log.warning("scores_refused", scorer=req.scorer, replica=req.replica_id, count=len(refused),
                             first=dict(list(refused.items())[:4]))
            unleased = [t for t, why in refused.items() if why.startswith("not leased")]
            if unleased:
                self.refusals.record(current_peer.get(), SubmitScores.kind, unleased, refused[unleased[0]])
        await self.durable([("UPDATE awaiting SET pending = ?, scores = ? WHERE tid = ?", (*self.awaiting.row(t), t))
                            for t in applied])
        if self.awaiting.ready():
            self.scored.set()
        return ScoreResult(applied=len(applied), refused=refused)

    # -- loops --------------------------------------------------------------------------------------
    async def give_up_loop(self) -> None:
        """Score by the fallback what its scorer failed on too often, too long, or never leased."""
        while True:
            await asyncio.sleep(GIVE_UP_CHECK_S)  # a periodic sweep: give-ups need no precise timing
            given = self.awaiting.give_up(self.settings.reward_fallback)
            if not given:
                continue
            await self.durable([("UPDATE awaiting SET pending = ?, scores = ? WHERE tid = ?",
                                 (*self.awaiting.row(t), t)) for t in dict.fromkeys(t for t, _, _ in given)])
            for tid, scorer, why in given:
                self.log.error("reward_gave_up", trajectory=tid, scorer=scorer, why=why,
                               fallback=self.settings.reward_fallback)
            if self.awaiting.ready():
                self.scored.set()

    async def forward_loop(self) -> None:
        """Offer every scored item to the buffer, a window at a time; forget those it holds."""
        while True:
            await self._wake()
            now = time.monotonic()
            ready = [t for t in self.awaiting.ready() if self.backoff.get(t, (0.0, None))[0] <= now]
            w = self.settings.forward_window
            for i in range(0, len(ready), w):
                window = ready[i:i + w]
                held = await asyncio.gather(*(self._offer(tid) for tid in window))
                await self._forget([(tid, put) for tid, put in zip(window, held, strict=True) if put is not None])

    async def _wake(self) -> None:
        """Until an item is ready, or the earliest backoff ends."""
        due = min((at for at, _ in self.backoff.values()), default=None)
        timeout = None if due is None else max(0.0, due - time.monotonic())
        try:
            await asyncio.wait_for(self.scored.wait(), timeout)
        except TimeoutError:
            pass
        self.scored.clear()

    async def _offer(self, tid: str):
        """One put of a scored item: its PutResult when the buffer holds it, else None (offered
        again after its backoff, or parked when the buffer refuses it for good)."""
        traj = self.awaiting.final(tid)
        try:
            put = await self.buffer().call(PutTrajectory(traj), timeout=5.0)
            if put.status in ("stored", "duplicate"):
                self.backoff.pop(tid, None)
                return put
            why, forever = f"{put.status}: {put.detail}", put.status == "refused"
        except (PeerUnavailable, RemoteError) as exc:
            why, forever = str(exc), isinstance(exc, RemoteError) and exc.code in FOREVER
        if forever:
            self.backoff.pop(tid, None)
            self.awaiting.park(tid, why)
            self.log.error("reward_parked", trajectory=tid, group=traj.spec.group_id, why=why,
                           parked=len(self.awaiting.parked),
                           way_out="the buffer will never take it (e.g. a group larger than its capacity under "
                                   "eviction reject): fix that and restart the partial pool, which offers it again")
            return None
        wait = self.backoff[tid][1] if tid in self.backoff else self._waits()
        delay = wait.next()
        self.backoff[tid] = (time.monotonic() + delay, wait)
        self.awaiting.counts["forward_retries"] += 1
        self.log.warning("scored_put_retry", trajectory=tid, why=why, retry_in_s=delay)
        return None

    async def _forget(self, held: list) -> None:
        """The buffer holds these: delete their rows in one commit, then forget them here."""
        if not held:
            return
        try:
            await self.durable([("DELETE FROM awaiting WHERE tid = ?", (tid,)) for tid, _ in held])
        except RequestError as exc:  # the buffer holds them; the next round forgets them here (duplicate)
            self.log.warning("forward_record_failed", trajectories=len(held), error=str(exc))
            for tid, _ in held:
                self.backoff[tid] = (time.monotonic() + self.settings.forward_retry_s, self._waits())
            return
        for tid, put in held:
            traj = self.awaiting.final(tid)
            self.awaiting.forwarded(tid)
            # the provenance ledger's line for a trajectory that awaited its reward here
            self.log.info("trajectory_stored", trajectory=tid, version=traj.version, lineage=traj.lineage,
                          tokens=len(traj.response_tokens), status=put.status, reward=round(traj.reward, 4),
                          components={k: round(v, 4) for k, v in traj.reward_components.items()},
                          rollout=traj.rollout_id, via="partial_pool")
