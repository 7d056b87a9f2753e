"""The prompt pool's TakeBatch retries and RequeueGroups, each item on its own.

A retried TakeBatch (its reply was lost) answered after the manager requeued part of that batch
must not hand out the requeued entries' new attempt ids: the rollout that gets the requeued entry
streams them too, so two live rollouts would write the same trajectory ids. Before, the retry
recomputed the ids from the current attempt table and returned `<group>/<i>~a1` to both.

One bad id in a RequeueGroups must not sink the rest: before, the pool refused the whole request,
and the experience buffer then dropped every group in it (never run again: prompts skipped)."""
from __future__ import annotations

import asyncio

from laminar.protocol import RequeueGroups, RequeueResult, TakeBatch
from laminar.testing.inproc_cluster import InprocCluster
from tests.integration.pools.test_prompt_pool import cfg


def test_a_retried_take_batch_never_hands_out_a_requeued_entrys_new_ids(tmp_path):
    async def main():
        c = InprocCluster(cfg(tmp_path))
        await c.start("prompt_pool")
        pp = c.client("prompt_pool")
        first = await pp.call(TakeBatch("r0", 6, batch_seq=1))       # two groups; say the reply was lost
        g0, g1 = first.trajectories[0].group_id, first.trajectories[3].group_id
        await pp.call(RequeueGroups([g0], "r0"))                     # the manager took r0 for dead
        other = await pp.call(TakeBatch("r1", 3, batch_seq=1))       # r1 gets the requeued group, attempt 1
        retry = await pp.call(TakeBatch("r0", 6, batch_seq=1))       # r0 was alive: its retry
        await c.close()
        return first, other, retry, g0, g1
    first, other, retry, g0, g1 = asyncio.run(main())
    assert [t.trajectory_id for t in other.trajectories] == [f"{g0}/{i}~a1" for i in range(3)]
    ids = [t.trajectory_id for t in retry.trajectories]
    assert not set(ids) & {t.trajectory_id for t in other.trajectories}
    assert ids == [f"{g1}/{i}" for i in range(3)]                    # what r0 still holds, as handed


def test_requeue_takes_the_good_ids_and_names_the_bad_ones(tmp_path):
    async def main():
        c = InprocCluster(cfg(tmp_path))
        await c.start("prompt_pool")
        pp = c.client("prompt_pool")
        b = await pp.call(TakeBatch("r0", 6, batch_seq=1))
        g0, g1 = b.trajectories[0].group_id, b.trajectories[3].group_id
        res = await pp.call(RequeueGroups([g0, "b.e0-p0", "e0-pnope", g1], "r0"))
        again = await pp.call(TakeBatch("r1", 6, batch_seq=1))
        await c.close()
        return res, again, g0, g1
    res, again, g0, g1 = asyncio.run(main())
    assert isinstance(res, RequeueResult)
    assert res.requeued == [g0, g1] and sorted(res.refused) == ["b.e0-p0", "e0-pnope"]
    assert "unknown group id" in res.refused["b.e0-p0"]
    assert [t.group_id for t in again.trajectories[::3]] == [g0, g1]
