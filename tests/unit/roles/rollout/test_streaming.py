"""DeltaStream (roles/rollout/streaming.py) on its own: how deltas are paged (bounded in deltas and
tokens, a trajectory never split), the columnar request the partial pool unbatches back into the
same deltas, a flush of some trajectories leaving the others' outboxes alone, a fenced-off one
dropped (task cancelled, the loop's events set as it leaves) while the rest of its page is
acknowledged, and make_durable waiting out a partial pool that is down.
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import structlog
from laminar.bus.errors import PeerUnavailable
from laminar.roles.partial_pool.columns import unbatch as _unbatch
from laminar.roles.rollout.streaming import DeltaStream, _columns
from laminar.roles.rollout.trajectory import Active
from laminar.roles.rollout.work import Work

from laminar.protocol import AppendDeltaBatch, DeltaResult, TrajectorySpec

pytestmark = pytest.mark.timeout(30)
LOG = structlog.get_logger("test")


def spec(tid: str) -> TrajectorySpec:
    return TrajectorySpec(trajectory_id=tid, prompt_id="p", group_id=tid, sample_index=0, group_size=1,
                          prompt_tokens=np.asarray([1, 2], dtype=np.int32), answer="x", max_tokens=64)


class Pool:
    """The partial pool's answers: every delta applied, except trajectories named in `refuse`."""

    def __init__(self, refuse: dict[str, str] | None = None, down: int = 0):
        self.refuse, self.down, self.requests = refuse or {}, down, []

    async def call(self, req, timeout: float):
        if self.down > 0:
            self.down -= 1
            raise PeerUnavailable("partial pool down")
        self.requests.append(req)
        ids = req.trajectory_ids if isinstance(req, AppendDeltaBatch) else [d.trajectory_id for d in req.deltas]
        return DeltaResult(applied=len(ids), duplicates=0, held=0,
                           rejected={t: why for t, why in self.refuse.items() if t in ids})


def stream(pool: Pool) -> DeltaStream:
    return DeltaStream("r0", Work(), pool, 1.0, LOG)


def add(s: DeltaStream, tid: str, *chunks: list[int], epoch: int = 0) -> Active:
    a = Active(spec=spec(tid), version=2, epoch=epoch)
    a.lineage = 1
    for toks in chunks:
        a.add_generated(toks, [-0.5] * len(toks))
        a.cut_delta()
    s.work.add(a)
    return a


def test_pages_are_bounded_and_never_split_a_trajectory():
    s = stream(Pool())
    s.FLUSH_DELTAS, s.FLUSH_TOKENS = 3, 6
    a = add(s, "a", [1], [2])              # 2 deltas, 2 tokens
    b = add(s, "b", [3, 4])                # 1 delta: 3 deltas in all, 4 tokens
    c = add(s, "c", [5])                   # a 4th delta: next page
    d = add(s, "d", [6] * 10)              # over the token bound alone: a page of its own
    e = add(s, "e", [7])
    pages = s._pages([a, b, c, d, e])
    assert [[x.id for x in p] for p in pages] == [["a", "b"], ["c"], ["d"], ["e"]]
    assert [[x.id for x in p] for p in s._pages([d, e])] == [["d"], ["e"]]


def test_a_columnar_request_unbatches_into_the_same_deltas():
    s = stream(Pool())
    a = add(s, "a", [1, 2], [3])
    b = add(s, "b", [4], epoch=5)
    deltas = a.outbox + b.outbox
    req = _columns("r0", deltas)
    assert req.offsets.tolist() == [0, 2, 3, 4] and req.tokens.tolist() == [1, 2, 3, 4]
    assert [sp.trajectory_id for sp in req.specs] == ["a", "b"]      # seq 0 carries the spec
    back = _unbatch(req)
    assert [(x.trajectory_id, x.seq, x.version, x.epoch, x.lineage, list(x.tokens)) for x in back] == \
        [("a", 0, 2, 0, 1, [1, 2]), ("a", 1, 2, 0, 1, [3]), ("b", 0, 2, 5, 1, [4])]


def test_a_flush_of_some_trajectories_leaves_the_others_outboxes():
    s = stream(Pool())
    a, b = add(s, "a", [1]), add(s, "b", [2])
    assert asyncio.run(s.flush(["a", "gone"]))
    assert not a.outbox and len(b.outbox) == 1
    (req,) = s.partials.requests
    assert req.trajectory_ids == ["a"]


