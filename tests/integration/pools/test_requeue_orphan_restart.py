"""An orphan the manager restarts from its prompt is in the partial pool under its new id before
the old copy is completed: if the rollout that took it dies before its first flush, the work is
still found (no moment where it lives only in one rollout's memory)."""
from __future__ import annotations

import asyncio

import pytest
import structlog
from laminar.roles.manager.fleet import Fleet, FleetSettings

from laminar.protocol import AppendDeltas, InFlightOf, MigrateIn, MigrateInResult, RolloutStats
from laminar.testing.inproc_cluster import InprocCluster
from tests.integration.pools.test_requeue_dead_rollout import cfg, first_delta, stats

pytestmark = pytest.mark.timeout(60)


def test_a_restarted_orphan_is_durable_before_the_old_copy_goes(tmp_path):
    async def main():
        c = cfg(tmp_path)
        cl = InprocCluster(c)
        await cl.start("prompt_pool")
        await cl.start("partial_pool")
        partial = cl.client("partial_pool")
        from laminar.protocol import TakeBatch
        spec = (await cl.client("prompt_pool").call(TakeBatch("old", 2))).trajectories[0]
        await partial.call(AppendDeltas("old", [first_delta(spec)]))
        took: list = []                                    # a rollout that accepts, then dies before flushing

        async def on_migrate_in(req: MigrateIn) -> MigrateInResult:
            took.extend(req.partials)
            return MigrateInResult([p.spec.trajectory_id for p in req.partials], 3)
        server = cl.hub.transport().server("inproc://dest", "rollout", "dest")
        server.route(MigrateIn, on_migrate_in)
        await server.start()
        fleet = Fleet(cl.hub.transport(), structlog.get_logger(),
                      FleetSettings(rollout_dead_after_s=60, orphan_wait_s=0.0), lambda rid: "inproc://dest",
                      c.endpoint("partial_pool"))
        fleet.on_stats(RolloutStats(**{**stats("dest").__dict__, "version": 3}))
        p = (await partial.call(InFlightOf("old"))).partials[0]
        fleet.orphans[p.spec.trajectory_id] = (p, 0.0)
        await fleet.recovery.restart([p.spec.trajectory_id])
        assert [t.spec.trajectory_id for t in took] == [spec.trajectory_id + "~r1"]
        held = (await partial.call(InFlightOf("dest"))).partials  # dest died here: its work is still found
        assert [h.spec.trajectory_id for h in held] == [spec.trajectory_id + "~r1"]
        assert took[0].next_seq == 1 and not (await partial.call(InFlightOf("old"))).partials
        fleet.close()
        await server.close()
        await cl.close()
    asyncio.run(main())
