"""Orphan placement matches weights, not just version numbers: after a trainer resume, version 3 of
lineage 1 and version 3 of lineage 2 are different weights, and a rollout refuses work of the other
(MigrateIn). The manager must send recovered work only to a rollout holding the same lineage."""
import asyncio
import time

import numpy as np
import structlog
from laminar.roles.manager.fleet import Fleet, FleetSettings

from laminar.protocol.data import PartialState, TrajectorySpec
from laminar.protocol.rollout import RolloutStats


def stats(rid: str, version: int, lineage: int) -> RolloutStats:
    return RolloutStats(rid, "h", version, 0.1, 0, 0, 0, 0.0, "generating", lineage=lineage)


def orphan(tid: str, version: int, lineage: int) -> PartialState:
    spec = TrajectorySpec(tid, "p", "g", 0, 1, np.zeros(2, np.int32))
    return PartialState(spec, np.zeros(0, np.int32), np.zeros(0, np.float32), version, "dead", 0, lineage=lineage)


class _NoTransport:
    def client(self, address):
        raise AssertionError("no client expected")


def test_orphans_go_only_to_a_rollout_of_their_lineage():
    fleet = Fleet(_NoTransport(), structlog.get_logger("test"), FleetSettings(orphan_wait_s=1e9), lambda r: "",
                  partial_pool_address=None)
    fleet.on_stats(stats("other", 3, lineage=1))   # same number, discarded branch
    fleet.on_stats(stats("same", 3, lineage=2))
    fleet.on_stats(stats("newer", 4, lineage=2))
    fleet.recovery.orphans = {"t": (orphan("t", 3, lineage=2), time.monotonic())}
    asked: list[str] = []

    async def migrate_in(dest, batch):
        asked.append(dest)
        return [p.spec.trajectory_id for p in batch] if dest == "same" else []

    fleet.mover.migrate_in = migrate_in
    asyncio.run(fleet.recovery.place_orphans())
    assert asked == ["same"]
    assert fleet.orphans == {}


def test_work_without_a_lineage_is_matched_by_version_as_before():
    fleet = Fleet(_NoTransport(), structlog.get_logger("test"), FleetSettings(orphan_wait_s=1e9), lambda r: "",
                  partial_pool_address=None)
    fleet.on_stats(stats("a", 3, lineage=1))
    assert [v.id for v in fleet.recovery.hosts_of(3, -1)] == ["a"]
    assert fleet.recovery.hosts_of(3, 2) == []


def test_work_of_a_failed_move_is_replaced_not_counted_as_recovered():
    """A repack move whose destination refuses leaves its trajectories orphaned for a moment; the
    manager places them on another rollout. That is not the recovery of a dead rollout's work:
    `recovered` (laminar_manager_recovered_trajectories_total, "of dead rollouts") must not count
    them, `replaced` does, and no rollout is declared dead."""
    import types
    fleet = Fleet(_NoTransport(), structlog.get_logger("test"), FleetSettings(orphan_wait_s=1e9), lambda r: "",
                  partial_pool_address=None)
    for rid in ("src", "refuses", "takes"):
        fleet.on_stats(stats(rid, 3, lineage=2))
    parts = [orphan(f"t{i}", 3, lineage=2) for i in range(4)]

    class Source:
        async def call(self, req, timeout):
            return types.SimpleNamespace(partials=parts)

    fleet.mover.client = lambda rid: Source()

    async def migrate_in(dest, batch):
        return set() if dest == "refuses" else {p.spec.trajectory_id for p in batch}

    fleet.mover.migrate_in = migrate_in
    assert asyncio.run(fleet._move("src", "refuses", 3)) == 0
    assert fleet.orphans == {}  # placed at once on the rollout that takes them
    c = fleet.counters
    assert (c.failed_moves, c.replaced, c.recovered, c.dead) == (1, 4, 0, 0)
    # a dead rollout's work is still counted as recovered
    fleet.recovery.orphans = {"d": (orphan("d", 3, lineage=2), time.monotonic())}
    asyncio.run(fleet.recovery.place_orphans())
    assert (fleet.counters.replaced, fleet.counters.recovered) == (4, 1)


class _Recorder:
    """A transport whose clients record every request and accept MigrateIn adopt of what they get."""

    def __init__(self):
        self.sent: list = []

    def client(self, address):
        rec = self

        class Client:
            async def call(self, req, timeout):
                from laminar.protocol import MigrateInResult
                rec.sent.append(req)
                return MigrateInResult([p.spec.trajectory_id for p in req.partials], req.partials[0].version)

            def close(self):
                pass
        return Client()


def test_stuck_orphans_are_offered_for_adoption_by_lineage_and_version():
    """Version 14 of lineage 1 and version 14 of lineage 2 are different weights: one adoption
    offer (which the rollout runs on ONE retained copy) never mixes them."""
    t = _Recorder()
    fleet = Fleet(t, structlog.get_logger("test"), FleetSettings(orphan_wait_s=0.0, orphan_policy="retained"),
                  lambda r: "inproc://r", partial_pool_address=None)
    fleet.on_stats(stats("r", 20, lineage=2))
    fleet.recovery.orphans = {tid: (orphan(tid, 14, lineage), 0.0) for tid, lineage in (("a", 1), ("b", 2), ("c", 1))}
    left = asyncio.run(fleet.recovery.adopt(["a", "b", "c"]))
    offers = sorted(sorted((p.lineage, p.version, p.spec.trajectory_id) for p in req.partials) for req in t.sent)
    assert offers == [[(1, 14, "a"), (1, 14, "c")], [(2, 14, "b")]] and all(req.adopt for req in t.sent)
    assert left == [] and fleet.counters.adopted == 3
