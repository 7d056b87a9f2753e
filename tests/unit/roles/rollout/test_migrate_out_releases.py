"""MigrateOut releases ownership in the partial pool before it replies. Before, the source dropped
the migrated trajectories from its own work but left them owned by itself in the pool, and only
the manager's memory knew they were on their way: a manager killed between MigrateOut and MigrateIn
left them forever under a live owner that did not run them (`reconcile` orphans only partials of
owners that are not live), so their group never completed. Now they are owned by nobody once the
reply goes out, and any manager's `reconcile` finds them as orphans. The rollout's handler runs
against the real partial-pool book (tests/unit/roles/rollout/test_wiring.py's stub around it); the
reconcile pass is the real Fleet against the real partial pool role."""
from __future__ import annotations

import asyncio

import numpy as np
import structlog
from laminar.roles.manager.fleet import Fleet, FleetSettings

from laminar.config import parse_config
from laminar.protocol import AppendDeltas, MigrateOut, ReassignPartial, RolloutStats, TokenDelta, TrajectorySpec
from laminar.testing.inproc_cluster import InprocCluster
from tests.unit.roles.rollout.test_wiring import Book, active, make_role


def test_migrate_out_leaves_the_moved_work_owned_by_nobody(tmp_path):
    role = make_role(tmp_path, partials=Book())
    a, b = active(role, "t/0", [1]), active(role, "u/0", [2])

    async def go():
        for x in (a, b):
            x.task = asyncio.ensure_future(asyncio.sleep(30))
        out = await role.migration.on_migrate_out(MigrateOut([], everything=True))
        return sorted(p.spec.trajectory_id for p in out.partials)
    assert asyncio.run(go()) == ["t/0", "u/0"]
    book = role.partials.book
    assert {t: book.entries[t].owner for t in ("t/0", "u/0")} == {"t/0": "", "u/0": ""}
    releases = [r for r in role.partials.requests if isinstance(r, ReassignPartial) and r.rollout_id == ""]
    assert sorted(r.trajectory_id for r in releases) == ["t/0", "u/0"]


def test_reconcile_finds_released_work_of_a_live_rollout(tmp_path):
    cfg = parse_config({"run": {"workdir": str(tmp_path)}, "cluster": {"keys_dir": None, "broker": {"host": "h0"},
                        "hosts": {"h0": {"address": "127.0.0.1", "roles": [{"role": "partial_pool", "port": 6102}]}}}})

    async def go():
        c = InprocCluster(cfg)
        await c.start("partial_pool")
        parts = c.client("partial_pool")
        spec = TrajectorySpec("g/0", "p", "g", 0, 1, np.array([1], np.int32))
        await parts.call(AppendDeltas("r0", [TokenDelta("g/0", 0, np.array([5], np.int32), np.zeros(1, np.float32),
                                                        3, spec=spec)]))
        await parts.call(ReassignPartial("g/0", ""))                 # what MigrateOut now does before replying
        fleet = Fleet(c.hub.transport(), structlog.get_logger("test"), FleetSettings(), lambda rid: "",
                      c.config.endpoint("partial_pool", "0"))
        fleet.on_stats(RolloutStats("r0", "h0", 3, 0.0, 0, 0, 0, 0.0, "idle"))   # r0 is alive
        await fleet.recovery.reconcile()                                      # a manager that never saw the move
        orphans = sorted(fleet.orphans)
        fleet.close()
        await c.close()
        return orphans
    assert asyncio.run(go()) == ["g/0"]
