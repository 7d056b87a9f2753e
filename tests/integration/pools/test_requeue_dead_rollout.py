"""A dead rollout's groups are never lost: what it was handed and had not yet streamed to the
partial pool or stored in the buffer is requeued (whole groups, or the missing members alone),
what did get there is settled, and the prompt pool's accounting (`prompts_skipped`) stays 0 across
a restart of the prompt pool. Real pools (on-disk stores) on the in-process bus; the manager's
fleet logic is driven directly."""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import structlog
from laminar.roles.manager.fleet import Fleet, FleetSettings

from laminar.config import parse_config
from laminar.protocol import (
    AppendDeltas,
    HandedGroups,
    Heartbeat,
    PutTrajectory,
    RolloutStats,
    TakeBatch,
    TokenDelta,
    Trajectory,
)
from laminar.testing.inproc_cluster import InprocCluster

pytestmark = pytest.mark.timeout(60)


def cfg(tmp, n=20):
    data = tmp / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": str(i)}) + "\n" for i in range(n)))
    roles = [{"role": "prompt_pool", "port": 6201}, {"role": "partial_pool", "port": 6202},
             {"role": "experience_buffer", "port": 6203}]
    return parse_config({"run": {"workdir": str(tmp)}, "cluster": {"keys_dir": None, "broker": {"host": "h0"},
                         "hosts": {"h0": {"address": "127.0.0.1", "roles": roles}}},
                         "roles": {"prompt_pool": {"dataset": str(data), "group_size": 2}}})


def first_delta(spec) -> TokenDelta:
    return TokenDelta(trajectory_id=spec.trajectory_id, seq=0, tokens=np.array([7], np.int32),
                      logprobs=np.zeros(1, np.float32), version=0, spec=spec)


def finished(spec) -> Trajectory:
    return Trajectory(spec=spec, response_tokens=np.array([7], np.int32), logprobs=np.zeros(1, np.float32),
                      version=0, rollout_id="r1", reward=1.0)


def stats(rid: str) -> RolloutStats:
    return RolloutStats(rollout_id=rid, host="h0", version=0, kv_usage=0.0, running=0, waiting=0, active=0,
                        tokens_per_s=0.0, state="generating", batches=1, generated_tokens=0,
                        control_address="", ts=0.0)


def test_dead_rollouts_unstarted_groups_are_requeued(tmp_path):
    async def main():
        c = cfg(tmp_path)
        cl = InprocCluster(c)
        for role in ("prompt_pool", "partial_pool", "experience_buffer"):
            await cl.start(role)
        pp, partial, buf = cl.client("prompt_pool"), cl.client("partial_pool"), cl.client("experience_buffer")
        b = await pp.call(TakeBatch("r1", 8, batch_seq=1, pid=111))          # four groups of two
        groups: dict[str, list] = {}
        for s in b.trajectories:
            groups.setdefault(s.group_id, []).append(s)
        streamed, half, unstarted, stored = list(groups)
        await partial.call(AppendDeltas("r1", [first_delta(s) for s in groups[streamed]]))
        await buf.call(PutTrajectory(finished(groups[half][0])))             # one member finished, one not
        for s in groups[stored]:
            await buf.call(PutTrajectory(finished(s)))
        await cl.stop("prompt_pool")                                         # the pool restarts meanwhile
        pool = await cl.start("prompt_pool")
        assert pool.counts()["prompts_skipped"] == 0 and pool.counts()["outstanding"] == 4

        fleet = Fleet(cl.hub.transport(), structlog.get_logger(), FleetSettings(rollout_dead_after_s=0.01),
                      lambda rid: "", c.endpoint("partial_pool"), {"0": c.endpoint("prompt_pool")},
                      c.endpoint("experience_buffer"))
        fleet.on_stats(stats("r1"))
        fleet.on_heartbeat(Heartbeat(role="rollout", id="r1", host="h0", pid=111, seq=1, uptime_s=1.0, state="ready"))
        fleet._declare_dead(fleet.views["r1"], "test: killed")
        rid, pid = fleet.recovery.lost.get_nowait()
        await fleet.recovery.recover(rid, pid)

        again = await pp.call(TakeBatch("r2", 8, batch_seq=1, pid=222))
        # first the unstarted group whole and the half-finished group's missing member alone (as
        # their next attempt: same group and sample index, a new trajectory id)
        key = lambda s: (s.group_id, s.sample_index)  # noqa: E731
        assert {key(s) for s in again.trajectories[:3]} == {key(s) for s in groups[unstarted]} | {key(groups[half][1])}
        assert not {s.trajectory_id for s in again.trajectories} & {s.trajectory_id for s in b.trajectories}
        assert not {s.group_id for s in again.trajectories} & {streamed, stored}
        left = await pp.call(HandedGroups("r1"))
        assert left.entries == []                                             # nothing of r1's is unaccounted
        counts = pool.counts()
        assert counts["prompts_skipped"] == 0 and counts["requeued"] == 0
        await cl.stop("prompt_pool")
        pool = await cl.start("prompt_pool")
        assert pool.counts()["prompts_skipped"] == 0
        fleet.close()
        await cl.close()
    asyncio.run(main())


def test_a_rollout_the_manager_never_heard_from_is_given_time_before_its_groups_are_requeued(tmp_path):
    """A rollout that took groups and died before its first report is found by the periodic pass;
    one that just started (no report yet) is not taken for dead at once."""
    async def main():
        c = cfg(tmp_path)
        cl = InprocCluster(c)
        for role in ("prompt_pool", "partial_pool", "experience_buffer"):
            await cl.start(role)
        pp = cl.client("prompt_pool")
        b = await pp.call(TakeBatch("newcomer", 2, batch_seq=1, pid=333))

        def fleet(dead_after_s):
            return Fleet(cl.hub.transport(), structlog.get_logger(), FleetSettings(rollout_dead_after_s=dead_after_s),
                         lambda rid: "", c.endpoint("partial_pool"), {"0": c.endpoint("prompt_pool")},
                         c.endpoint("experience_buffer"))
        patient = fleet(60.0)
        assert await patient.settle_handed()
        assert (await pp.call(HandedGroups("newcomer"))).entries == [b.trajectories[0].group_id]  # still its own
        strict = fleet(0.0)
        await strict.settle_handed()                                  # first seen now (grace 0: not yet past it)
        await strict.settle_handed()                                  # still silent a pass later: requeued
        assert (await pp.call(HandedGroups("newcomer"))).entries == []
        again = await pp.call(TakeBatch("r2", 2, batch_seq=1))
        assert again.trajectories[0].group_id == b.trajectories[0].group_id
        for f in (patient, strict):
            f.close()
        await cl.close()
    asyncio.run(main())
