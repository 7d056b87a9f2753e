"""Dynamic sampling (trainer.filter_groups): a group whose metric has no spread never counts toward
a global batch. The experience buffer drops it (counted per prompt pool, never handed out) up to
the request's cap; the prompt pool's gate counts such drops as groups that will never be trained,
so it hands out replacements and the barrier still holds (a rollout on version v gets only the
replacements of v's window, not groups of the next one)."""
from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import numpy as np
import pytest
from laminar.roles.experience_buffer.state import BufferBook, has_signal

from laminar.config import parse_config
from laminar.protocol import BufferStatsRequest, PutTrajectory, SampleGroups, TakeBatch, Trajectory
from laminar.testing.inproc_cluster import InprocCluster
from laminar.testing.trainer_task import random_groups

pytestmark = pytest.mark.timeout(60)


def groups_with(rewards: list[list[float]], tag: str = "g") -> list:
    gs = random_groups(len(rewards), len(rewards[0]), tag, seed=len(rewards))
    return [[replace(t, reward=r) for t, r in zip(g, rs, strict=True)] for g, rs in zip(gs, rewards, strict=True)]


def book_with(groups) -> BufferBook:
    b = BufferBook(1000)
    for g in groups:
        for t in g:
            assert b.put(t)[0] == "stored"
    return b


def test_filter_groups_metric_and_min_std():
    flat, mixed, partial = groups_with([[1.0, 1.0, 1.0], [0.0, 1.0, 1.0], [0.5, 0.0, 0.0]])
    assert not has_signal(flat, "reward") and has_signal(mixed, "reward")
    assert has_signal(partial, "reward") and not has_signal(partial, "accuracy")  # no answer is correct
    assert has_signal(mixed, "reward", min_std=0.4) and not has_signal(mixed, "reward", min_std=0.5)  # std 0.471
    assert not has_signal(groups_with([[1.0]])[0], "reward")  # one sample: nothing to compare
    with pytest.raises(ValueError, match="reward or accuracy"):
        has_signal(flat, "loss")


def test_filter_groups_buffer_hands_only_informative_groups():
    gs = groups_with([[0.0] * 4, [1.0, 0.0, 0.0, 0.0], [1.0] * 4, [0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 1.0]])
    b = book_with(gs)
    out, _, ch = b.sample(2, 0, metric="reward", max_drop=10)
    assert [g[0].spec.group_id for g in out] == [gs[1][0].spec.group_id, gs[3][0].spec.group_id]  # FIFO order kept
    assert b.last_nosignal == (2, 2 * 4 * 8)  # the two flat groups before them, and their response tokens
    assert sorted(ch.removed_groups) == sorted([(gs[0][0].spec.group_id, "no_signal"),
                                                (gs[1][0].spec.group_id, "handed"),
                                                (gs[2][0].spec.group_id, "no_signal"),
                                                (gs[3][0].spec.group_id, "handed")])
    st = b.stats()
    assert st["dropped_nosignal"] == 2 and st["dropped_nosignal/0"] == 2 and st["handed_out"] == 2
    # without a filter a request is served as before
    assert [g[0].spec.group_id for g in b.sample(5, 0)[0]] == [gs[4][0].spec.group_id]


def test_filter_groups_cap_hands_out_what_is_left():
    gs = groups_with([[0.0] * 4, [1.0] * 4, [0.0] * 4, [1.0, 0.0, 0.0, 0.0]])
    b = book_with(gs)
    out, _, _ = b.sample(2, 0, metric="reward", max_drop=1)
    # one flat group may be dropped; past the cap the next flat one is handed out like any other
    assert [g[0].spec.group_id for g in out] == [gs[1][0].spec.group_id, gs[2][0].spec.group_id]
    assert b.last_nosignal[0] == 1 and b.stats()["dropped_nosignal"] == 1


G = 2


def cfg(tmp, mode):
    data = tmp / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": str(i)}) + "\n" for i in range(64)))
    return parse_config({"run": {"workdir": str(tmp), "name": "ds", "mode": mode},
                         "cluster": {"keys_dir": None, "broker": {"host": "h0"},
                                     "hosts": {"h0": {"address": "127.0.0.1", "roles": [
                                         {"role": "prompt_pool", "port": 6721},
                                         {"role": "experience_buffer", "port": 6722}]}}},
                         "roles": {"prompt_pool": {"dataset": str(data), "group_size": 2, "seed": 0,
                                                   "groups_per_version": G}}})


def done(spec, version: int, reward: float) -> PutTrajectory:
    return PutTrajectory(Trajectory(spec=spec, response_tokens=np.array([5, 6], np.int32),
                                    logprobs=np.zeros(2, np.float32), version=version, rollout_id="r", reward=reward))


@pytest.mark.parametrize("mode", ["sync", "laminar"])
def test_filter_groups_gate_hands_replacements_and_the_barrier_holds(tmp_path, mode):
    async def go():
        c = cfg(tmp_path, mode)
        if mode == "laminar":
            c.roles["prompt_pool"]["max_batches_ahead"] = 0  # flow control: the same window as sync
        cl = InprocCluster(c)
        await cl.start("prompt_pool")
        buf = await cl.start("experience_buffer")
        buf.counts_interval_s = 0.05  # the buffer's counts reach the pool sooner (the test's patience only)
        pp, bc = cl.client("prompt_pool"), cl.client("experience_buffer")
        try:
            w0 = (await pp.call(TakeBatch("r", 64, version=0))).trajectories
            assert len(w0) == 2 * G                                            # version 1's window
            assert (await pp.call(TakeBatch("r", 64, version=0))).trajectories == []  # the gate holds
            for i, s in enumerate(w0):
                await bc.call(done(s, 0, 1.0 if (s.group_id == w0[0].group_id and i == 0) else 0.0))
            got = await bc.call(SampleGroups(G, 0, filter_metric="reward", filter_max_drop=8))
            assert [g[0].spec.group_id for g in got.groups] == [w0[0].group_id]  # the only informative group
            assert got.dropped_nosignal == 1 and got.dropped_nosignal_tokens == 4
            assert (await bc.call(BufferStatsRequest())).counts["dropped_nosignal/0"] == 1
            more = []
            for _ in range(100):  # the pool learns of the drop from the buffer's published counts
                more = (await pp.call(TakeBatch("r", 64, version=0))).trajectories
                if more:
                    break
                await asyncio.sleep(0.05)
            # exactly one replacement, still for version 1's window (the barrier: generated by version 0)
            assert len(more) == 2 and more[0].group_id not in {s.group_id for s in w0}
            assert (await pp.call(TakeBatch("r", 64, version=0))).trajectories == []
        finally:
            await cl.close()
    asyncio.run(go())
