"""The reward plane trusts a reward key only with its own scorer's work and its own leases.

Real prompt pool, partial pool and experience buffer on the in-process bus as a cluster with
scoped keys runs them (bus/inproc.py); reward replicas are clients holding `reward.<scorer>` keys.
Before:
- a `reward.judge` key leased and scored the classifier's work (no key was bound to its scorer);
- any reward key submitted scores for items it never leased (one another replica held);
- one `LeaseRewards(10**6, lease_s=1e9)` took every item for good: no replica got work again;
- an item awaiting a scorer no replica serves waited for ever, silently;
- `laminar-node check` did not notice a rollout reward naming a scorer no reward role serves;
- under `eviction: reject`, one scored item the buffer can never take wedged the forwarder:
  3 of 8 items stored, 5 never left the pool.
"""
from __future__ import annotations

import asyncio
import json

import pytest
import yaml
from laminar.bus.errors import RemoteError

from laminar.check import run_checks
from laminar.config import parse_config
from laminar.protocol import AwaitReward, GroupPresence, LeaseRewards, SubmitScores, TakeBatch
from laminar.testing import hostile
from laminar.testing.inproc_cluster import InprocCluster

pytestmark = pytest.mark.timeout(120)
N = 2


def cfg(tmp_path, partial: dict | None = None, buffer: dict | None = None, big_group: int = 0):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": str(i)}) + "\n" for i in range(8)))
    roles = [{"role": "prompt_pool", "port": 6501}, {"role": "partial_pool", "port": 6502},
             {"role": "experience_buffer", "port": 6503}]
    if big_group:  # a second prompt pool whose groups are larger than the buffer can ever hold
        roles.append({"role": "prompt_pool", "id": "1", "port": 6504, "options": {"group_size": big_group}})
    reward = {"backend": "http", "http": {"url": "http://127.0.0.1:9/score"}}
    return parse_config({
        "run": {"workdir": str(tmp_path / "run")},
        "cluster": {"keys_dir": None, "broker": {"host": "h0"}, "hosts": {
            "h0": {"address": "127.0.0.1", "roles": roles},
            "h1": {"address": "127.0.0.2", "roles": [
                {"role": "reward", "id": "rm1", "port": 6510, "options": {"scorer": "classifier"}},
                {"role": "reward", "id": "rm2", "port": 6511, "options": {"scorer": "judge"}}]}}},
        "roles": {"prompt_pool": {"dataset": str(data), "group_size": N, "max_tokens": 16},
                  "partial_pool": partial or {}, "experience_buffer": buffer or {"capacity": 1000},
                  "reward": reward}})


async def start(c, scoped: bool = True) -> InprocCluster:
    cl = InprocCluster(c, scoped=scoped)
    for role, i in [(s.role, s.id) for _, s in c.placements() if s.role != "reward"]:
        await cl.start(role, i)
    return cl


async def awaiting(cl, rollout: str, scorers: dict, groups: int = 1, pool: str = "0") -> list:
    """A rollout takes `groups` groups and hands every member over to await `scorers`."""
    take = cl.client_as(f"rollout.{rollout}", "prompt_pool", pool) if cl.scoped else cl.client("prompt_pool", pool)
    specs = (await take.call(TakeBatch(rollout, groups * N))).trajectories
    parts = cl.client_as(f"rollout.{rollout}", "partial_pool") if cl.scoped else cl.client("partial_pool")
    for s in specs:
        await parts.call(AwaitReward(rollout, hostile.trajectory(s, rollout, 0.5), scorers))
    return specs


def test_reward_forge_a_scorer_key_serves_only_its_scorer(tmp_path):
    async def go():
        cl = await start(cfg(tmp_path))
        specs = await awaiting(cl, "r0", {"classifier": 1.0})
        judge = cl.client_as("reward.judge", "partial_pool")
        lease = await hostile.lease_everything(judge, "rm2", "classifier", items=8, lease_s=10)
        try:
            submit = await judge.call(SubmitScores("rm2", "classifier", [specs[0].trajectory_id], [9.0]))
        except RemoteError as exc:
            submit = exc
        own = await cl.client_as("reward.classifier", "partial_pool").call(LeaseRewards("rm1", "classifier", 8, 10))
        await cl.close()
        return lease, submit, own
    lease, submit, own = asyncio.run(go())
    assert isinstance(lease, RemoteError) and lease.code == "refused" and "scorer" in lease.message, lease
    assert isinstance(submit, RemoteError) and submit.code == "refused", submit
    assert len(own.trajectories) == N


def test_reward_forge_scores_only_against_ones_own_lease(tmp_path):
    async def go():
        cl = await start(cfg(tmp_path))
        specs = await awaiting(cl, "r0", {"classifier": 1.0})
        key = cl.client_as("reward.classifier", "partial_pool")
        ids = [s.trajectory_id for s in specs]
        never = await key.call(SubmitScores("rm9", "classifier", ids, [9.0] * N))   # leased by nobody
        await key.call(LeaseRewards("rm1", "classifier", N, 30))
        other = await key.call(SubmitScores("rm9", "classifier", ids, [9.0] * N))   # rm1's lease, not rm9's
        own = await key.call(SubmitScores("rm1", "classifier", ids, [0.25] * N))
        await cl.close()
        return never, other, own
    never, other, own = asyncio.run(go())
    assert never.applied == 0 and all("lease" in why for why in never.refused.values()), never
    assert other.applied == 0 and len(other.refused) == N, other
    assert own.applied == N and not own.refused


