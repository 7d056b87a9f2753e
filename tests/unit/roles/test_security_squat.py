"""Every write is bound to a hand-out: a rollout key cannot squat, replace or wedge another
rollout's groups by writing under their (predictable) ids first.

Real prompt pool, partial pool and experience buffer on the in-process bus, run as a cluster with
scoped keys runs (each role and each client acts as its key: bus/inproc.py). The honest rollout r1
is a client holding `rollout.r1` that writes what a rollout writes (TakeBatch, its deltas, puts);
the attacker holds `rollout.r0`, a key of a compromised rollout host, and builds its writes from
predictable ids alone (laminar/testing/hostile.py). Before hand-outs were checked:
- squatting seq 0 of r1's `e0-pN/1` made r0 its owner: r1's own writes came back "fenced off" (its
  work dropped), GroupPresence counted the member present, and nothing ever requeued it;
- a one-member forged group with reward 1e6 was stored and sampled, r1's real members `duplicate`;
- AwaitReward for r1's id naming a scorer nobody serves completed it: r1's delta was refused
  "already completed" and the item waited for ever;
- doing the first over every row stopped training with `prompts_skipped` still 0.
"""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from laminar.roles.rollout.streaming import _columns

from laminar.config import parse_config
from laminar.health import HealthCollector
from laminar.protocol import (
    GroupPresence,
    Heartbeat,
    InFlightOf,
    PutTrajectory,
    SampleGroups,
    TakeBatch,
    TokenDelta,
)
from laminar.testing import hostile
from laminar.testing.inproc_cluster import InprocCluster

pytestmark = pytest.mark.timeout(120)
N, PROMPTS = 4, 8


