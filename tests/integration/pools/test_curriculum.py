"""The prompt pool's difficulty curriculum over the in-process bus: prompts solved by every sample
in their last `window` appearances are retired, prompts never solved are visited less often
(deterministically, from the pool's seed), the state survives a pool restart, it is off by
default, and the experience buffer reports each completed group's results to the pool."""
from __future__ import annotations

import asyncio
import json
from collections import Counter

import numpy as np
import pytest
from laminar.bus.errors import Refused

from laminar.config import parse_config
from laminar.protocol import GroupResults, PutTrajectory, RequeueGroups, TakeBatch, Trajectory
from laminar.remote import status_lines
from laminar.summary import summarize
from laminar.testing.inproc_cluster import InprocCluster

pytestmark = pytest.mark.timeout(60)
N_PROMPTS, N = 6, 2


def cfg(tmp, curriculum: dict | None, buffer: bool = False):
    tmp.mkdir(parents=True, exist_ok=True)
    data = tmp / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": str(i)}) + "\n" for i in range(N_PROMPTS)))
    roles = [{"role": "prompt_pool", "port": 6731}] + ([{"role": "experience_buffer", "port": 6732}] if buffer else [])
    pool = {"dataset": str(data), "group_size": N, "seed": 3}
    if curriculum is not None:
        pool["curriculum"] = curriculum
    return parse_config({"run": {"workdir": str(tmp), "name": "cur"},
                         "cluster": {"keys_dir": None, "broker": {"host": "h0"},
                                     "hosts": {"h0": {"address": "127.0.0.1", "roles": roles}}},
                         "roles": {"prompt_pool": pool}})


async def take(pp, groups: int) -> list[str]:
    """`groups` group ids, one TakeBatch each (so each call's cursor move is one group)."""
    out = []
    for _ in range(groups):
        b = await pp.call(TakeBatch("r", N))
        out.append(b.trajectories[0].group_id)
    return out


def prompt_of(gid: str) -> str:
    return gid.partition("-p")[2]


async def report(pp, gids: list[str], solved: int) -> None:
    await pp.call(GroupResults(gids, [solved] * len(gids), [N] * len(gids)))


def test_curriculum_retires_prompts_solved_in_their_last_k_appearances(tmp_path):
    async def go():
        cl = InprocCluster(cfg(tmp_path, {"window": 2}))
        pool = await cl.start("prompt_pool")
        pp = cl.client("prompt_pool")
        first = await take(pp, N_PROMPTS)  # epoch 0
        easy = first[0]
        await report(pp, [easy], N)
        assert pool.counts()["curriculum_retired"] == 0   # one appearance of two
        second = await take(pp, N_PROMPTS)  # epoch 1: the easy prompt still comes
        again = next(g for g in second if prompt_of(g) == prompt_of(easy))
        await report(pp, [again], N)
        assert pool.counts()["curriculum_retired"] == 1
        later = await take(pp, 4 * (N_PROMPTS - 1))
        assert prompt_of(easy) not in {prompt_of(g) for g in later}
        assert pool.counts()["curriculum_skipped"] >= 4  # passed over once per epoch
        await cl.close()
    asyncio.run(go())


def unsolved_run(tmp, seed_reports: bool = True) -> tuple[list[str], dict]:
    async def go():
        cl = InprocCluster(cfg(tmp, {"window": 2, "unsolved_weight": 0.25}))
        pool = await cl.start("prompt_pool")
        pp = cl.client("prompt_pool")
        first = await take(pp, 2 * N_PROMPTS)  # epochs 0 and 1
        hard = prompt_of(first[0])
        await report(pp, [g for g in first if prompt_of(g) == hard], 0)
        later = await take(pp, 8 * (N_PROMPTS - 1))
        counts = pool.counts()
        await cl.close()
        return later, {"hard": hard, **counts}
    return asyncio.run(go())


def test_curriculum_visits_unsolved_prompts_less_often_deterministically(tmp_path):
    later, c = unsolved_run(tmp_path / "a")
    per = Counter(prompt_of(g) for g in later)
    others = [v for p, v in per.items() if p != c["hard"]]
    assert 1 <= per[c["hard"]] <= 3 and min(others) >= 7  # about 1 epoch in 4, and every epoch
    assert c["curriculum_unsolved"] == 1 and c["curriculum_retired"] == 0
    assert c["curriculum_pass_rate_mean"] == 0.0
    again, _ = unsolved_run(tmp_path / "b")
    assert again == later  # the same seed: the same visits


