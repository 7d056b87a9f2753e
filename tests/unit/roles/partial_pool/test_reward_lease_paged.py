"""A lease's reply is one bounded page. Before, LeaseRewards handed out as many items as asked: a
trajectory is three or more arrays, one bus frame each, so a RewardWork of more than 21,845 items
passed the codec's 65,536 frames and could not be encoded (the replica got an error, every time),
and the reward role's config accepted such a batch size. The real partial pool, its awaiting book
filled directly (what 30,000 AwaitReward calls would leave), asked over the real codec."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
from laminar.bus.codec import MAX_FRAMES
from pydantic import ValidationError

from laminar.config import parse_config
from laminar.protocol import LeaseRewards
from laminar.testing import hostile
from laminar.testing.inproc_cluster import InprocCluster

pytestmark = pytest.mark.timeout(120)
ITEMS = 30_000


def test_reward_work_is_paged_below_the_frame_limit(tmp_path):
    cfg = parse_config({"run": {"workdir": str(tmp_path)},
                        "cluster": {"keys_dir": None, "broker": {"host": "h0"},
                                    "hosts": {"h0": {"address": "127.0.0.1",
                                                     "roles": [{"role": "partial_pool", "port": 6901}]}}}})

    async def go():
        c = InprocCluster(cfg)
        pool = await c.start("partial_pool")
        toks = np.array([1, 2, 3], np.int32)
        for i in range(ITEMS):
            t = hostile.trajectory(hostile.forged_spec(i, 0, 1, prompt_tokens=toks), "r0", 0.0)
            pool.awaiting.add(t, {"rm": 1.0})
        pages, got = 0, 0
        while got < ITEMS and pages < 64:
            work = await c.client("partial_pool").call(LeaseRewards("rm1", "rm", ITEMS, 60.0), timeout=60)
            assert 0 < len(work.trajectories) <= 8192
            got, pages = got + len(work.trajectories), pages + 1
        await c.close()
        return got, pages
    got, pages = asyncio.run(go())
    assert got == ITEMS and pages > 1
    assert 3 * 8192 < MAX_FRAMES


def test_the_reward_role_refuses_a_batch_no_reply_could_carry():
    from laminar.roles.reward.config import RewardRoleConfig
    with pytest.raises(ValidationError, match="batch_size"):
        RewardRoleConfig.model_validate({"backend": "http", "http": {"url": "http://x"}, "batch_size": 30_000})
