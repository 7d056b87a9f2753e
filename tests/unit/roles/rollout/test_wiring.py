"""The rollout's side of the data pools' features, one at a time against stub pools (and the real
partial-pool book where the answer matters): TakeBatch names the asking process; single-turn
flushes go columnar (AppendDeltaBatch) and are paged under a fixed bound, multi-turn ones by
AppendDeltas; every delta carries the ownership epoch, and a write refused as fenced off stops
that trajectory here (never stored); work handed over is fenced to its new owner; seq 0 carries the
weights' lineage and the partial pool hands it back; a pool's `deadline` error is retried.
"""
from __future__ import annotations

import asyncio
import os
import types

import numpy as np
import pytest
from laminar.bus.errors import RemoteError
from laminar.roles.partial_pool.columns import unbatch as _unbatch
from laminar.roles.partial_pool.state import PartialBook
from laminar.roles.rollout.role import RolloutRole
from laminar.roles.rollout.trajectory import Active

from laminar.protocol import (
    Ack,
    AppendDeltaBatch,
    AppendDeltas,
    Batch,
    DeltaResult,
    GetPartial,
    MigrateIn,
    PartialState,
    PutTrajectory,
    ReassignPartial,
    TakeBatch,
    TrajectorySpec,
)
from laminar.role_base import RoleContext

pytestmark = pytest.mark.timeout(60)


def spec(tid: str, max_tokens: int = 64) -> TrajectorySpec:
    return TrajectorySpec(trajectory_id=tid, prompt_id="p", group_id=tid.split("/")[0], sample_index=0,
                          group_size=1, prompt_tokens=np.asarray([1, 2, 3], dtype=np.int32), answer="x",
                          max_tokens=max_tokens)


class Client:
    """A pool stub: `answer(req)` decides the reply (or raises); every request is recorded."""

    def __init__(self, answer=None):
        self.answer, self.requests = answer, []

    async def call(self, req, timeout: float):
        self.requests.append(req)
        return self.answer(req) if self.answer else Ack()


class Book:
    """A partial pool stub around the real book (exactly-once, fencing) and the real unbatching."""

    def __init__(self):
        self.book, self.requests = PartialBook(), []

    async def call(self, req, timeout: float):
        self.requests.append(req)
        if isinstance(req, AppendDeltaBatch):
            out = self.book.apply(req.rollout_id, _unbatch(req), checked=True)
        elif isinstance(req, AppendDeltas):
            out = self.book.apply(req.rollout_id, list(req.deltas))
        elif isinstance(req, GetPartial):
            return self.book.entries[req.trajectory_id].state()
        elif isinstance(req, ReassignPartial):
            if req.fence:
                return Ack(f"epoch {self.book.fence(req.trajectory_id, req.rollout_id)}")
            self.book.entries[req.trajectory_id].owner = req.rollout_id
            return Ack()
        else:
            return Ack()
        return DeltaResult(applied=len(out.applied), duplicates=out.duplicates, held=out.held, rejected=out.rejected)


def make_role(tmp_path, prompts=None, partials=None, buffer=None, **settings) -> RolloutRole:
    config = types.SimpleNamespace(workdir=lambda: tmp_path, endpoint=lambda role, id: f"inproc://{role}.{id}")
    role = RolloutRole(RoleContext(role="rollout", id="r0", host="h0", transport=None,
                                   settings={"engine": "sim", **settings}, cluster=config))
    role.wire(types.SimpleNamespace(stats=types.SimpleNamespace(kv_usage=0.0, running=0, waiting=0)),
              prompts=prompts, partials=partials, buffer=buffer, reward=lambda spec, tokens: 1.0)
    return role


def active(role: RolloutRole, tid: str, tokens: list[int], **kw) -> Active:
    a = Active(spec=spec(tid), version=role.version, **kw)
    a.add_generated(tokens, [-0.5] * len(tokens))
    role.active[a.id] = a
    return a


# -- TakeBatch names the process -------------------------------------------------------------------
def test_take_batch_carries_this_process_pid(tmp_path):
    role = make_role(tmp_path, prompts=Client(lambda req: Batch([])))

    async def go():
        await role._take_batch(4)
    asyncio.run(go())
    (req,) = role.prompts.requests
    assert isinstance(req, TakeBatch) and req.pid == os.getpid() and req.max_trajectories == 4


# -- columnar, paged flushes -----------------------------------------------------------------------
def test_single_turn_flush_is_columnar_and_paged(tmp_path):
    role = make_role(tmp_path, partials=Book())
    role.stream.FLUSH_DELTAS = 3
    acts = [active(role, f"g{i}/0", [10 + i, 20 + i]) for i in range(7)]

    async def go():
        assert await role.stream.flush()
        for a in acts:
            a.add_generated([30], [-0.1])
        assert await role.stream.flush()
    asyncio.run(go())
    reqs = role.partials.requests
    assert reqs and all(isinstance(r, AppendDeltaBatch) for r in reqs)
    assert max(len(r.trajectory_ids) for r in reqs) <= 3 and sum(len(r.trajectory_ids) for r in reqs) == 14
    assert all(not a.outbox for a in acts)
    st = role.partials.book.entries["g4/0"].state()
    assert st.tokens.tolist() == [14, 24, 30] and st.next_seq == 2


