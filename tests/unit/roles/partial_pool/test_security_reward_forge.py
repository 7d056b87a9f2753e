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


def hostile_items(n: int):
    from laminar.roles.partial_pool.awaiting import AwaitingBook
    book = AwaitingBook(give_up_expired=5)
    book.share_after_s = 10.0  # the partial pool's lease_shared_after_s
    for i in range(n):
        spec = hostile.forged_spec(i, 0, 1)
        book.add(hostile.trajectory(spec, "r0", 0.5), {"rm": 1.0})
    return book


def test_reward_forge_a_hostile_key_leasing_in_a_loop_holds_no_item_past_the_share_window():
    """A `reward.rm` key that asks for everything, for as long as the pool allows, over and over
    under fresh replica ids (the hostile chaos run's reward host): before, each item stayed leased
    to it for lease_max_s (600 s) and, once expired, went back to whoever asked first (the loop),
    so no honest replica of the scorer got work and training stopped. Now an item leased for
    lease_shared_after_s without a score is leased to any other replica that asks as well: the
    first score applied wins, the sitter's lease gains it nothing."""
    book = hostile_items(6)
    assert len(book.lease("evil0", "rm", 10**6, 600.0, now=0.0)) == 6
    for k, t in enumerate((1.0, 5.0, 9.5)):
        assert book.lease(f"evil{k + 1}", "rm", 10**6, 600.0, now=t) == []
    assert book.lease("rm1", "rm", 16, 5.0, now=9.5) == []            # still its lease alone
    shared = book.lease("rm1", "rm", 16, 5.0, now=10.5)                # held past the window: shared
    ids = [t.spec.trajectory_id for t in shared]
    assert len(ids) == 6
    assert book.lease("rm1", "rm", 16, 5.0, now=10.7) == []           # it holds them already
    assert len(book.lease("evil9", "rm", 10**6, 600.0, now=10.8)) == 6  # another sitter shares too: no gain
    applied, refused = book.submit("rm", ids, [0.25] * 6, replica="rm1")
    assert applied == ids and not refused
    late, why = book.submit("rm", ids, [9.0] * 6, replica="evil0")
    assert late == [] and all(w.startswith("already scored") for w in why.values())


def test_reward_forge_a_shared_item_is_scored_by_any_holder_and_expires_as_one():
    book = hostile_items(1)
    (item,) = book.lease("evil", "rm", 1, 600.0, now=0.0)
    tid = item.spec.trajectory_id
    assert book.lease("rm1", "rm", 1, 5.0, now=11.0) == [item]
    assert book.submit("rm", [tid], [0.5], replica="rm2")[0] == []      # rm2 never leased it
    assert book.submit("rm", [tid], [0.5], replica="evil")[0] == [tid]  # the sitter's own lease still counts
    book = hostile_items(1)
    book.lease("a", "rm", 1, 12.0, now=0.0)
    book.lease("b", "rm", 1, 5.0, now=11.0)                             # shared: a's lease is 11 s old
    assert book.waiting("rm", now=13.0) == 0                            # a's lease ended, b's is live
    assert [t.spec.trajectory_id for t in book.lease("c", "rm", 1, 5.0, now=17.0)] == [tid]
    assert book.counts["lease_expired"] == 1                            # both ended: one expiry
    assert book.submit("rm", [tid], [0.5], replica="a")[0] == []        # c holds it now, alone
