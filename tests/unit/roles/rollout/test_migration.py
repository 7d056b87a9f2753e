"""Migration (roles/rollout/migration.py) on its own, against the real partial-pool book: MigrateIn
takes only work of the weights held and at most twice max_concurrency, accepts a retried request
once, starts a fresh restart without a take-over and reports work the pool no longer holds as
gone; adoption queues one older version (retained by the relay) and wakes the loop; run_adopted
pins the engine to it or, when it cannot be loaded, gives the work back to the pool; MigrateOut
hands over only what still generates and resumes it here when the pool is unreachable.

The weights are a stand-in (the follower's own logic is tested in tests/unit/roles/rollout/test_weights.py).
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import structlog
from laminar.bus.errors import PeerUnavailable, RemoteError
from laminar.bus.rpc import RequestError
from laminar.roles.partial_pool.columns import unbatch as _unbatch
from laminar.roles.partial_pool.state import PartialBook
from laminar.roles.rollout.migration import Migration
from laminar.roles.rollout.streaming import DeltaStream
from laminar.roles.rollout.trajectory import Active
from laminar.roles.rollout.work import Work

from laminar.protocol import (
    Ack,
    AppendDeltaBatch,
    DeltaResult,
    GetPartial,
    MigrateIn,
    MigrateOut,
    PartialState,
    ReassignPartial,
    TrajectorySpec,
)

pytestmark = pytest.mark.timeout(30)
LOG = structlog.get_logger("test")


def spec(tid: str) -> TrajectorySpec:
    return TrajectorySpec(trajectory_id=tid, prompt_id="p", group_id=tid, sample_index=0, group_size=1,
                          prompt_tokens=np.asarray([1, 2], dtype=np.int32), answer="x", max_tokens=64)


def partial(tid: str, version: int = 4, lineage: int = 1, tokens=(7,), owner: str = "r9") -> PartialState:
    return PartialState(spec=spec(tid), tokens=np.asarray(tokens, np.int32),
                        logprobs=np.asarray([-0.1] * len(tokens), np.float32), version=version, rollout_id=owner,
                        next_seq=1 if tokens else 0, lineage=lineage)


class Pool:
    """The partial pool around the real book; `down` makes every call fail as unreachable."""

    def __init__(self):
        self.book, self.requests, self.down = PartialBook(), [], False

    def holds(self, p: PartialState) -> None:
        a = Active.resume(p)
        a.next_seq, a.cut = 0, 0
        a.cut_delta()
        self.book.apply(p.rollout_id, a.outbox)

    async def call(self, req, timeout: float):
        if self.down:
            raise PeerUnavailable("partial pool down")
        self.requests.append(req)
        if isinstance(req, ReassignPartial):
            if req.trajectory_id not in self.book.entries:
                raise RemoteError("not_found", f"{req.trajectory_id} is not in flight")
            if req.fence:
                return Ack(f"epoch {self.book.fence(req.trajectory_id, req.rollout_id)}")
            self.book.entries[req.trajectory_id].owner = req.rollout_id
            return Ack()
        if isinstance(req, GetPartial):
            return self.book.entries[req.trajectory_id].state()
        deltas = _unbatch(req) if isinstance(req, AppendDeltaBatch) else list(req.deltas)
        out = self.book.apply(req.rollout_id, deltas)
        return DeltaResult(applied=len(out.applied), duplicates=out.duplicates, held=out.held, rejected=out.rejected)


class Weights:
    """What Migration asks of the WeightFollower."""

    def __init__(self, version=4, lineage=1, retained=(2,), loads_as=None):
        self.version, self.lineage, self.retained, self.loads_as = version, lineage, set(retained), loads_as

    def retained_copy(self, lineage: int, version: int):
        """Retained versions are of this follower's lineage here; another lineage's number is not."""
        if version in self.retained and lineage == self.lineage:
            return ("run", lineage, version), ""
        return None, f"its relay holds no version {version} of lineage {lineage}"

    async def load_retained(self, lineage: int, version: int) -> str | None:
        if self.loads_as is not None:
            return self.loads_as
        self.version, self.lineage = version, lineage
        return None


def migration(weights=None, max_concurrency: int = 2) -> Migration:
    work, pool = Work(), Pool()
    stream = DeltaStream("r0", work, pool, 1.0, LOG)
    m = Migration("r0", work, weights or Weights(), stream, pool, None, lambda c, req: c.call(req, 1.0),
                  max_concurrency, LOG)
    m.started = []

    def start(a: Active) -> None:
        work.add(a)
        a.task = asyncio.ensure_future(asyncio.sleep(30))
        m.started.append(a)
    m.start = start
    return m


def run(coro):
    async def go():
        try:
            return await coro
        finally:
            for t in asyncio.all_tasks() - {asyncio.current_task()}:
                t.cancel()
    return asyncio.run(go())


def test_migrate_in_takes_only_the_weights_held_and_at_most_twice_max_concurrency():
    m = migration()
    for p, why in [(partial("a", version=3), "weight version 3"), (partial("a", lineage=2), "lineage 2 vs 1")]:
        with pytest.raises(RequestError, match=why):
            run(m.on_migrate_in(MigrateIn([p])))
    with pytest.raises(RequestError) as busy:
        run(m.on_migrate_in(MigrateIn([partial(f"t{i}", lineage=-1) for i in range(5)])))
    assert busy.value.code == "busy" and not m.work.active and not m.partials.requests


def test_migrate_in_continues_from_the_pool_once_and_restarts_fresh_work_without_a_take_over():
    m = migration()
    p = partial("a", tokens=(7, 8))
    m.partials.holds(p)
    res = run(m.on_migrate_in(MigrateIn([p, partial("fresh", tokens=())])))
    assert sorted(res.accepted) == ["a", "fresh"] and res.version == 4 and not res.gone
    a = m.work.active["a"]
    assert a.tokens == [7, 8] and a.epoch == 1 and m.work.state == "generating"
    fence = [r for r in m.partials.requests if isinstance(r, ReassignPartial)]
    assert [(r.trajectory_id, r.fence) for r in fence] == [("a", True)]   # the fresh one needs none
    res = run(m.on_migrate_in(MigrateIn([p])))                           # a retry whose reply was lost
    assert res.accepted == ["a"] and len(m.started) == 2 and len(m.partials.requests) == len(fence) + 1


def test_work_the_pool_no_longer_holds_is_gone():
    m = migration()
    res = run(m.on_migrate_in(MigrateIn([partial("done-elsewhere")])))
    assert res.gone == ["done-elsewhere"] and not res.accepted and not m.work.active


def test_adoption_queues_one_older_retained_version_and_wakes_the_loop():
    m = migration()
    with pytest.raises(RequestError, match=r"one \(lineage, version\)"):
        run(m.on_migrate_in(MigrateIn([partial("a", version=2), partial("b", version=3)], adopt=True)))
    with pytest.raises(RequestError) as gone:
        run(m.on_migrate_in(MigrateIn([partial("a", version=3)], adopt=True)))
    assert gone.value.code == "not_retained"
    a, b = partial("a", version=2), partial("b", version=2)
    m.partials.holds(a)
    m.partials.holds(b)
    res = run(m.on_migrate_in(MigrateIn([a], adopt=True)))
    assert res.accepted == ["a"] and res.version == 2 and m.work.wake.is_set()
    assert [p.spec.trajectory_id for p in m.adopted] == ["a"] and not m.work.active   # queued, not started
    res = run(m.on_migrate_in(MigrateIn([a, b], adopt=True)))
    assert sorted(res.accepted) == ["a", "b"] and [p.spec.trajectory_id for p in m.adopted] == ["a", "b"]
    m.weights.retained.add(1)
    m.partials.holds(partial("c", version=1))
    with pytest.raises(RequestError) as busy:
        run(m.on_migrate_in(MigrateIn([partial("c", version=1)], adopt=True)))
    assert busy.value.code == "busy"


def test_run_adopted_pins_the_engine_to_the_adopted_version():
    m = migration()
    p = partial("a", version=2)
    m.partials.holds(p)
    run(m.on_migrate_in(MigrateIn([p], adopt=True)))
    run(m.run_adopted())
    assert m.weights.version == 2 and m.pinned and not m.adopted and m.work.state == "generating"
    assert [(a.id, a.version) for a in m.started] == [("a", 2)]


def test_an_adopted_version_that_cannot_be_loaded_is_given_back():
    m = migration(Weights(loads_as="version no longer retained"))
    p = partial("a", version=2)
    m.partials.holds(p)
    run(m.on_migrate_in(MigrateIn([p], adopt=True)))
    run(m.run_adopted())
    assert not m.pinned and not m.started and not m.adopted
    back = [r for r in m.partials.requests if isinstance(r, ReassignPartial) and not r.fence]
    assert [(r.trajectory_id, r.rollout_id) for r in back] == [("a", "")]   # the manager's scan finds it again


def test_migrate_out_hands_over_what_still_generates_and_resumes_it_when_the_pool_is_down():
    m = migration()

    async def go():
        for tid in ("a", "b", "done"):
            p = partial(tid, owner="r0")
            m.partials.holds(p)
            m.start(Active.resume(p))
            m.work.active[tid].add_generated([8], [-0.8])   # not yet flushed
        m.work.active["done"].task.cancel()
        await asyncio.sleep(0)                          # "done" is being scored and stored: not moved
        m.partials.down = True
        with pytest.raises(RequestError, match="resumed here"):
            await m.on_migrate_out(MigrateOut([], everything=True))
        assert set(m.work.active) == {"a", "b", "done"} and len(m.started) == 5   # a and b started again
        m.partials.down = False
        out = await m.on_migrate_out(MigrateOut(["a", "b"]))
        assert sorted(p.spec.trajectory_id for p in out.partials) == ["a", "b"]
        assert all(p.tokens.tolist() == [7, 8] for p in out.partials)                # durable first
        assert m.partials.book.entries["a"].state().tokens.tolist() == [7, 8]
        assert set(m.work.active) == {"done"} and not m.work.batch_done.is_set()
        m.work.active.pop("done")
        out = await m.on_migrate_out(MigrateOut([], everything=True))
        assert out.partials == [] and m.work.batch_done.is_set()
    run(go())
