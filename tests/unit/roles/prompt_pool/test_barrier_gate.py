"""The barrier modes' gate in the prompt pool bounds the groups that will still be trained, not the
groups ever handed out: a group the experience buffer drops as too stale for the mode is never
trained, so the window it belonged to gets a replacement. Counting it as handed left every later
global batch one group short of what its window generated (one_step at the paper's 72B on 256
GPUs waited ~85 simulated seconds a version for the first complete group of the next window).

Real roles on the in-process bus: a prompt pool and an experience buffer of a one_step config."""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from laminar.config import parse_config
from laminar.protocol import (
    BufferStatsRequest,
    GateOpen,
    PutTrajectory,
    RequeueGroups,
    SampleGroups,
    TakeBatch,
    Trajectory,
)
from laminar.testing.inproc_cluster import InprocCluster

pytestmark = pytest.mark.timeout(60)

G = 2  # groups a global batch (one_step: a rollout holding v may take until (v + 2) * G were handed)


def cfg(tmp, mode="one_step"):
    data = tmp / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": str(i)}) + "\n" for i in range(64)))
    return parse_config({"run": {"workdir": str(tmp), "name": "gate", "mode": mode},
                         "cluster": {"keys_dir": None, "broker": {"host": "h0"},
                                     "hosts": {"h0": {"address": "127.0.0.1", "roles": [
                                         {"role": "prompt_pool", "port": 6711},
                                         {"role": "experience_buffer", "port": 6712}]}}},
                         "roles": {"prompt_pool": {"dataset": str(data), "group_size": 1, "seed": 0,
                                                   "groups_per_version": G}}})


def done(spec, version: int) -> PutTrajectory:
    return PutTrajectory(Trajectory(spec=spec, response_tokens=np.array([5], np.int32),
                                    logprobs=np.zeros(1, np.float32), version=version, rollout_id="r", reward=0.0))


def test_a_group_dropped_as_stale_frees_its_place_under_the_one_step_gate(tmp_path):
    async def go():
        cl = InprocCluster(cfg(tmp_path))
        await cl.start("prompt_pool")
        buf = await cl.start("experience_buffer")
        buf.counts_interval_s = 0.05  # the buffer's counts reach the pool sooner (the test's patience only)
        pp, bc = cl.client("prompt_pool"), cl.client("experience_buffer")
        try:
            w0 = (await pp.call(TakeBatch("r", 16, version=0))).trajectories   # windows of v1 and v2
            assert len(w0) == 2 * G
            slow = w0[0]                                                     # finishes late
            for s in w0[1:]:
                await bc.call(done(s, 0))
            assert len((await bc.call(SampleGroups(G, 0))).groups) == G     # trains v1
            w1 = (await pp.call(TakeBatch("r", 16, version=1))).trajectories
            assert len(w1) == G
            for s in w1:
                await bc.call(done(s, 1))
            assert len((await bc.call(SampleGroups(G, 1))).groups) == G     # trains v2
            w2 = (await pp.call(TakeBatch("r", 16, version=2))).trajectories
            assert len(w2) == G
            assert (await pp.call(TakeBatch("r", 16, version=2))).trajectories == []   # the gate holds
            await bc.call(done(slow, 0))                                     # two versions late
            got = await bc.call(SampleGroups(G, 2))                          # trains v3: `slow` is dropped
            assert got.dropped_stale == 1 and slow.group_id not in {g[0].spec.group_id for g in got.groups}
            assert (await bc.call(BufferStatsRequest())).counts["dropped_stale"] == 1
            more = []
            for _ in range(100):  # the pool learns of the drop from the buffer's published counts
                more = (await pp.call(TakeBatch("r", 16, version=2))).trajectories
                if more:
                    break
                await asyncio.sleep(0.05)
            # the window of v3 lost a group that will never be trained: exactly one replacement
            assert len(more) == 1 and more[0].group_id not in {s.group_id for s in w0 + w1 + w2}
            assert (await pp.call(TakeBatch("r", 16, version=2))).trajectories == []
        finally:
            await cl.close()
    asyncio.run(go())


def test_without_drops_the_gate_is_as_before(tmp_path):
    async def go():
        cl = InprocCluster(cfg(tmp_path, mode="sync"))
        await cl.start("prompt_pool")
        await cl.start("experience_buffer")
        pp = cl.client("prompt_pool")
        try:
            assert len((await pp.call(TakeBatch("r", 16, version=0))).trajectories) == G
            assert (await pp.call(TakeBatch("r", 16, version=0))).trajectories == []
            assert len((await pp.call(TakeBatch("r", 16, version=1))).trajectories) == G
        finally:
            await cl.close()
    asyncio.run(go())


async def gate_open(sub, within_s: float = 5.0) -> bool:
    try:
        _, ev = await asyncio.wait_for(sub.recv(), within_s)
    except TimeoutError:
        return False
    return isinstance(ev, GateOpen)


def test_a_shut_gate_says_so_and_requeued_groups_open_it(tmp_path):
    """An empty answer at the gate is marked `gated` (the rollout then waits for a wake, not
    idle_wait_s); requeued groups pass the gate, so the pool publishes data.gate_open."""
    async def go():
        cl = InprocCluster(cfg(tmp_path, mode="sync"))
        await cl.start("prompt_pool")
        await cl.start("experience_buffer")
        pp = cl.client("prompt_pool")
        sub = cl.hub.transport().subscriber(["data.gate_open"])
        try:
            got = (await pp.call(TakeBatch("r", 16, version=0))).trajectories
            assert len(got) == G
            shut = await pp.call(TakeBatch("r", 16, version=0))
            assert shut.trajectories == [] and shut.gated and not shut.exhausted
            await pp.call(RequeueGroups([got[0].group_id], rollout_id="r"))
            assert await gate_open(sub)
            again = await pp.call(TakeBatch("r2", 16, version=0))
            assert [s.group_id for s in again.trajectories] == [got[0].group_id] and not again.gated
        finally:
            sub.close()
            await cl.close()
    asyncio.run(go())


def test_a_group_dropped_untrained_publishes_the_gate_open(tmp_path):
    async def go():
        cl = InprocCluster(cfg(tmp_path))
        await cl.start("prompt_pool")
        buf = await cl.start("experience_buffer")
        buf.counts_interval_s = 0.05
        pp, bc = cl.client("prompt_pool"), cl.client("experience_buffer")
        sub = cl.hub.transport().subscriber(["data.gate_open"])
        try:
            w0 = (await pp.call(TakeBatch("r", 16, version=0))).trajectories
            for s in w0[1:]:
                await bc.call(done(s, 0))
            await bc.call(SampleGroups(G, 0))
            for v in (1, 2):
                for s in (await pp.call(TakeBatch("r", 16, version=v))).trajectories:
                    await bc.call(done(s, v))
                if v == 1:
                    await bc.call(SampleGroups(G, 1))
            assert (await pp.call(TakeBatch("r", 16, version=2))).gated
            await bc.call(done(w0[0], 0))
            assert (await bc.call(SampleGroups(G, 2))).dropped_stale == 1
            assert await gate_open(sub)
        finally:
            sub.close()
            await cl.close()
    asyncio.run(go())
