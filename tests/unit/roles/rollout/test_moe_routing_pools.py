"""A mixture-of-experts trajectory's routing (laminar/models/routing.py) on its way from a rollout to
the trainer, with the real partial pool and experience buffer on the in-process bus (codec on):

- rows are appended only: a resumed trajectory keeps the rows it came back with, and rows the new
  engine reports for positions already recorded are not taken (a gap is not filled either);
- deltas carry the rows after the last cut, as raw uint8 frames, in columnar and in per-delta
  requests; the pool concatenates them, hands them back, keeps them over a restart, and refuses a
  delta whose rows have another shape than the trajectory's earlier ones;
- the buffer stores a trajectory with its routing and hands it to the trainer unchanged.
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
from laminar.bus import codec
from laminar.roles.rollout.streaming import _columns
from laminar.roles.rollout.trajectory import Active

from laminar.config import parse_config
from laminar.protocol import (
    AppendDeltas,
    GetPartial,
    PutTrajectory,
    SampleGroups,
    TokenDelta,
    Trajectory,
    TrajectorySpec,
)
from laminar.testing.inproc_cluster import InprocCluster

pytestmark = pytest.mark.timeout(60)


def cfg(tmp_path):
    return parse_config({"run": {"workdir": str(tmp_path / "run")},
                         "cluster": {"keys_dir": None, "broker": {"host": "h0"},
                                     "hosts": {"h0": {"address": "127.0.0.1", "roles": [
                                         {"role": "partial_pool", "port": 7002},
                                         {"role": "experience_buffer", "port": 7003}]}}}})


def spec(tid: str) -> TrajectorySpec:
    return TrajectorySpec(trajectory_id=tid, prompt_id="p", group_id=tid, sample_index=0, group_size=1,
                          prompt_tokens=np.array([1, 2, 3], np.int32), max_tokens=32)


def rows(start: int, n: int, layers: int = 2, top_k: int = 2) -> np.ndarray:
    """Distinct rows per position: position p's experts are (p % 8, (p + 1) % 8) in every layer."""
    p = np.arange(start, start + n)[:, None, None]
    return np.broadcast_to(np.concatenate([p % 8, (p + 1) % 8], axis=2), (n, layers, top_k)).astype(np.uint8)


def test_moe_routing_rows_are_only_appended():
    a = Active(spec=spec("t"), version=0)
    a.add_generated([5, 6], [-1.0, -1.0])
    assert a.add_routing(rows(0, 4), 0) == 4             # prompt (3) + the first generated token
    assert a.add_routing(rows(2, 3), 2) == 1             # positions 2, 3 already held: only 4 is taken
    assert a.add_routing(rows(9, 2), 9) == 0             # a gap (positions 5..8 unknown): nothing
    assert np.array_equal(a.routing, rows(0, 5))
    b = Active.resume(a.partial("r0"))                   # resumed elsewhere: keeps every row
    assert np.array_equal(b.routing, rows(0, 5)) and b.routing_cut == 5
    b.add_routing(np.zeros((6, 2, 2), np.uint8), 0)      # the new engine's re-prefill: only position 5
    assert np.array_equal(b.routing[:5], rows(0, 5)) and not b.routing[5].any()


def test_moe_routing_through_the_partial_pool_and_a_restart(tmp_path):
    single, multi = Active(spec=spec("s"), version=0), Active(spec=spec("m"), version=0)
    sent = []

    async def flush(pool, a: Active, columnar: bool):
        a.cut_delta()
        req = _columns("r0", a.outbox) if columnar else AppendDeltas("r0", list(a.outbox))
        sent.append(len(codec.encode(req)))
        res = await pool.call(req)
        assert not res.rejected, res.rejected
        a.acked(max(d.seq for d in a.outbox))

    async def go():
        c = InprocCluster(cfg(tmp_path))
        await c.start("partial_pool")
        pool = c.client("partial_pool")
        for step in range(3):  # tokens and rows cut together, the rows a position behind
            for a, columnar in ((single, True), (multi, False)):
                a.add_generated([7 + step, 8 + step], [-0.5, -0.5])
                a.add_routing(rows(0, a.positions - 1), 0)
                await flush(pool, a, columnar)
        held = await pool.call(GetPartial("s"))
        bad = TokenDelta(trajectory_id="s", seq=held.next_seq, tokens=np.array([1], np.int32),
                         logprobs=np.zeros(1, np.float32), version=0, routing=np.zeros((1, 2, 3), np.uint8))
        refused = await pool.call(_columns("r0", [bad]))  # top-3 rows after top-2 ones
        await c.stop("partial_pool")
        await c.start("partial_pool")  # the rows come back from the store
        got = {t: await pool.call(GetPartial(t)) for t in ("s", "m")}
        await c.close()
        return got, refused
    got, refused = asyncio.run(go())
    for tid, p in got.items():
        assert p.routing.dtype == np.uint8 and np.array_equal(p.routing, rows(0, 3 + 6 - 1)), tid
    assert "routing rows of shape (2, 3) after rows of shape (2, 2)" in refused.rejected["s"]
    assert len(sent) == 6


def test_moe_routing_is_stored_and_sampled_unchanged(tmp_path):
    t = Trajectory(spec=spec("b"), response_tokens=np.array([9, 9, 2], np.int32),
                   logprobs=np.zeros(3, np.float32), version=0, rollout_id="r0", reward=1.0, routing=rows(0, 5))
    frames = codec.encode(PutTrajectory(t))
    assert any(len(f) == t.routing.nbytes for f in frames[2:])  # a raw frame of its bytes, not a list

    async def go():
        c = InprocCluster(cfg(tmp_path))
        await c.start("experience_buffer")
        buf = c.client("experience_buffer")
        assert (await buf.call(PutTrajectory(t))).status == "stored"
        s = await buf.call(SampleGroups(1, 0))
        await c.close()
        return s.groups[0][0]
    back = asyncio.run(go())
    assert back.routing.dtype == np.uint8 and np.array_equal(back.routing, t.routing)


def test_moe_routing_pull_from_a_dead_or_hung_engine_costs_rows_not_tokens():
    """A pull the engine never answers (a call in flight when its core was killed) or answers with
    an error is counted and logged, not raised: the flush that called it still sends the tokens."""
    import structlog
    from laminar.roles.rollout.routing import RoutingPuller

    class Engine:  # a stand-in: the engine's answers are the one piece under test
        def __init__(self, how):
            self.how = how

        async def routing(self, asks, drop):
            if self.how == "hang":
                await asyncio.Event().wait()
            if self.how == "dead":
                raise RuntimeError("EngineDeadError")
            return [(0, rows(0, end)) for _, _, end in asks]

    async def go(how):
        a = Active(spec=spec("h"), version=0, request_id="h#r0.1")
        a.add_generated([5, 6], [-1.0, -1.0])
        puller = RoutingPuller(Engine(how), structlog.get_logger("test"), timeout_s=0.2)
        await puller.pull([a])
        return a, puller
    for how in ("hang", "dead"):
        a, puller = asyncio.run(go(how))
        assert puller.failures == 1 and a.routing is None and len(a.tokens) == 2
    a, puller = asyncio.run(go("ok"))
    assert puller.failures == 0 and np.array_equal(a.routing, rows(0, 5))