def test_a_flush_page_is_bounded_in_tokens_too(tmp_path):
    role = make_role(tmp_path, partials=Book())
    role.stream.FLUSH_TOKENS = 5
    for i in range(4):
        active(role, f"g{i}/0", [1, 2, 3])

    async def go():
        assert await role.stream.flush()
    asyncio.run(go())
    reqs = role.partials.requests
    assert len(reqs) >= 2 and all(len(r.tokens) <= 5 or len(r.trajectory_ids) == 1 for r in reqs)
    assert sum(len(r.trajectory_ids) for r in reqs) == 4


def test_multi_turn_deltas_go_in_columns_with_their_mask(tmp_path):
    """A multi-turn delta travels as columns with its loss mask, in a page of its own; single-turn
    pages carry no mask (the pool's fast path)."""
    role = make_role(tmp_path, partials=Book())
    a = active(role, "m/0", [5, 6])
    a.add_observation([7, 8])
    active(role, "s/0", [9])

    async def go():
        assert await role.stream.flush()
    asyncio.run(go())
    reqs = role.partials.requests
    assert reqs and all(isinstance(r, AppendDeltaBatch) for r in reqs)
    (multi,) = [r for r in reqs if r.loss_mask is not None]
    assert multi.trajectory_ids == ["m/0"] and multi.loss_mask.tolist() == [1, 1, 0, 0]
    assert all(r.loss_mask is None for r in reqs if "s/0" in r.trajectory_ids)
    assert role.partials.book.entries["m/0"].state().loss_mask.tolist() == [1, 1, 0, 0]


def test_a_failed_page_leaves_its_deltas_in_the_outbox(tmp_path):
    book = Book()
    calls = []

    async def flaky(req, timeout):
        calls.append(req)
        if len(calls) == 2:
            raise RemoteError("unavailable", "pool restarting")
        return await book.call(req, timeout)
    role = make_role(tmp_path, partials=types.SimpleNamespace(call=flaky))
    role.stream.FLUSH_DELTAS = 2
    acts = [active(role, f"g{i}/0", [i]) for i in range(4)]

    async def go():
        assert not await role.stream.flush()
        assert sum(bool(a.outbox) for a in acts) == 2
        assert await role.stream.flush()
    asyncio.run(go())
    assert all(not a.outbox for a in acts) and len(book.book.live()) == 4


# -- ownership epochs ------------------------------------------------------------------------------
def test_resume_keeps_the_epoch_and_every_delta_carries_it(tmp_path):
    p = PartialState(spec=spec("t/0"), tokens=np.asarray([1], np.int32), logprobs=np.asarray([-0.1], np.float32),
                     version=0, rollout_id="r1", next_seq=1, epoch=3)
    a = Active.resume(p)
    assert a.epoch == 3
    a.add_generated([2], [-0.2])
    a.cut_delta()
    assert [d.epoch for d in a.outbox] == [3]


def test_a_fenced_off_trajectory_stops_here_and_is_never_stored(tmp_path):
    role = make_role(tmp_path, partials=Book(), buffer=Client(lambda req: None))
    a = active(role, "t/0", [1, 2])
    b = active(role, "u/0", [3])
    cancelled = []

    async def go():
        async def gen():
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.append(a.id)
                raise
        a.task = asyncio.ensure_future(gen())
        await asyncio.sleep(0)
        assert await role.stream.flush()
        role.partials.book.fence("t/0", "r9")          # handed to r9 while this rollout was cut off
        a.add_generated([4], [-0.4])
        b.add_generated([5], [-0.5])
        await role.stream.flush()
        await asyncio.sleep(0.05)
        await role.runner._finish(a, "stop")                 # a finish racing the refusal stores nothing
    asyncio.run(go())
    assert cancelled == ["t/0"] and "t/0" not in role.active and "u/0" in role.active
    assert role.stream.fenced_off == 1
    assert not [r for r in role.buffer.requests if isinstance(r, PutTrajectory)]
    assert role.partials.book.entries["t/0"].state().tokens.tolist() == [1, 2]
    assert role.partials.book.entries["u/0"].state().tokens.tolist() == [3, 5]