def cfg(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": str(i)}) + "\n" for i in range(PROMPTS)))
    rollout = {"engine": "sim", "model_dir": str(tmp_path), "sim": {"model": "7B", "tp": 1, "lengths": "7B_math"}}
    return parse_config({
        "run": {"workdir": str(tmp_path / "run")},
        "cluster": {"keys_dir": None, "broker": {"host": "h0"}, "hosts": {
            "h0": {"address": "127.0.0.1", "roles": [{"role": "prompt_pool", "port": 6401},
                                                     {"role": "partial_pool", "port": 6402},
                                                     {"role": "experience_buffer", "port": 6403}]},
            "h1": {"address": "127.0.0.2", "roles": [{"role": "rollout", "id": "r0", "port": 6410}]},
            "h2": {"address": "127.0.0.3", "roles": [{"role": "rollout", "id": "r1", "port": 6411}]}}},
        "roles": {"prompt_pool": {"dataset": str(data), "group_size": N, "max_tokens": 16},
                  "experience_buffer": {"capacity": 1000}, "rollout": rollout}})


class Rollout:
    """What an honest rollout writes, as the key it holds (its clients)."""

    def __init__(self, cl: InprocCluster, rid: str):
        self.id = rid
        self.pool, self.partials, self.buffer = (cl.client_as(f"rollout.{rid}", r)
                                                 for r in ("prompt_pool", "partial_pool", "experience_buffer"))
        self.seq = 0

    async def take(self, groups: int):
        self.seq += 1
        return (await self.pool.call(TakeBatch(self.id, groups * N, batch_seq=self.seq))).trajectories

    async def stream(self, specs, seq: int = 0):
        deltas = [TokenDelta(s.trajectory_id, seq, np.array([5, 6], np.int32), np.full(2, -0.5, np.float32), 0,
                             s if seq == 0 else None) for s in specs]
        return await self.partials.call(_columns(self.id, deltas))

    async def put(self, spec, reward: float = 1.0):
        return await self.buffer.call(PutTrajectory(hostile.trajectory(spec, self.id, reward)))


async def start(tmp_path):
    cl = InprocCluster(cfg(tmp_path), scoped=True)
    for role in ("prompt_pool", "partial_pool", "experience_buffer"):
        await cl.start(role)
    return cl


def test_squat_another_rollouts_first_delta_is_refused_and_named(tmp_path):
    async def go():
        cl = await start(tmp_path)
        r1 = Rollout(cl, "r1")
        specs = await r1.take(2)
        target = specs[1]                               # e0-p<k>/1, handed to r1
        attacker = cl.client_as("rollout.r0", "partial_pool")
        forged = hostile.forged_spec(target.prompt_id, 1, N, prompt_tokens=target.prompt_tokens)
        squat = await hostile.squat_first_deltas(attacker, "r0", [forged])
        stolen = await hostile.squat_first_deltas(attacker, "r0", [target])   # r1's own spec, leaked
        honest = await r1.stream(specs)
        manager = cl.client_as("manager", "partial_pool")
        present = (await manager.call(GroupPresence([target.group_id]))).present
        r0_work = (await manager.call(InFlightOf("r0"))).partials
        status = cl.roles["partial_pool.0"].status()
        await cl.close()
        return target, squat, stolen, honest, present, r0_work, status
    target, squat, stolen, honest, present, r0_work, status = asyncio.run(go())
    tid = target.trajectory_id
    assert squat.applied == 0 and squat.rejected[tid].startswith("not handed out"), squat
    assert stolen.applied == 0 and "not handed out to rollout r0" in stolen.rejected[tid], stolen
    assert honest.applied == 2 * N and not honest.rejected, honest   # r1 is not fenced off its own work
    assert sorted(present[target.group_id]) == list(range(N)) and not r0_work
    assert status["writes_refused"] == 2 and status["writes_refused_key"] == "rollout.r0"
    assert status["writes_refused_host"] == "h1"
    h = HealthCollector("demo", "h0", {"partial_pool.0": "h0"}, dead_after_s=5.0)
    h.observe(Heartbeat(role="partial_pool", id="0", host="h0", pid=1, seq=1, uptime_s=1.0, state="ready",
                        status=status))
    assert h.alarms() == [next(a for a in h.alarms() if a.startswith("writes_refused (partial_pool.0: 2 writes"))]
    assert "from rollout.r0 on host h1" in h.alarms()[0]


def test_squat_a_forged_one_member_group_is_never_stored_or_trained(tmp_path):
    async def go():
        cl = await start(tmp_path)
        r1, r0 = Rollout(cl, "r1"), Rollout(cl, "r0")
        group = await r1.take(1)
        target = group[0]
        forged = await hostile.forged_put(r0.buffer, "r0", target, reward=1e6, group_size=1)
        own = (await r0.take(1))[0]                     # r0's own hand-out, its group size forged
        resized = await hostile.forged_put(r0.buffer, "r0", own, reward=1e6, group_size=1)
        honest = [await r1.put(s) for s in group]
        sampled = await cl.client_as("trainer", "experience_buffer").call(SampleGroups(4, 0))
        await cl.close()
        return forged, resized, honest, sampled
    forged, resized, honest, sampled = asyncio.run(go())
    assert forged.status == "refused" and forged.detail.startswith("not handed out"), forged
    assert resized.status == "refused", resized
    assert [p.status for p in honest] == ["stored"] * N
    rewards = [t.reward for g in sampled.groups for t in g]
    assert len(sampled.groups) == 1 and len(sampled.groups[0]) == N and max(rewards) == 1.0


def test_squat_await_reward_for_another_rollouts_id_is_refused(tmp_path):
    async def go():
        cl = await start(tmp_path)
        r1 = Rollout(cl, "r1")
        specs = await r1.take(1)
        attacker = cl.client_as("rollout.r0", "partial_pool")
        forged = await hostile.forged_await(attacker, "r0", hostile.forged_spec(specs[0].prompt_id, 0, N))
        leaked = await hostile.forged_await(attacker, "r0", specs[0])
        honest = await r1.stream(specs)
        counts = cl.roles["partial_pool.0"].counts()
        await cl.close()
        return forged, leaked, honest, counts
    forged, leaked, honest, counts = asyncio.run(go())
    for refused in (forged, leaked):
        assert getattr(refused, "code", None) == "refused" and "not handed out" in refused.message, refused
    assert honest.applied == N and not honest.rejected, honest
    assert counts["awaiting_reward"] == 0


def test_squat_every_row_leaves_training_going_and_nothing_skipped(tmp_path):
    async def go():
        cl = await start(tmp_path)
        attacker = cl.client_as("rollout.r0", "partial_pool")
        squat = await hostile.squat_first_deltas(
            attacker, "r0", [hostile.forged_spec(p, j, N) for p in range(PROMPTS) for j in range(N)])
        r1 = Rollout(cl, "r1")
        specs = await r1.take(PROMPTS)
        streamed = await r1.stream(specs)
        puts = [await r1.put(s, reward=float(s.sample_index % 2)) for s in specs]
        sampled = await cl.client_as("trainer", "experience_buffer").call(SampleGroups(PROMPTS, 0))
        skipped = cl.roles["prompt_pool.0"].prompts_skipped
        await cl.close()
        return squat, streamed, puts, sampled, skipped
    squat, streamed, puts, sampled, skipped = asyncio.run(go())
    assert squat.applied == 0 and len(squat.rejected) == PROMPTS * N
    assert streamed.applied == PROMPTS * N and not streamed.rejected
    assert {p.status for p in puts} == {"stored"}
    assert len(sampled.groups) == PROMPTS and skipped == 0
