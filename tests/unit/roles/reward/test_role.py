"""Model-scored rewards, durable (roles/partial_pool/awaiting.py, roles/reward/): a finished
trajectory awaits its scores in the partial pool, survives a pool restart, is leased to one
replica at a time (expired leases are handed out again), each score is applied once, and only the
scored trajectory reaches the buffer, with every reward component."""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from laminar.roles.partial_pool.awaiting import AwaitingBook

from laminar.config import parse_config
from laminar.protocol import (
    AwaitReward,
    GroupPresence,
    LeaseRewards,
    SampleGroups,
    SubmitScores,
    Trajectory,
    TrajectorySpec,
)
from laminar.testing.inproc_cluster import InprocCluster

pytestmark = pytest.mark.timeout(60)


def cfg(tmp_path, roles=None, extra_roles=()):
    return parse_config({"run": {"workdir": str(tmp_path / "run")},
                         "cluster": {"keys_dir": None, "broker": {"host": "h0"},
                                     "hosts": {"h0": {"address": "127.0.0.1", "roles": [
                                         {"role": "partial_pool", "port": 7002},
                                         {"role": "experience_buffer", "port": 7003}, *extra_roles]}}},
                         "roles": roles or {}})


def traj(tid: str, group: str = "g", size: int = 1, rule: float = 0.5, index: int = 0) -> Trajectory:
    spec = TrajectorySpec(trajectory_id=tid, prompt_id="p", group_id=group, sample_index=index, group_size=size,
                          prompt_tokens=np.array([1, 2], np.int32), answer="42")
    return Trajectory(spec=spec, response_tokens=np.array([10, 11, 2], np.int32),
                      logprobs=np.zeros(3, np.float32), version=0, rollout_id="r0", reward=0.9 * rule,
                      reward_components={"fn:rule": rule})


async def forwarded(pool, n: int = 1) -> None:
    """Until the pool has handed `n` scored trajectories to the buffer (it does so in the background)."""
    for _ in range(500):
        if pool.awaiting.counts["forwarded"] >= n:
            return
        await asyncio.sleep(0.02)  # polling the pool's counter, bounded: the forward is asynchronous
    raise AssertionError(f"the pool forwarded {pool.awaiting.counts['forwarded']} of {n}")


def test_reward_role_awaiting_trajectory_survives_a_restart_is_scored_once_then_buffered(tmp_path):
    async def go():
        c = InprocCluster(cfg(tmp_path))
        await c.start("partial_pool")
        await c.start("experience_buffer")
        pool, buf = c.client("partial_pool"), c.client("experience_buffer")
        assert (await pool.call(AwaitReward("r0", traj("t"), {"judge": 0.1}))).detail == ""
        assert (await pool.call(AwaitReward("r0", traj("t"), {"judge": 0.1}))).detail == "duplicate"
        await c.stop("partial_pool")
        await c.start("partial_pool")                                        # durable: still awaiting
        assert (await pool.call(GroupPresence(["g"]))).present == {"g": [0]}  # never requeued as lost
        assert not (await buf.call(SampleGroups(1, 0))).groups               # nothing unscored in the buffer
        work = await pool.call(LeaseRewards("a", "judge", 8))
        assert [t.spec.trajectory_id for t in work.trajectories] == ["t"]
        assert not (await pool.call(LeaseRewards("b", "judge", 8))).trajectories  # leased to a
        first = await pool.call(SubmitScores("a", "judge", ["t"], [1.0]))
        late = await pool.call(SubmitScores("b", "judge", ["t"], [0.0]))
        assert first.applied == 1 and late.applied == 0 and "already scored" in late.refused["t"]
        await forwarded(c.roles["partial_pool.0"])
        got = (await buf.call(SampleGroups(1, 0))).groups
        counts = c.roles["partial_pool.0"].counts()
        await c.close()
        return got, counts
    groups, counts = asyncio.run(go())
    t = groups[0][0]
    assert t.reward == pytest.approx(0.9 * 0.5 + 0.1 * 1.0)
    assert t.reward_components == {"fn:rule": 0.5, "judge": 1.0}
    assert counts["awaiting_reward"] == 0 and counts["reward_late_scores"] == 1


def test_reward_role_expired_lease_is_handed_to_another_replica():
    b = AwaitingBook()
    b.add(traj("t1"), {"rm": 1.0})
    b.add(traj("t2"), {"rm": 1.0})
    assert [t.spec.trajectory_id for t in b.lease("a", "rm", 1, lease_s=10, now=0)] == ["t1"]
    assert [t.spec.trajectory_id for t in b.lease("b", "rm", 5, lease_s=10, now=1)] == ["t2"]
    assert b.lease("c", "rm", 5, lease_s=10, now=5) == [] and b.waiting("rm", now=5) == 0
    again = b.lease("c", "rm", 5, lease_s=10, now=11.5)          # a and b died: both go to c
    assert [t.spec.trajectory_id for t in again] == ["t1", "t2"] and b.counts["lease_expired"] == 2
    applied, refused = b.submit("rm", ["t1", "t2"], [0.3, 0.7])
    assert applied == ["t1", "t2"] and not refused
    applied, refused = b.submit("rm", ["t1"], [0.9])                # a wakes up late: refused, counted
    assert applied == [] and "already scored" in refused["t1"] and b.counts["late_scores"] == 1
    assert b.final("t1").reward == pytest.approx(0.45 + 0.3)