def test_migrated_in_work_is_fenced_to_its_new_owner(tmp_path):
    role = make_role(tmp_path, partials=Book())
    role.runner._generate = lambda a: asyncio.sleep(0)
    old = active(role, "t/0", [1, 2])

    async def go():
        await role.stream.flush()
        role.active.clear()
        p = role.partials.book.entries["t/0"].state()
        res = await role.migration.on_migrate_in(MigrateIn([p]))
        assert res.accepted == ["t/0"]
        a = role.active["t/0"]
        assert a.epoch == 1
        a.add_generated([3], [-0.3])
        await role.stream.flush()
    asyncio.run(go())
    (fence,) = [r for r in role.partials.requests if isinstance(r, ReassignPartial)]
    assert fence.fence and fence.rollout_id == "r0"
    assert role.partials.book.entries["t/0"].state().tokens.tolist() == [1, 2, 3]
    del old


def test_migrated_in_work_continues_from_what_the_pool_holds(tmp_path):
    """The state handed over was read before a cut-off owner wrote one more delta: the new owner
    continues from the pool's state, never writing its own tokens under the same seqs."""
    role = make_role(tmp_path, partials=Book())
    role.runner._generate = lambda a: asyncio.sleep(0)
    old = active(role, "t/0", [1, 2])

    async def go():
        await role.stream.flush()
        snapshot = role.partials.book.entries["t/0"].state()        # what the manager read
        old.add_generated([7], [-0.7])
        await role.stream.flush()                                          # the old owner, still running
        role.active.clear()
        await role.migration.on_migrate_in(MigrateIn([snapshot]))
        a = role.active["t/0"]
        assert a.tokens == [1, 2, 7] and a.next_seq == 2
        a.add_generated([8], [-0.8])
        await role.stream.flush()
    asyncio.run(go())
    assert role.partials.book.entries["t/0"].state().tokens.tolist() == [1, 2, 7, 8]


def test_migrate_out_hands_over_no_fenced_off_trajectory(tmp_path):
    from laminar.protocol import MigrateOut
    role = make_role(tmp_path, partials=Book())
    a, b = active(role, "t/0", [1]), active(role, "u/0", [2])

    async def go():
        for x in (a, b):
            x.task = asyncio.ensure_future(asyncio.sleep(30))
        await role.stream.flush()
        role.partials.book.fence("t/0", "r9")
        a.add_generated([3], [-0.3])
        out = await role.migration.on_migrate_out(MigrateOut([], everything=True))
        return [p.spec.trajectory_id for p in out.partials]
    assert asyncio.run(go()) == ["u/0"]
    assert not role.active and role.stream.fenced_off == 1


# -- lineage ---------------------------------------------------------------------------------------
def test_seq_0_carries_the_lineage_and_the_book_returns_it(tmp_path):
    role = make_role(tmp_path, partials=Book())
    role.weights.version, role.weights.lineage = 5, 2
    a = Active(spec=spec("t/0"), version=5)
    a.lineage = 2
    a.add_generated([1], [-0.1])
    role.active[a.id] = a
    m = Active(spec=spec("m/0"), version=5)
    m.lineage = 2
    m.add_observation([9])
    role.active[m.id] = m

    async def go():
        assert await role.stream.flush()
    asyncio.run(go())
    assert role.partials.book.entries["t/0"].state().lineage == 2
    assert role.partials.book.entries["m/0"].state().lineage == 2
    resumed = Active.resume(role.partials.book.entries["t/0"].state())
    assert resumed.lineage == 2


# -- retries ---------------------------------------------------------------------------------------
def test_a_deadline_error_is_retried(tmp_path):
    role = make_role(tmp_path)
    answers = [RemoteError("deadline", "arrived after its deadline"), Ack("ok")]

    def answer(req):
        x = answers.pop(0)
        if isinstance(x, Exception):
            raise x
        return x
    c = Client(answer)

    async def go():
        return await role._call(c, ReassignPartial("t", "r0"))
    assert asyncio.run(go()).detail == "ok" and len(c.requests) == 2


# -- status ----------------------------------------------------------------------------------------
def test_status_answers_before_setup_wires_the_components(tmp_path):
    """Heartbeats (which carry status()) start before setup(), and a vLLM engine takes a while to
    start: until the components are wired the status is the one of a rollout holding nothing."""
    config = types.SimpleNamespace(workdir=lambda: tmp_path, endpoint=lambda role, id: f"inproc://{role}.{id}")
    role = RolloutRole(RoleContext(role="rollout", id="r0", host="h0", transport=None,
                                   settings={"engine": "sim"}, cluster=config))
    assert role.status() == {"version": 0, "lineage": 0, "run_id": "", "active": 0, "state": "idle", "batches": 0,
                             "kv": 0.0,
                             "weight_pull_failures": 0, "puts_refused": 0, "fenced_off": 0, "gave_up": 0,
                             "take_failures": 0}
    role = make_role(tmp_path)
    assert role.status()["version"] == 0 and role.status()["fenced_off"] == 0