def test_curriculum_state_survives_a_pool_restart(tmp_path):
    async def go():
        cl = InprocCluster(cfg(tmp_path, {"window": 1, "unsolved_weight": 0.5}))
        await cl.start("prompt_pool")
        pp = cl.client("prompt_pool")
        first = await take(pp, N_PROMPTS)
        await report(pp, [first[0]], N)   # retired (window 1)
        await report(pp, [first[1]], 0)   # unsolved
        await report(pp, [first[2]], 1)   # half
        await cl.stop("prompt_pool")
        pool = await cl.start("prompt_pool")
        c = pool.counts()
        assert (c["curriculum_retired"], c["curriculum_unsolved"], c["curriculum_results"]) == (1, 1, 3)
        assert c["curriculum_pass_rate_mean"] == pytest.approx(0.5)
        await report(pp, [first[0], first[2]], N)   # a resent result changes nothing (idempotent by group)
        assert pool.counts()["curriculum_results"] == 3
        (line,) = status_lines({"prompt_pool.0": {"metrics": {}, "status": pool.status()}})
        assert "curriculum retired 1  down-weighted 1 (never solved 1)  pass rate mean 0.5" in line
        later = await take(pp, 3 * N_PROMPTS)
        assert prompt_of(first[0]) not in {prompt_of(g) for g in later}
        await cl.close()
    asyncio.run(go())
    got = summarize(tmp_path)["curriculum"]["0"]  # the pool's last counts, written at its stop
    assert (got["curriculum_retired"], got["curriculum_unsolved"], got["curriculum_results"]) == (1, 1, 3)


def test_curriculum_off_by_default_changes_nothing(tmp_path):
    async def go(tmp, with_results: bool):
        cl = InprocCluster(cfg(tmp, None))
        pool = await cl.start("prompt_pool")
        pp = cl.client("prompt_pool")
        first = await take(pp, N_PROMPTS)
        if with_results:
            await report(pp, first, N)
        later = await take(pp, 2 * N_PROMPTS)
        counts = pool.counts()
        await cl.close()
        return first + later, counts
    plain, counts = asyncio.run(go(tmp_path / "a", False))
    reported, _ = asyncio.run(go(tmp_path / "b", True))
    assert plain == reported
    assert not any(k.startswith("curriculum") for k in counts)


def test_curriculum_buffer_reports_completed_groups_to_the_pool(tmp_path):
    async def go():
        cl = InprocCluster(cfg(tmp_path, {"window": 1}, buffer=True))
        pool, buf = await put_two_groups(cl)
        for _ in range(200):
            if pool.counts()["curriculum_results"] == 2 and not buf.results_pending():
                break
            await asyncio.sleep(0.05)  # the buffer's sender loop runs on its own period
        c = pool.counts()
        assert c["curriculum_results"] == 2 and c["curriculum_retired"] == 1
        assert c["curriculum_pass_rate_mean"] == pytest.approx((1.0 + 0.5) / 2)
        await cl.close()
    asyncio.run(go())


def test_curriculum_off_the_buffer_records_no_results(tmp_path):
    async def go():
        cl = InprocCluster(cfg(tmp_path, None, buffer=True))
        _, buf = await put_two_groups(cl)
        pending = buf.results_pending()
        rows = buf.store.read("SELECT count(*) FROM results")[0][0]
        await cl.close()
        return pending, rows
    assert asyncio.run(go()) == ({}, 0)


async def put_two_groups(cl):
    """Start the pool and the buffer, take two groups, put them complete: one all solved, one half."""
    pool = await cl.start("prompt_pool")
    buf = await cl.start("experience_buffer")
    pp, bc = cl.client("prompt_pool"), cl.client("experience_buffer")
    batch = await pp.call(TakeBatch("r", 2 * N))
    rewards = [1.0, 1.0, 1.0, 0.0]  # group 0 all solved, group 1 half
    for spec, r in zip(batch.trajectories, rewards, strict=True):
        t = Trajectory(spec=spec, response_tokens=np.array([5], np.int32), logprobs=np.zeros(1, np.float32),
                       version=0, rollout_id="r", reward=r)
        assert (await bc.call(PutTrajectory(t))).status == "stored"
    return pool, buf


def test_curriculum_down_weights_solved_prompts_when_not_retiring_and_refuses_bad_results(tmp_path):
    async def go():
        cl = InprocCluster(cfg(tmp_path, {"window": 1, "retire_solved": False, "solved_weight": 0.5}))
        pool = await cl.start("prompt_pool")
        pp = cl.client("prompt_pool")
        first = await take(pp, N_PROMPTS)
        easy = prompt_of(first[0])
        ack = await pp.call(GroupResults([first[0], "e0-pnope", f"{first[1]}/0", first[2]], [N, 0, 0, N + 1],
                                         [N] * 4))
        assert ack.detail == "recorded 1, already known 0, refused 3"  # unknown id, a member id, solved > size
        c = pool.counts()
        assert (c["curriculum_retired"], c["curriculum_downweighted"]) == (0, 1)
        later = await take(pp, 6 * (N_PROMPTS - 1))
        assert 2 <= sum(prompt_of(g) == easy for g in later) <= 4  # one epoch in two, of about 7
        skipped = [g for g in pool.curriculum.skips if prompt_of(g) == easy]
        assert skipped and not set(skipped) & set(later)
        with pytest.raises(Refused):  # the cursor passed it over, never handed it out: no requeue of it
            await pp.call(RequeueGroups([skipped[-1]]))
        await cl.close()
    asyncio.run(go())
