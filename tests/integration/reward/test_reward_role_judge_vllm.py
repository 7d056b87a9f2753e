"""The `judge` backend on a real vLLM CPU engine, through the reward role and the partial pool.

The judge is the tiny random model built here (byte tokenizer, no chat template): what it answers
is noise, which is the point: whatever it says, a trajectory's `judge` component must be exactly
what the parser reads in that answer, or the configured fallback when it reads nothing, and each
fallback must be counted once by the replica (`parse_failures`) and by the pool
(`reward_parse_failed`). Answers are greedy, so asking the same engine again gives the answers
that were scored.
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from laminar.roles.reward.judge import parse  # noqa: E402

from laminar.config import parse_config  # noqa: E402
from laminar.protocol import AwaitReward, SampleGroups, Trajectory, TrajectorySpec  # noqa: E402
from laminar.testing.inproc_cluster import InprocCluster  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(600)]
FALLBACK = -7.0
N = 6


def traj(i: int) -> Trajectory:
    enc = lambda s: np.asarray([b + 3 for b in s.encode()], np.int32)  # noqa: E731  (the byte tokenizer)
    spec = TrajectorySpec(trajectory_id=f"q{i}/0", prompt_id=f"q{i}", group_id=f"q{i}", sample_index=0,
                          group_size=1, prompt_tokens=enc(f"What is {i} + {i}?"), answer=str(2 * i))
    return Trajectory(spec=spec, response_tokens=np.concatenate([enc(f"It is {2 * i + i % 2}."), [2]]).astype(np.int32),
                      logprobs=np.zeros(8, np.float32), version=0, rollout_id="r0", reward=0.0,
                      reward_components={"fn:rule": 0.0})


def test_reward_role_judge_on_a_vllm_cpu_engine_scores_what_it_parses_or_the_counted_fallback(tmp_path, tiny):
    cfg = parse_config({
        "run": {"workdir": str(tmp_path / "run")},
        "cluster": {"keys_dir": None, "shutdown_s": 30, "broker": {"host": "h0"},
                    "hosts": {"h0": {"address": "127.0.0.1", "roles": [
                        {"role": "partial_pool", "port": 7002}, {"role": "experience_buffer", "port": 7003},
                        {"role": "reward", "id": "j0"}]}}},
        "roles": {"reward": {"scorer": "judge", "backend": "judge", "batch_size": N, "lease_s": 300,
                             "judge": {"model_dir": str(tiny), "parser": "number", "fallback": FALLBACK,
                                       "max_tokens": 12, "max_model_len": 512}}}})

    async def go():
        c = InprocCluster(cfg)
        await c.start("partial_pool")
        await c.start("experience_buffer")
        pool, buf = c.client("partial_pool"), c.client("experience_buffer")
        trajs = [traj(i) for i in range(N)]
        for t in trajs:
            await pool.call(AwaitReward("r0", t, {"judge": 1.0}))
        judge = await c.start("reward", "j0")
        got: dict[str, float] = {}
        for _ in range(600):
            for g in (await buf.call(SampleGroups(N, 0))).groups:
                got.update({t.spec.trajectory_id: t.reward_components["judge"] for t in g})
            if len(got) == N:
                break
            await asyncio.sleep(0.1)  # polling the buffer: the pool forwards scored trajectories in the background
        answers = await judge.backend.answers(trajs)          # greedy: the answers that were scored
        counts, status = c.roles["partial_pool.0"].counts(), judge.status()
        await c.close()
        return trajs, got, answers, counts, status

    trajs, got, answers, counts, status = asyncio.run(go())
    assert len(got) == N, got
    expected = {t.spec.trajectory_id: parse(a, "number", {}) for t, a in zip(trajs, answers, strict=True)}
    failed = [k for k, v in expected.items() if v is None]
    assert got == {k: (FALLBACK if v is None else v) for k, v in expected.items()}, (answers, got)
    assert status["parse_failures"] == len(failed) == counts["reward_parse_failed"], (answers, status, counts)
    assert status["scored"] == N and counts["reward_scored"] == N and counts["awaiting_reward"] == 0
