"""The reward replica's pipelined loop (roles/reward/role.py, `prefetch`): while a batch scores,
the next batch is already leased to it, and each score is still applied exactly once and every
trajectory reaches the buffer; with `prefetch: false` the replica leases one batch at a time."""
from __future__ import annotations

import asyncio

import pytest

from laminar.protocol import AwaitReward, LeaseRewards, SampleGroups, SubmitScores
from laminar.testing.inproc_cluster import InprocCluster
from tests.unit.roles.reward.test_role import cfg, forwarded, traj

pytestmark = pytest.mark.timeout(60)


class LeaseWatcher:
    """A backend (the model is not what is tested) that, while it scores a batch, records which
    trajectories the pool has leased to the same replica that no batch so far held: the prefetched
    next batch."""

    def __init__(self, pool, replica: str):
        self.pool, self.replica = pool, replica
        self.batches, self.ahead, self.seen = [], [], set()

    def leased_ahead(self) -> set:
        return {tid for tid, a in self.pool.awaiting.items.items()
                if tid not in self.seen and "rm" in a.pending and self.replica in a.leases.get("rm", {})}

    async def score(self, trajs):
        ids = {t.spec.trajectory_id for t in trajs}
        self.seen |= ids
        for _ in range(20):  # give a prefetched lease (already sent) time to be granted: bounded
            if self.leased_ahead():
                break
            await asyncio.sleep(0.01)  # stands for the model's time; polls the pool's in-memory leases
        self.batches.append(ids)
        self.ahead.append(self.leased_ahead())
        return [0.25] * len(trajs), []

    async def close(self) -> None:
        pass


@pytest.mark.parametrize("prefetch", [True, False])
def test_reward_role_pipelined_replica_leases_ahead_and_scores_each_once(tmp_path, prefetch):
    n, batch = 12, 3
    c_ = cfg(tmp_path, roles={"reward": {"scorer": "rm", "backend": "http", "batch_size": batch, "lease_s": 30,
                                         "idle_wait_s": 0.05, "prefetch": prefetch,
                                         "http": {"url": "http://127.0.0.1:9/unused"}}},
             extra_roles=[{"role": "reward", "id": "a"}])

    async def go():
        c = InprocCluster(c_)
        pool = await c.start("partial_pool")
        await c.start("experience_buffer")
        rm = await c.start("reward", "a")
        watcher = rm.backend = LeaseWatcher(pool, "a")   # before any work exists: nothing scored yet
        await asyncio.gather(*(c.client("partial_pool").call(AwaitReward("r0", traj(f"t{i}", group=f"g{i}"),
                                                                        {"rm": 1.0})) for i in range(n)))
        await forwarded(pool, n)
        counts, scored = pool.counts(), rm.scored
        await c.close()
        return watcher, counts, scored
    w, counts, scored = asyncio.run(go())
    assert counts["reward_scored"] == n and counts["reward_late_scores"] == 0 and scored == n
    assert sorted(i for b in w.batches for i in b) == sorted(f"t{i}" for i in range(n))  # each scored once
    assert all(len(b) == batch for b in w.batches)
    if prefetch:  # every batch but the last scored with the next one already leased to it
        assert [w.ahead[k] == w.batches[k + 1] for k in range(len(w.batches) - 1)] == [True] * (len(w.batches) - 1)
        assert w.ahead[-1] == set()
    else:
        assert w.ahead == [set()] * len(w.batches)


def test_reward_role_pool_forwards_a_window_at_once_and_retries_while_the_buffer_is_full(tmp_path):
    """Scored trajectories go to the buffer `forward_window` at a time: with the buffer full
    (eviction reject) the ones refused are retried with backoff, none lost, none forwarded twice,
    and each arrives once the trainer makes room."""
    n = 10
    c_ = cfg(tmp_path, roles={"partial_pool": {"forward_window": 4, "forward_retry_s": 0.05},
                              "experience_buffer": {"capacity": 4, "eviction": "reject"}})

    async def go():
        c = InprocCluster(c_)
        pool = await c.start("partial_pool")
        await c.start("experience_buffer")
        pc, bc = c.client("partial_pool"), c.client("experience_buffer")
        for i in range(n):
            await pc.call(AwaitReward("r0", traj(f"t{i}", group=f"g{i}"), {"rm": 1.0}))
        work = await pc.call(LeaseRewards("a", "rm", n, 30))
        await pc.call(SubmitScores("a", "rm", [t.spec.trajectory_id for t in work.trajectories], [0.5] * n))
        await forwarded(pool, 4)                        # the buffer takes 4, then refuses: full
        while pool.awaiting.counts["forward_retries"] < 2:
            await asyncio.sleep(0.02)  # polling the pool's counter, bounded by the test's timeout
        got = []
        while len(got) < n:                             # the trainer takes groups: room for the rest
            got += [g[0].spec.trajectory_id for g in (await bc.call(SampleGroups(4, 0))).groups]
            await asyncio.sleep(0.05)  # the pool's retry backoff: bounded by the test's timeout
        counts = pool.counts()
        await c.close()
        return got, counts
    got, counts = asyncio.run(go())
    assert sorted(got) == sorted(f"t{i}" for i in range(n))   # every one, once
    assert counts["reward_forwarded"] == n and counts["awaiting_reward"] == 0 and counts["reward_forward_retries"] >= 2