def test_reward_role_two_scorers_both_needed_before_the_buffer():
    b = AwaitingBook()
    b.add(traj("t"), {"rm": 0.5, "judge": 0.25})
    b.submit("rm", ["t"], [1.0])
    assert b.ready() == [] and [x.spec.trajectory_id for x in b.lease("j", "judge", 1, 5)] == ["t"]
    assert b.lease("r", "rm", 1, 5) == []                           # rm is done with it
    _, refused = b.submit("judge", ["t"], [float("nan")])
    assert "finite" in refused["t"] and b.ready() == []            # a bad score changes nothing
    b.submit("judge", ["t"], [0.0], parse_failed=["t"])
    assert b.ready() == ["t"] and b.counts["parse_failed"] == 1
    f = b.final("t")
    assert f.reward == pytest.approx(0.45 + 0.5) and f.reward_components == {"fn:rule": 0.5, "rm": 1.0, "judge": 0.0}
    b.forwarded("t")
    assert b.add(traj("t"), {"rm": 1.0}) is False                   # forwarded: known, never again


def test_reward_role_presence_skips_awaiting_rows_of_a_superseded_attempt(tmp_path):
    """A member awaiting its score under attempt 0 is not the member of attempt 1: if attempt 1's
    rollout dies, the group must be seen as missing that member (else nobody runs it again)."""
    async def go():
        c = InprocCluster(cfg(tmp_path))
        await c.start("partial_pool")
        await c.start("experience_buffer")
        pool = c.client("partial_pool")
        await pool.call(AwaitReward("r0", traj("g/0", size=2), {"rm": 1.0}))
        await pool.call(AwaitReward("r0", traj("g/1~a1", size=2, index=1), {"rm": 1.0}))
        replies = [(await pool.call(GroupPresence(["g"], attempts=a))).present
                   for a in ({}, {"g": 1}, {"g": 0}, {"g": 1, "g/0": 0})]
        await c.close()
        return replies
    everything, attempt1, attempt0, per_member = asyncio.run(go())
    assert sorted(everything["g"]) == [0, 1]
    assert attempt1 == {"g": [1]} and attempt0 == {"g": [0]}
    assert sorted(per_member["g"]) == [0, 1]   # a member's own entry first


def test_reward_role_gives_up_after_expired_leases_with_a_flagged_fallback():
    b = AwaitingBook(give_up_expired=2)
    b.add(traj("t"), {"rm": 0.1})
    for k in range(2):                                          # two replicas die on it
        assert [x.spec.trajectory_id for x in b.lease(f"r{k}", "rm", 1, lease_s=5, now=10 * k)] == ["t"]
    assert b.lease("r2", "rm", 1, lease_s=5, now=20) == []     # the second expiry: not handed out again
    assert b.give_up(fallback=0.0, now=20) == [("t", "rm", "2 leases expired")]
    assert b.ready() == ["t"] and b.counts["gave_up"] == 1 and b.stats(now=25)["reward_gave_up_age_s"] == 5
    f = b.final("t")
    assert f.reward == pytest.approx(0.45) and f.reward_components == {"fn:rule": 0.5, "rm": 0.0, "gave_up:rm": 1.0}
    pending, scores = b.row("t")                                # the flag is durable: a restart keeps it
    again = AwaitingBook()
    again.add(traj("t"), {}, {s: tuple(x) for s, x in json.loads(scores).items()})
    assert again.final("t").reward_components["gave_up:rm"] == 1.0


def test_reward_role_gives_up_after_awaiting_too_long_and_not_before():
    b = AwaitingBook(give_up_s=30)
    b.add(traj("t"), {"rm": 0.1, "judge": 0.2})
    b.items["t"].since = 100.0
    b.submit("rm", ["t"], [1.0])
    assert b.give_up(0.0, now=129) == [] and b.stats(now=129)["reward_gave_up_age_s"] == -1
    assert b.give_up(0.5, now=131) == [("t", "judge", "awaited 31 s")]
    assert b.final("t").reward_components == {"fn:rule": 0.5, "rm": 1.0, "judge": 0.5, "gave_up:judge": 1.0}


def test_reward_role_pool_gives_up_on_a_scorer_that_never_answers(tmp_path):
    """Replicas lease the item and die before submitting, twice: the pool scores it by the fallback,
    flags it, hands it to the buffer, counts it, and its heartbeat raises the alarm."""
    from laminar.health import HealthCollector
    from laminar.protocol import Heartbeat

    async def go():
        c = InprocCluster(cfg(tmp_path, {"partial_pool": {"reward_give_up_expired": 2, "reward_fallback": -1.0}}))
        await c.start("partial_pool")
        await c.start("experience_buffer")
        pool, buf = c.client("partial_pool"), c.client("experience_buffer")
        await pool.call(AwaitReward("r0", traj("t"), {"rm": 0.1}))
        for k in range(3):   # the third finds both leases expired: nothing more is handed out
            got = (await pool.call(LeaseRewards(f"rm{k}", "rm", 8, lease_s=0.01))).trajectories
            assert len(got) == (1 if k < 2 else 0)
            await asyncio.sleep(0.02)  # past the lease: the replica holding it is taken for dead
        await forwarded(c.roles["partial_pool.0"])
        groups = (await buf.call(SampleGroups(1, 0))).groups
        status = c.roles["partial_pool.0"].status()
        await c.close()
        return groups, status
    groups, status = asyncio.run(go())
    t = groups[0][0]
    assert t.reward_components == {"fn:rule": 0.5, "rm": -1.0, "gave_up:rm": 1.0}
    assert t.reward == pytest.approx(0.45 - 0.1)
    assert status["reward_gave_up"] == 1 and status["reward_lease_expired"] == 2
    h = HealthCollector("demo", "h0", {"partial_pool.0": "h0"}, dead_after_s=5.0)
    h.observe(Heartbeat(role="partial_pool", id="0", host="h0", pid=1, seq=1, uptime_s=1.0, state="ready",
                        status=status))
    assert h.alarms() and h.alarms()[0].startswith("reward_gave_up (partial_pool.0: 1 trajectories")
