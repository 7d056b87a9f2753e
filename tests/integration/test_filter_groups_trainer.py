"""Dynamic sampling end to end in the trainer (a real TrainerRole and ExperienceBufferRole in one
process, the tiny model): a version is a batch of informative groups; flat groups are dropped and
counted in the version's metrics, and past `max_dropped` the version trains on what comes next."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from laminar.roles.trainer.metrics import read_jsonl  # noqa: E402

from laminar.config import parse_config  # noqa: E402
from laminar.protocol import PutTrajectory  # noqa: E402
from laminar.summary import summarize  # noqa: E402
from laminar.testing.inproc_cluster import InprocCluster  # noqa: E402
from laminar.testing.trainer_task import random_groups  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def groups_with(rewards: list[list[float]], tag: str) -> list:
    gs = random_groups(len(rewards), len(rewards[0]), tag, seed=len(tag))
    return [[replace(t, reward=r) for t, r in zip(g, rs, strict=True)] for g, rs in zip(gs, rewards, strict=True)]


async def until(pred, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise TimeoutError(what)
        await asyncio.sleep(0.01)


def test_filter_groups_trainer_waits_for_informative_groups_and_counts_them(tmp_path: Path, tiny):
    cfg = parse_config({
        "run": {"workdir": str(tmp_path / "run"), "seed": 0},
        "cluster": {"keys_dir": None, "heartbeat_s": 0.5, "broker": {"host": "h0"},
                    "hosts": {"h0": {"address": "127.0.0.1", "roles": [
                        {"role": "experience_buffer", "port": 7131}, {"role": "trainer"}]}}},
        "roles": {"trainer": {"model_dir": str(tiny), "lr": 1e-3, "groups_per_batch": 2, "publish": False,
                              "checkpoint_every": 100, "sample_wait_s": 0.02, "log_samples_every": 2,
                              "log_samples": 3,
                              "filter_groups": {"metric": "reward", "max_dropped": 2}}}})

    async def go():
        cl = InprocCluster(cfg)
        try:
            await cl.start("experience_buffer")
            trainer = await cl.start("trainer")
            buf = cl.client("experience_buffer")

            async def put(groups):
                for g in groups:
                    for t in g:
                        assert (await buf.call(PutTrajectory(t))).status == "stored"
            # version 1: a flat group and an informative one -> the trainer waits for a second one
            await put(groups_with([[0.0] * 4, [1.0, 0.0, 0.0, 1.0]], "a"))
            await asyncio.sleep(0.3)
            assert trainer.version == 0  # one informative group is not a batch
            await put(groups_with([[0.0, 1.0, 0.0, 0.0]], "b"))
            await until(lambda: trainer.version == 1, 60, "version 1")
            # version 2: the cap (2 drops) is spent on two flat groups; the third flat one is trained on
            await put(groups_with([[0.0] * 4, [1.0] * 4, [0.0] * 4, [1.0, 1.0, 0.0, 1.0]], "c"))
            await until(lambda: trainer.version == 2, 60, "version 2")
            # version 3: flat groups only, the cap reached at once: a version without a step
            await put(groups_with([[0.0] * 4, [1.0] * 4, [0.0] * 4, [1.0] * 4], "d"))
            await until(lambda: trainer.version == 3, 60, "version 3")
        finally:
            await cl.close()
    asyncio.run(go())
    recs = read_jsonl(tmp_path / "run" / "trainer" / "metrics.jsonl")
    got = [(r["groups_generated"], r["groups_kept"], r["groups_dropped_nosignal"], r["filter_cap_reached"],
            r["no_signal_steps"]) for r in recs]
    assert got == [(3.0, 2.0, 1.0, 0.0, 0.0), (4.0, 1.0, 2.0, 1.0, 0.0), (4.0, 0.0, 2.0, 1.0, 1.0)]
    assert recs[0]["nosignal_tokens"] == 4 * 8
    s = summarize(tmp_path / "run")
    assert (s["groups_generated"], s["groups_kept"], s["versions_without_step"]) == (11, 3, 1)
    assert s["groups_dropped_nosignal"] == 5 and s["filter_cap_versions"] == 2
    # samples: version 2's batch (every 2 versions; made by version 0, trained by 1), groups in turn
    rows = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [(r["source"], r["version"], r["staleness"]) for r in rows] == [("trainer", 2, 1)] * 3
    assert [r["prompt_id"] for r in rows] == [rows[0]["prompt_id"], rows[1]["prompt_id"], rows[0]["prompt_id"]]
    assert all(isinstance(r["prompt"], str) and isinstance(r["response"], str) for r in rows)
