"""A pool's store knows the run and the settings it was made with: restarted with another seed or
dataset it refuses to serve, naming both (instead of repeating and skipping prompts, or failing on
every request), and a smaller buffer capacity is carried out on disk, not only in memory."""
from __future__ import annotations

import asyncio
import json
import sqlite3

import numpy as np
import pytest
from laminar.bus.errors import RemoteError

from laminar.config import parse_config
from laminar.protocol import PutTrajectory, TakeBatch, Trajectory, TrajectorySpec
from laminar.testing.inproc_cluster import InprocCluster

pytestmark = pytest.mark.timeout(60)


def cfg(tmp, n=5, seed=0, capacity=100, run="week"):
    data = tmp / f"d{n}.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": str(i)}) + "\n" for i in range(n)))
    return parse_config({"run": {"workdir": str(tmp), "name": run},
                         "cluster": {"keys_dir": None, "broker": {"host": "h0"},
                                     "hosts": {"h0": {"address": "127.0.0.1", "roles": [
                                         {"role": "prompt_pool", "port": 6301},
                                         {"role": "experience_buffer", "port": 6302}]}}},
                         "roles": {"prompt_pool": {"dataset": str(data), "group_size": 2, "seed": seed},
                                   "experience_buffer": {"capacity": capacity}}})


async def take_after_restart(tmp_path, first, second):
    cl = InprocCluster(first)
    await cl.start("prompt_pool")
    await cl.client("prompt_pool").call(TakeBatch("r", 4))
    await cl.close()
    cl = InprocCluster(second)
    pool = await cl.start("prompt_pool")
    try:
        with pytest.raises(RemoteError) as err:
            await cl.client("prompt_pool").call(TakeBatch("r", 4))
        return err.value, pool.status()
    finally:
        await cl.close()


@pytest.mark.parametrize("change,old,new", [("seed", 0, 7), ("prompts", 5, 3), ("run", "week", "other")])
def test_a_pool_restarted_with_other_settings_refuses_naming_both(tmp_path, change, old, new):
    kw = {"seed": "seed", "prompts": "n", "run": "run"}[change]
    err, status = asyncio.run(take_after_restart(tmp_path, cfg(tmp_path, **{kw: old}), cfg(tmp_path, **{kw: new})))
    assert err.code == "unavailable"
    msg = str(err)
    assert change in msg and repr(old) in msg and repr(new) in msg
    assert status["serving"] is False and change in status["fault"]


def traj(g: int, i: int) -> Trajectory:
    spec = TrajectorySpec(trajectory_id=f"g{g}/{i}", prompt_id=str(g), group_id=f"g{g}", sample_index=i,
                          group_size=2, prompt_tokens=np.array([1], np.int32))
    return Trajectory(spec=spec, response_tokens=np.array([5], np.int32), logprobs=np.zeros(1, np.float32),
                      version=0, rollout_id="r", reward=0.0)


def test_a_smaller_buffer_capacity_is_applied_on_disk(tmp_path):
    async def go():
        cl = InprocCluster(cfg(tmp_path, capacity=10))
        await cl.start("experience_buffer")
        for g in range(4):
            for i in range(2):
                assert (await cl.client("experience_buffer").call(PutTrajectory(traj(g, i)))).status == "stored"
        await cl.close()
        cl = InprocCluster(cfg(tmp_path, capacity=4))
        buf = await cl.start("experience_buffer")
        counts = buf.status()
        await cl.close()
        return counts
    counts = asyncio.run(go())
    assert counts["serving"] is True and counts["stored"] == 4 and counts["evicted"] == 2
    db = tmp_path / "pools" / "experience_buffer-0.sqlite"
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT count(*) FROM trajs").fetchone()[0] == 4   # oldest groups gone on disk too