def test_a_fenced_off_trajectory_is_dropped_and_the_rest_of_its_page_acknowledged():
    s = stream(Pool(refuse={"a": "fenced off: epoch 1 < 2", "b": "gap"}))
    a, b, c = add(s, "a", [1]), add(s, "b", [2]), add(s, "c", [3])

    async def go():
        a.task = asyncio.ensure_future(asyncio.sleep(30))
        assert await s.flush()
        await asyncio.sleep(0)
        return a.task.cancelled()
    assert asyncio.run(go())
    assert a.fenced and not a.outbox and s.fenced_off == 1 and "a" not in s.work.active
    assert not b.outbox and not c.outbox       # another refusal is no fencing: acknowledged as before
    assert s.work.room_freed.is_set() and not s.work.batch_done.is_set()
    s.work.room_freed.clear()
    s._fenced(b, "fenced off")
    s._fenced(c, "fenced off")
    assert s.work.batch_done.is_set() and s.work.room_freed.is_set() and not s.work.active


def test_make_durable_waits_until_the_pool_acknowledges():
    s = stream(Pool(down=2))
    a = add(s, "a", [1])
    assert not asyncio.run(s.flush())        # down: the delta stays in its outbox
    assert len(a.outbox) == 1
    asyncio.run(s.make_durable(a))           # down once more, then acknowledged
    assert not a.outbox and len(s.partials.requests) == 1


def test_concurrent_make_durable_calls_share_one_request():
    """Group commit: callers that ask at once go in one request; one that asks while it is in
    flight goes in the next, with everyone that asked meanwhile; each returns once its own
    tokens are acknowledged."""
    gate = asyncio.Event()

    class SlowPool(Pool):
        async def call(self, req, timeout: float):
            await gate.wait()
            return await super().call(req, timeout)
    s = stream(SlowPool())
    a, b, c, d, e = (add(s, t, [i]) for i, t in enumerate("abcde"))

    async def go():
        first = [asyncio.ensure_future(s.make_durable(x)) for x in (a, b, c)]
        await asyncio.sleep(0.01)            # their request is in flight, held by the pool
        later = [asyncio.ensure_future(s.make_durable(x)) for x in (d, e, a)]
        await asyncio.sleep(0.01)
        assert not any(t.done() for t in first + later)
        gate.set()
        await asyncio.gather(*first, *later)
    asyncio.run(go())
    assert [r.trajectory_ids for r in s.partials.requests] == [["a", "b", "c"], ["d", "e"]]
    assert not any(x.outbox for x in (a, b, c, d, e))


def test_a_group_whose_pool_is_down_is_flushed_again_for_each_caller():
    s = stream(Pool(down=1))
    a, b = add(s, "a", [1]), add(s, "b", [2])

    async def go():
        await asyncio.gather(s.make_durable(a), s.make_durable(b))
    asyncio.run(go())
    assert not a.outbox and not b.outbox
    assert sorted(i for r in s.partials.requests for i in r.trajectory_ids) == ["a", "b"]


def multi_turn(s: DeltaStream, tid: str) -> Active:
    """A trajectory of two turns: sampled tokens, an observation (masked, one span), sampled again."""
    a = Active(spec=spec(tid), version=2)
    a.add_observation([])
    a.add_generated([1, 2], [-0.5, -0.25])
    a.cut_delta()
    a.add_observation([7, 8, 9])
    a.add_generated([3], [-0.125])
    a.cut_delta()
    s.work.add(a)
    return a


def test_multi_turn_deltas_go_in_columns_with_their_masks_and_spans():
    """Multi-turn trajectories (agent calls, env replies) flush as a columnar request, not a nested
    event per delta, and unbatch into the deltas they were: masks and spans included. Single-turn
    ones still go in a request of their own, without a mask (the pool's fast path)."""
    pool = Pool()
    s = stream(pool)
    a, b = multi_turn(s, "a"), add(s, "b", [5])
    deltas = a.outbox + b.outbox
    assert asyncio.run(s.flush())
    assert [type(r) for r in pool.requests] == [AppendDeltaBatch, AppendDeltaBatch]  # single-turn apart
    assert pool.requests[0].loss_mask is None and pool.requests[0].obs_spans is None  # the pool's fast path
    back = _unbatch(pool.requests[1]) + _unbatch(pool.requests[0])
    norm = lambda x: None if x is None else np.asarray(x).tolist()  # noqa: E731
    fields = lambda x: (x.trajectory_id, x.seq, x.version, x.epoch, x.lineage, list(x.tokens),  # noqa: E731
                        list(x.logprobs), norm(x.loss_mask), norm(x.obs_spans))
    assert [fields(x) for x in back] == [fields(d) for d in deltas]
    assert back[1].loss_mask.tolist() == [0, 0, 0, 1] and back[1].obs_spans.tolist() == [[2, 5]]
    assert back[0].obs_spans.tolist() == [[0, 0]] and back[2].obs_spans is None
