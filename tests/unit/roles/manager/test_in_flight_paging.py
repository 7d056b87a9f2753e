"""InFlightOf is paged: every reply stays within the bus's frame and byte limits whatever the
in-flight population, and the pages together list it completely, once each.

One frame per array and three arrays per partial (tokens, logprobs, the spec's prompt) put an
unpaged InFlightOf("*") past MAX_FRAMES (65,536) above ~21.8k trajectories in flight, the paper's
scale (1,024 GPUs). The partial pool, over the real codec (the in-process bus encodes and decodes
every message with the wire limits), holds more than that: the pages list all of them, and the
manager's reconcile and recovery (which read them through the paging) find all of them."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import structlog
from laminar.bus.codec import MAX_FRAMES
from laminar.roles.manager.fleet import Fleet, FleetSettings

from laminar.protocol import AppendDeltaBatch, InFlightOf, TrajectorySpec
from laminar.testing.inproc_cluster import InprocCluster
from tests.unit.roles.test_pool_write_failures import cfg

pytestmark = pytest.mark.timeout(300)

N = MAX_FRAMES // 3 + 2_000  # above what one unpaged reply can carry
BULK_S = 120.0  # a 4,096-trajectory write or a page of thousands: its deadline is not what is tested


def seq0_batch(owner: str, tids: list[str]) -> AppendDeltaBatch:
    specs = [TrajectorySpec(trajectory_id=t, prompt_id="p", group_id=t, sample_index=0, group_size=1,
                            prompt_tokens=np.array([1, 2], np.int32)) for t in tids]
    n = len(tids)
    return AppendDeltaBatch(owner, tids, np.zeros(n, np.int64), np.zeros(n, np.int64),
                            np.arange(0, 2 * n + 1, 2, dtype=np.int64), np.full(2 * n, 5, np.int32),
                            np.zeros(2 * n, np.float32), specs)


def test_an_in_flight_population_above_the_frame_bound_is_listed_completely(tmp_path):
    async def go():
        c = InprocCluster(cfg(tmp_path))
        await c.start("partial_pool")
        pool = c.client("partial_pool")
        tids = [f"t{i:06d}" for i in range(N)]
        for k in range(0, N, 4096):  # two owners: a dead one, and one the manager never heard of
            owner = "dead" if k < N // 2 else "gone"
            assert (await pool.call(seq0_batch(owner, tids[k:k + 4096]), BULK_S)).applied == len(tids[k:k + 4096])
        listed, pages, after = [], 0, ""
        while True:
            page = await pool.call(InFlightOf("*", after=after), BULK_S)
            listed += [p.spec.trajectory_id for p in page.partials]
            pages += 1
            if not page.more:
                break
            after = page.next_after
        assert sorted(listed) == tids and len(listed) == len(set(listed)) and pages > 1
        one = await pool.call(InFlightOf("*", limit=7))
        assert len(one.partials) == 7 and one.more

        # the manager reads them through the paging: recovery of one owner, reconcile of all
        fleet = Fleet(c.hub.transport(), structlog.get_logger(), FleetSettings(), lambda rid: "",
                      c.config.endpoint("partial_pool"))
        await fleet.recovery.recover("dead", 0)
        dead = {t for t in tids[:((N // 2 + 4095) // 4096) * 4096]}
        assert set(fleet.orphans) == dead
        await fleet.recovery.reconcile()
        assert set(fleet.orphans) == set(tids)
        fleet.close()
        await c.close()
    asyncio.run(go())
