"""RewardRole: one reward replica. It leases finished trajectories awaiting its scorer from the
partial pool, scores them in batches with its backend, and submits the scores (docs/rewards.md).

    loop: LeaseRewards(batch_size, lease_s) -> backend.score(batch) -> SubmitScores -> loop

With `prefetch` (the default) the loop is pipelined: the next batch is leased while one scores and
a batch's scores are submitted while the next scores, so the two round trips to the pool hide
behind the model (a prefetched batch waits one batch's scoring: `lease_s` covers two batches).

The replica holds nothing durable: the partial pool keeps every trajectory until each of its
scores is applied (once) and the buffer holds it. A replica that dies, hangs or whose backend
fails (an HTTP service down past its retries) submits nothing for that batch; the lease expires
and the batch is scored again (here or by another replica). A score that arrives after another
replica's was applied is refused by the pool and counted there (`reward_late_scores`).

Components:
    config.py      settings (backend, its settings, batch and lease)
    classifier.py  ClassifierScorer: transformers sequence classification, batched by tokens
    judge.py       JudgeScorer: a generative judge on vLLM, a prompt template and an answer parser
    http.py        HttpScorer: a user's service (JSON over HTTP), concurrency, timeout, retries
    text.py        Decoder: token ids to text for the judge and the service
"""
from __future__ import annotations

import asyncio
import time
from collections import deque

from laminar.bus.retry import call_acked
from laminar.roles.reward.classifier import ClassifierScorer
from laminar.roles.reward.config import RewardRoleConfig
from laminar.roles.reward.http import HttpScoreError, HttpScorer
from laminar.roles.reward.text import Decoder

from laminar.protocol import LeaseRewards, SubmitScores
from laminar.role_base import Role


def build_backend(s: RewardRoleConfig):
    """The scorer of these settings (not started)."""
    if s.backend == "classifier":
        return ClassifierScorer(s.classifier)
    if s.backend == "http":
        return HttpScorer(s.http, Decoder(s.text.tokenizer_dir), s.scorer)
    from laminar.roles.reward.judge import JudgeScorer  # late: imports the vLLM engine wrapper
    return JudgeScorer(s.judge, Decoder(s.text.tokenizer_dir))


class RewardRole(Role):
    """A reward replica: leases awaiting trajectories, scores them, submits the scores."""

    name = "reward"
    Config = RewardRoleConfig

    def __init__(self, ctx):
        super().__init__(ctx)
        self.backend = self.pool = None
        self.scored = 0            # trajectories whose scores this replica submitted (applied or not)
        self.refused = 0           # of those, refused by the pool (another replica's score came first)
        self.failed_batches = 0    # batches the backend could not score (left to the lease's expiry)
        self.queue_depth = 0       # trajectories awaiting this scorer, not leased, at the last lease
        self.latency = deque(maxlen=256)  # seconds to score one batch, the newest batches
        self.batches = 0           # batches scored
        self.scoring_s = 0.0       # seconds spent scoring them (with `batches`: the mean latency, as a rate)

    async def setup(self) -> None:
        s = self.settings
        self.backend = await asyncio.to_thread(build_backend, s)
        if hasattr(self.backend, "start"):
            await self.backend.start()
        self.pool = self.ctx.transport.client(self.cluster.endpoint("partial_pool", s.partial_pool))
        self.log.info("reward_ready", scorer=s.scorer, backend=s.backend)

    async def run(self) -> None:
        """Lease, score, submit; with `prefetch`, the next lease is asked for while a batch scores
        and a batch's submit goes out while the next one scores (the RPCs hide behind the model)."""
        s = self.settings
        submit: asyncio.Task | None = None   # the previous batch's submit, in flight
        work = None                          # the batch to score next (a prefetched lease)
        try:
            while not self.stopping.is_set():
                work = work if work is not None else await self._lease()
                if not work.trajectories:
                    work = None
                    await asyncio.sleep(s.idle_wait_s)  # nothing awaits this scorer: ask again later
                    continue
                nxt = asyncio.ensure_future(self._lease()) if s.prefetch else None
                try:
                    done = await self._score(work)
                except BaseException:
                    if nxt is not None:
                        nxt.cancel()
                    raise
                if submit is not None:
                    await submit
                submit = asyncio.ensure_future(self._submit(*done)) if done is not None else None
                if not s.prefetch and submit is not None:
                    await submit
                    submit = None
                work = await nxt if nxt is not None else None
        finally:
            if submit is not None:
                await asyncio.shield(submit)  # a scored batch is submitted even while stopping
        await self.wait_stopped()

    async def _lease(self):
        s = self.settings
        work = await call_acked(self.pool, LeaseRewards(self.ctx.id, s.scorer, s.batch_size, s.lease_s),
                                s.rpc_timeout_s, self.log)
        self.queue_depth = work.waiting
        if 0 < work.lease_s < s.lease_s and not getattr(self, "_lease_cut", False):
            self._lease_cut = True  # said once: the pool's lease_max_s is below this replica's lease_s
            self.log.warning("reward_lease_cut", asked_s=s.lease_s, granted_s=work.lease_s,
                             way_out="lower roles.reward.lease_s or raise roles.partial_pool.lease_max_s")
        return work

    async def _score(self, work) -> tuple | None:
        """(ids, scores, parse-failed ids, seconds, waiting) of a leased batch; None if the backend
        failed on it (the lease expires and the batch is scored again)."""
        s = self.settings
        t0 = time.monotonic()
        try:
            scores, failed = await self.backend.score(work.trajectories)
        except HttpScoreError as exc:
            self.failed_batches += 1
            self.log.error("reward_batch_failed", scorer=s.scorer, trajectories=len(work.trajectories), error=str(exc))
            return None
        seconds = time.monotonic() - t0
        self.latency.append(seconds)
        self.batches += 1
        self.scoring_s += seconds
        return [t.spec.trajectory_id for t in work.trajectories], scores, failed, seconds, work.waiting

    async def _submit(self, ids: list[str], scores: list, failed: list, seconds: float, waiting: int) -> None:
        s = self.settings
        res = await call_acked(self.pool, SubmitScores(self.ctx.id, s.scorer, ids, [float(x) for x in scores],
                                                       failed), s.rpc_timeout_s, self.log)
        self.scored += len(ids)
        self.refused += len(res.refused)
        self.log.info("rewards_scored", scorer=s.scorer, trajectories=len(ids), applied=res.applied,
                      refused=len(res.refused), parse_failed=len(failed), seconds=round(seconds, 4),
                      waiting=waiting)

    async def stop(self) -> None:
        await super().stop()
        if self.backend is not None:
            await self.backend.close()

    def status(self) -> dict:
        lat = sorted(self.latency)
        return {"scorer": self.settings.scorer, "backend": self.settings.backend, "scored": self.scored,
                "scores_refused": self.refused, "failed_batches": self.failed_batches,
                "queue_depth": self.queue_depth,
                "parse_failures": getattr(self.backend, "parse_failures", 0) if self.backend else 0,
                "latency_p50_s": round(lat[len(lat) // 2], 4) if lat else 0.0,
                "latency_max_s": round(lat[-1], 4) if lat else 0.0, "batches": self.batches,
                "scoring_s_total": round(self.scoring_s, 4)}

