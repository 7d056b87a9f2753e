"""Migration: the manager's requests that move in-flight work to and from this rollout.

    MigrateOut  abort what is asked (or everything), make it durable in the partial pool, release
                its ownership there (owner none: a manager killed before the MigrateIn leaves
                orphans any manager finds, not work stranded under this rollout), hand back its
                partial states; what the pool cannot take resumes here
    MigrateIn   same weights only (version and lineage); each trajectory is taken over in the
                partial pool (fencing every earlier owner off) and continued from what the pool
                holds, with the remaining budget. Migrants may exceed max_concurrency up to twice
                it (the engine queues the excess)
    MigrateIn with `adopt`: work of other weights, named by (lineage, version), that the relay
                still retains. It is queued (`adopted`); when nothing is active the batch loop
                calls `run_adopted`, which loads exactly those weights and runs only that work
                (`pinned`: no new prompts, no other weights) until it is done; then the loop goes
                back to the newest version

A MigrateIn holds Work.lock from its version check to the starts, so no weight load slips in
between. `adopted` is appended to only under that lock and emptied only by `run_adopted` (the
loop, under the lock); `pinned` is set by `run_adopted` and cleared by the loop once nothing is
active.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time

from laminar.bus.errors import DeadlineExceeded, PeerUnavailable, RemoteError
from laminar.bus.retry import ACKED_BACKOFF, Backoff
from laminar.bus.rpc import RequestError
from laminar.roles.rollout.streaming import DeltaStream
from laminar.roles.rollout.trajectory import Active
from laminar.roles.rollout.weights import WeightFollower
from laminar.roles.rollout.work import Work

from laminar.protocol import (
    GetPartial,
    MigrateIn,
    MigrateInResult,
    MigrateOut,
    PartialList,
    PartialState,
    ReassignPartial,
)

NOT_TAKEN = object()  # _take_over: the claim was refused or failed (the manager keeps it an orphan)
RELEASE_TIMEOUT_S = 10.0  # one release of a handed-over trajectory (MigrateOut answers within the manager's deadline)


class Migration:
    """MigrateOut, MigrateIn and adoption of an older version's work on one rollout."""

    def __init__(self, rollout_id: str, work: Work, weights: WeightFollower, stream: DeltaStream, partials,
                 start, call, max_concurrency: int, log):
        self.rollout_id, self.work, self.weights, self.stream = rollout_id, work, weights, stream
        self.partials, self.log, self.max_concurrency = partials, log, max_concurrency
        self.start = start   # start(Active): make it active and generate it (TrajectoryRunner.start)
        self.call = call     # call(client, req): until answered (bus/retry.py call_acked)
        self.adopted: list[PartialState] = []   # of an older version, queued (MigrateIn adopt)
        self.pinned = False                     # running adopted work: no new prompts, no weight update

    async def on_migrate_out(self, req: MigrateOut) -> PartialList:
        active = self.work.active
        ids = list(active) if req.everything else req.trajectory_ids
        # only those still generating: a finished one is being scored and stored right now; an agent
        # episode in a call (or before its first one) stays
        moving = [a for a in (active.get(t) for t in ids)
                  if a is not None and a.task and not a.task.done() and not a.stays]
        for a in moving:
            a.task.cancel()
        await asyncio.gather(*(a.task for a in moving), return_exceptions=True)
        if not await self.stream.flush([a.id for a in moving]):  # durable before handing them over
            for a in moving:
                if not a.fenced:
                    self.start(a)
            raise RequestError("unavailable", "partial pool unreachable; trajectories resumed here")
        moving = [a for a in moving if not a.fenced]  # fenced off during that flush: another owner has it
        if not await self._release(moving):
            for a in moving:
                if not a.fenced:
                    self.start(a)
            raise RequestError("unavailable", "partial pool unreachable; trajectories resumed here")
        out = [a.partial(self.rollout_id) for a in moving]
        self.work.left(*moving, make_room=False)
        self.log.info("migrated_out", trajectories=len(out), reason=req.reason)
        return PartialList(out)

    async def _release(self, moving: list[Active]) -> bool:
        """Own nothing of what is handed over, durably, before the reply: the manager holds the
        only other record of the move, in memory. If it dies before the MigrateIn, the work is owned
        by nobody in the partial pool and any manager's `reconcile` finds it as orphans (before, it
        stayed owned by this live rollout, which no longer ran it: stranded for good). False if the
        pool did not take every release; those taken are claimed back (the caller resumes them)."""
        async def one(tid: str, owner: str) -> bool:
            try:
                await self.partials.call(ReassignPartial(tid, owner), timeout=RELEASE_TIMEOUT_S)
                return True
            except (RemoteError, PeerUnavailable, DeadlineExceeded) as exc:
                self.log.warning("release_failed", trajectory=tid, owner=owner, error=str(exc))
                return False
        done = await asyncio.gather(*(one(a.id, "") for a in moving))
        if all(done):
            return True
        await asyncio.gather(*(one(a.id, self.rollout_id) for a, ok in zip(moving, done, strict=True) if ok))
        return False

    async def give_up(self, a: Active) -> None:
        """`a` cannot be stored from here (a peer answered `internal` past call_acked's bound): make
        its deltas durable and release it in the partial pool (owner none), then drop it. The
        manager's reconcile finds it as an orphan and places it again (its tokens are all there: the
        new owner stores it at once). Until the pool takes both, it is asked again with backoff."""
        wait = Backoff(*ACKED_BACKOFF)
        while not (await self.stream.flush([a.id]) and await self._release([a])):
            if a.fenced:  # another owner has it meanwhile
                break
            await wait.sleep()  # backoff: the partial pool is unreachable
        self.log.warning("trajectory_released", trajectory=a.id, tokens=len(a.tokens), why="given up here")
        self.work.left(a)

    async def on_migrate_in(self, req: MigrateIn) -> MigrateInResult:
        w = self.weights
        if req.adopt and any((p.lineage, p.version) != (w.lineage, w.version) for p in req.partials):
            return await self._adopt(req)
        async with self.work.lock:  # no weight load may slip in between the check and the start
            # the same number of another lineage names other weights (a restarted trainer)
            wrong = [p for p in req.partials if p.version != w.version or p.lineage not in (-1, w.lineage)]
            if wrong:
                raise RequestError("refused", f"trajectory {wrong[0].spec.trajectory_id} was generated by "
                                   f"weight version {wrong[0].version}; rollout {self.rollout_id} holds version "
                                   f"{w.version} (lineage {wrong[0].lineage} vs {w.lineage})")
            # Migrants may exceed max_concurrency up to twice it (the engine queues the excess):
            # a rollout that refills at every batch end would otherwise starve a dead peer's work.
            active = self.work.active
            if len(active) + len(req.partials) > 2 * self.max_concurrency:
                raise RequestError("busy", f"rollout {self.rollout_id} has {len(active)} active "
                                   f"trajectories; {len(req.partials)} more exceed 2 x {self.max_concurrency}")
            accepted, gone = [], []
            for p in req.partials:
                tid = p.spec.trajectory_id
                if tid in active:  # already here (a retried MigrateIn whose reply was lost)
                    accepted.append(tid)
                    continue
                if p.next_seq == 0 and not len(p.tokens):  # a fresh start (the manager's orphan restart):
                    self.start(Active.resume(p))            # its seq 0 delta creates it in the pool
                    accepted.append(tid)
                    continue
                cur = await self._take_over(p)
                if cur is NOT_TAKEN:  # neither accepted nor gone: the manager keeps it an orphan
                    continue
                if cur is None:  # e.g. completed elsewhere meanwhile: never generate twice
                    gone.append(tid)
                    continue
                self.start(Active.resume(cur))
                accepted.append(tid)
            if accepted:
                self.work.state = "generating"
        self.log.info("migrated_in", trajectories=len(accepted), gone=len(gone), version=w.version)
        return MigrateInResult(accepted=accepted, version=w.version, gone=gone)

    async def _take_over(self, p: PartialState) -> PartialState | None:
        """Make this rollout the owner of `p` in the partial pool, fencing every earlier owner off (a
        cut-off one may still be running), and read back what the pool holds: an earlier owner may
        have written more after `p` was read, and continuing from `p` would splice two streams.
        None when the pool no longer has it in flight (completed elsewhere); NOT_TAKEN when the pool
        refuses the claim (the manager's grant did not reach it, e.g. lost with a pool restart) or
        answers `internal` past call_acked's bound."""
        tid = p.spec.trajectory_id
        try:
            ack = await self.call(self.partials, ReassignPartial(tid, self.rollout_id, fence=True))
            cur = await self.call(self.partials, GetPartial(tid))
        except RemoteError as exc:
            if exc.message.startswith("forbidden") or exc.code == "internal":
                self.log.warning("migrate_in_not_taken", trajectory=tid, why=exc.message)
                return NOT_TAKEN
            self.log.info("migrate_in_gone", trajectory=tid, why=exc.message)
            return None
        word = (getattr(ack, "detail", "") or "").split()   # "epoch <n>": the epoch this rollout now holds
        epoch = int(word[1]) if len(word) == 2 and word[0] == "epoch" and word[1].isdigit() else cur.epoch
        if cur.next_seq != p.next_seq:
            self.log.warning("migrate_in_newer", trajectory=tid, handed_seq=p.next_seq, pool_seq=cur.next_seq)
        return dataclasses.replace(cur, epoch=epoch, lineage=cur.lineage if cur.lineage >= 0 else p.lineage)

    async def _adopt(self, req: MigrateIn) -> MigrateInResult:
        """Queue work of other weights, named by (lineage, version), for a run on a retained copy of
        exactly those weights: the relay's version of that number must be of the work's lineage
        (and of the run it serves), else `not_retained` naming both; work naming no lineage is
        never adopted (its weights cannot be named, so nothing could check them)."""
        named = {(p.lineage, p.version) for p in req.partials}
        if len(named) != 1:
            raise RequestError("refused", f"adopted work must be of one (lineage, version), got {sorted(named)}")
        ((lineage, version),) = named
        async with self.work.lock:
            if self.adopted and (self.adopted[0].lineage, self.adopted[0].version) != (lineage, version):
                raise RequestError("busy", f"rollout {self.rollout_id} already holds adopted work of version "
                                   f"{self.adopted[0].version} (lineage {self.adopted[0].lineage})")
            if len(self.adopted) + len(req.partials) > 2 * self.max_concurrency:
                raise RequestError("busy", f"rollout {self.rollout_id} has {len(self.adopted)} adopted trajectories")
            name, why = await asyncio.to_thread(self.weights.retained_copy, lineage, version)
            if name is None:
                raise RequestError("not_retained", f"rollout {self.rollout_id}: {why}")
            accepted, gone = [], []
            queued = {p.spec.trajectory_id for p in self.adopted}
            for p in req.partials:
                tid = p.spec.trajectory_id
                if tid in queued or tid in self.work.active:
                    accepted.append(tid)
                    continue
                cur = await self._take_over(p)
                if cur is NOT_TAKEN:
                    continue
                if cur is None:
                    gone.append(tid)
                    continue
                if cur.lineage != lineage:  # the pool names other weights than the manager's copy did
                    self.log.warning("adopt_declined", trajectory=tid, lineage=cur.lineage, wanted=lineage)
                    await self.call(self.partials, ReassignPartial(tid, ""))  # an orphan again: restarted
                    continue
                self.adopted.append(cur)
                accepted.append(tid)
        self.log.info("adopted", trajectories=len(accepted), gone=len(gone), version=version, lineage=lineage,
                      holding=self.weights.version, holding_lineage=self.weights.lineage, active=len(self.work.active))
        self.work.wake.set()  # an idle rollout wakes and takes it at once
        return MigrateInResult(accepted=accepted, version=version, gone=gone)

    async def run_adopted(self) -> None:
        """Load exactly the adopted work's weights, (run, lineage, version), from the relay
        (retained) and start that work alone (the batch loop, under the lock, with nothing active)."""
        lineage, version, work = self.adopted[0].lineage, self.adopted[0].version, self.adopted
        self.adopted = []
        previous, previous_lineage = self.weights.version, self.weights.lineage
        t0 = time.monotonic()
        why = await self.weights.load_retained(lineage, version)
        if why is not None:  # pruned or replaced meanwhile: give the work up, the manager's scan finds it again
            self.log.warning("adopt_failed", version=version, lineage=lineage, trajectories=len(work), why=why)
            for p in work:
                await self.call(self.partials, ReassignPartial(p.spec.trajectory_id, ""))
            return
        self.log.info("adopted_resumed", version=version, lineage=lineage, previous=previous,
                      previous_lineage=previous_lineage, trajectories=len(work), load_s=round(time.monotonic() - t0, 4))
        self.pinned = True
        for p in work:
            self.start(Active.resume(p))
        self.work.state = "generating"
