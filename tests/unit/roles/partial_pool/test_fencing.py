"""Ownership epochs in the partial pool: once a trajectory is handed to a new owner with a fence,
writes carrying an older epoch (the previous owner, cut off but still running) are refused, so two
writers can never splice two token streams under one trajectory id; the epoch survives a restart."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest

from laminar.protocol import AppendDeltas, GetPartial, ReassignPartial
from laminar.testing.inproc_cluster import InprocCluster
from tests.unit.roles.test_pool_write_failures import cfg, delta

pytestmark = pytest.mark.timeout(60)


def test_a_fenced_off_owner_cannot_write(tmp_path):
    async def go():
        c = InprocCluster(cfg(tmp_path))
        await c.start("partial_pool")
        pool = c.client("partial_pool")
        await pool.call(AppendDeltas("A", [delta("t", 0), delta("t", 1)]))
        ack = await pool.call(ReassignPartial("t", "B", fence=True))        # the link to A was cut
        assert ack.detail == "epoch 1"
        assert (await pool.call(GetPartial("t"))).epoch == 1
        old = await pool.call(AppendDeltas("A", [delta("t", 2)]))           # A still thinks it owns t
        assert old.applied == 0 and "fenced" in old.rejected["t"]
        new = await pool.call(AppendDeltas("B", [dataclasses.replace(delta("t", 2), tokens=delta("t", 9).tokens,
                                                                     epoch=1)]))
        assert new.applied == 1
        await c.stop("partial_pool")
        await c.start("partial_pool")                                         # the fence is durable
        late = await pool.call(AppendDeltas("A", [delta("t", 3)]))
        assert late.applied == 0 and "fenced" in late.rejected["t"]
        state = await pool.call(GetPartial("t"))
        await c.close()
        return state
    state = asyncio.run(go())
    assert state.tokens.tolist() == [10, 20, 11, 21, 19, 29] and state.rollout_id == "B" and state.epoch == 1
