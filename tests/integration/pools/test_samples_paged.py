"""The Samples reply is paged: a trainer asking for 1,024 groups of 16 (16,384 trajectories, more
than the codec's 65,536 frames in one message) gets them over several replies, each within the
buffer's `page_trajectories`, and the cursor counts every group once. Before, the buffer answered
all of them in one message, the codec refused it, and the trainer asked for the same batch
forever. The experience buffer is the real role on the in-process bus (which encodes and decodes
every message with the real codec and its frame limit)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from laminar.config import parse_config
from laminar.protocol import PutTrajectory, SampleGroups, Trajectory, TrajectorySpec
from laminar.testing.inproc_cluster import InprocCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]  # 16,384 puts: ~1.5 min on 2 shared cores

GROUPS, N = 1024, 16  # with a loss mask: 4 arrays a trajectory, 65,538 frames in one Samples


def traj(g: int, i: int) -> Trajectory:
    spec = TrajectorySpec(trajectory_id=f"e0-p{g}/{i}", prompt_id=str(g), group_id=f"e0-p{g}", sample_index=i,
                          group_size=N, prompt_tokens=np.array([1, 2], np.int32))
    return Trajectory(spec=spec, response_tokens=np.array([5, 6], np.int32), logprobs=np.zeros(2, np.float32),
                      version=0, rollout_id="r", reward=float(i % 2), loss_mask=np.ones(2, np.uint8))


def test_a_batch_beyond_one_message_arrives_in_pages(tmp_path):
    cfg = parse_config({"run": {"workdir": str(tmp_path)}, "cluster": {"keys_dir": None, "broker": {"host": "h0"},
                        "hosts": {"h0": {"address": "127.0.0.1", "roles": [
                            {"role": "experience_buffer", "port": 6103}]}}},
                        "roles": {"experience_buffer": {"capacity": GROUPS * N}}})

    async def main():
        c = InprocCluster(cfg)
        await c.start("experience_buffer")
        buf = c.client("experience_buffer")
        all_puts = [PutTrajectory(traj(g, i)) for g in range(GROUPS) for i in range(N)]
        for k in range(0, len(all_puts), 250):
            await asyncio.gather(*(buf.call(p, timeout=60) for p in all_puts[k:k + 250]))
        got, cursor, replies = [], 0, 0
        while len(got) < GROUPS and replies < 64:   # the trainer's loop: ask for what is still missing
            s = await buf.call(SampleGroups(GROUPS - len(got), 1, cursor=cursor, committed=0), timeout=60)
            replies += 1
            got += s.groups
            cursor = s.cursor
        await c.close()
        return got, cursor, replies
    got, cursor, replies = asyncio.run(main())
    assert len(got) == GROUPS and cursor == GROUPS and 1 < replies < 64
    assert len({g[0].spec.group_id for g in got}) == GROUPS and all(len(g) == N for g in got)