def test_reward_forge_leasing_everything_for_ever_is_bounded(tmp_path):
    partial = {"lease_max_items": 3, "lease_max_s": 0.5}
    async def go():  # noqa: E306
        cl = await start(cfg(tmp_path, partial))
        await awaiting(cl, "r0", {"classifier": 1.0}, groups=4)
        key = cl.client_as("reward.classifier", "partial_pool")
        greedy = await hostile.lease_everything(key, "evil", "classifier")
        honest = []
        async with asyncio.timeout(20):
            while not honest:  # the greedy leases end: an honest replica gets work
                honest = (await key.call(LeaseRewards("rm1", "classifier", 8, 30))).trajectories
                await asyncio.sleep(0.1)  # polling until the capped lease expired
        await cl.close()
        return greedy, honest
    greedy, honest = asyncio.run(go())
    assert len(greedy.trajectories) == 3 and 0 < greedy.lease_s <= 0.5
    assert len(honest) == 3


def test_reward_forge_items_no_replica_leases_are_given_up_and_alarmed(tmp_path):
    async def go():
        cl = await start(cfg(tmp_path, {"reward_never_leased_s": 0.5}), scoped=False)
        specs = await awaiting(cl, "r0", {"nobody": 1.0})
        gids = [specs[0].group_id]
        async with asyncio.timeout(20):
            while len((await cl.client("experience_buffer").call(GroupPresence(gids))).present.get(gids[0], [])) < N:
                await asyncio.sleep(0.1)  # polling the buffer: the fallback scores them, then they are stored
        status = cl.roles["partial_pool.0"].status()
        await cl.close()
        return status
    status = asyncio.run(go())
    assert status["reward_gave_up"] == N and status["reward_unserved"] == N and 0 <= status["reward_gave_up_age_s"]
    from laminar.roles.partial_pool.config import PartialPoolConfig
    assert PartialPoolConfig().reward_never_leased_s is not None  # on by default


def test_reward_forge_check_names_scorers_no_reward_role_serves(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "p", "answer": "1"}) + "\n")
    conf = {"run": {"workdir": str(tmp_path / "run")},
            "cluster": {"keys_dir": None, "broker": {"host": "h0"}, "hosts": {"h0": {"address": "127.0.0.1", "roles": [
                {"role": "prompt_pool", "port": 6601}, {"role": "partial_pool", "port": 6602},
                {"role": "reward", "id": "rm1", "port": 6603, "options": {"scorer": "classifier"}},
                {"role": "rollout", "id": "r0", "port": 6604}]}}},
            "roles": {"prompt_pool": {"dataset": str(data)},
                      "reward": {"backend": "http", "http": {"url": "http://127.0.0.1:9/score"}},
                      "rollout": {"engine": "sim", "model_dir": str(tmp_path),
                                  "sim": {"model": "7B", "tp": 1, "lengths": "7B_math"},
                                  "rewards": [{"fn": "laminar.tasks.rewards:exact_answer", "weight": 0.5},
                                              {"role": "judge", "weight": 0.5}]}}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(conf))
    _, problems = run_checks(str(path))
    named = [p for p in problems if "judge" in p]
    assert len(named) == 1 and "rewards" in named[0] and "classifier" in named[0], problems


def test_reward_forge_an_item_the_buffer_never_takes_is_parked_not_wedging_the_rest(tmp_path):
    partial = {"forward_window": 4, "forward_retry_s": 0.05}
    buffer = {"capacity": 4, "eviction": "reject"}
    async def go():  # noqa: E306
        cl = await start(cfg(tmp_path, partial, buffer, big_group=8), scoped=False)
        bad = await awaiting(cl, "r0", {"classifier": 1.0}, groups=1, pool="1")  # 8 members, never fit 4
        good = await awaiting(cl, "r1", {"classifier": 1.0}, groups=2)           # 2 groups of 2
        key = cl.client("partial_pool")
        work = (await key.call(LeaseRewards("rm1", "classifier", 64, 30))).trajectories
        ids = [t.spec.trajectory_id for t in work]
        await key.call(SubmitScores("rm1", "classifier", ids, [1.0] * len(ids)))
        gids = sorted({s.group_id for s in good})
        async with asyncio.timeout(20):
            while sum(len(v) for v in (await cl.client("experience_buffer").call(
                    GroupPresence(gids))).present.values()) < len(good):
                await asyncio.sleep(0.1)  # polling the buffer: every good item stored
        status = cl.roles["partial_pool.0"].status()
        await cl.close()
        return bad, status
    bad, status = asyncio.run(go())
    assert status["reward_parked"] >= 1 and status["awaiting_reward"] == len(bad)
