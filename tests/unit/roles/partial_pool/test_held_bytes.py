"""The partial pool's memory is bounded in bytes, not only in counts. Before, held (out-of-order)
deltas were capped at `max_held` per trajectory and `max_held_only` trajectories, whatever their
size: 256 held deltas of a megabyte each, in each of thousands of trajectories, all in memory.
And trajectories awaiting their model scores were not bounded at all. Now held bytes over every
trajectory stop at `max_held_bytes` (a delta past it is rejected, its writer sends it again), and
AwaitReward is answered `busy` once `max_awaiting` items or `max_awaiting_bytes` are held."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
from laminar.bus.errors import RemoteError
from laminar.roles.partial_pool.state import PartialBook

from laminar.config import parse_config
from laminar.protocol import AwaitReward, TokenDelta, TrajectorySpec
from laminar.testing import hostile
from laminar.testing.inproc_cluster import InprocCluster

pytestmark = pytest.mark.timeout(60)


def spec(tid: str) -> TrajectorySpec:
    return TrajectorySpec(tid, "p", tid.split("/")[0], 0, 1, np.array([1, 2], np.int32))


def delta(tid: str, seq: int, tokens: int) -> TokenDelta:
    return TokenDelta(tid, seq, np.full(tokens, 3, np.int32), np.zeros(tokens, np.float32), 0,
                      spec(tid) if seq == 0 else None)


def test_held_deltas_are_bounded_in_bytes_over_every_trajectory():
    book = PartialBook(max_held=256, max_held_bytes=10_000)
    for t in ("a/0", "b/0"):
        book.apply("r0", [delta(t, 0, 1)])
    big = 500  # 4 KB of tokens and logprobs per delta
    out = book.apply("r0", [delta("a/0", 2, big), delta("b/0", 2, big), delta("a/0", 3, big)])
    assert out.held == 2 and "b/0" not in out.rejected and "held" in out.rejected["a/0"]
    assert book.held_bytes == 2 * big * 8
    book.apply("r0", [delta("a/0", 1, 1)])          # the gap fills: a/0's held delta is applied, its bytes freed
    assert book.held_bytes == big * 8
    book.complete("b/0")                             # completed with a delta still held: freed too
    assert book.held_bytes == 0


def test_await_reward_is_busy_past_the_bound(tmp_path):
    cfg = parse_config({"run": {"workdir": str(tmp_path)},
                        "cluster": {"keys_dir": None, "broker": {"host": "h0"},
                                    "hosts": {"h0": {"address": "127.0.0.1",
                                                     "roles": [{"role": "partial_pool", "port": 6701}]}}},
                        "roles": {"partial_pool": {"max_awaiting": 2}}})

    async def go():
        c = InprocCluster(cfg)
        await c.start("partial_pool")
        pool = c.client("partial_pool")
        got = []
        for i in range(3):
            t = hostile.trajectory(spec(f"g{i}/0"), "r0", 0.0)
            try:
                got.append((await pool.call(AwaitReward("r0", t, {"rm": 1.0}))).detail or "ok")
            except RemoteError as exc:
                got.append(exc.code)
        await c.close()
        return got
    assert asyncio.run(go()) == ["ok", "ok", "busy"]
