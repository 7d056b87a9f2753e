"""With several prompt pools, each gate subtracts only the stale drops of its own groups: the
buffer counts groups dropped too stale per prompt pool (the pool's group-id prefix), and a pool
reads its own count. Before, every pool subtracted every drop, so with two pools each one handed
out the other's replacements too (more groups in flight than the gate allows)."""
from __future__ import annotations

import numpy as np
from laminar.roles.experience_buffer.state import BufferBook
from laminar.roles.prompt_pool.role import untrained_groups

from laminar.protocol.data import Trajectory, TrajectorySpec, group_id_prefix, pool_of_group


def traj(gid: str, i: int, n: int, version: int) -> Trajectory:
    spec = TrajectorySpec(trajectory_id=f"{gid}/{i}", prompt_id="p", group_id=gid, sample_index=i, group_size=n,
                          prompt_tokens=np.array([1], np.int32))
    return Trajectory(spec=spec, response_tokens=np.array([5], np.int32), logprobs=np.array([-1.0], np.float32),
                      version=version, rollout_id="r", reward=0.0)


def test_group_ids_name_their_prompt_pool():
    for pool in ("0", "1", "math", "p.2"):
        gid = f"{group_id_prefix(pool)}e3-pq1.e2-p7"   # a prompt id with dots (and worse) in it
        assert pool_of_group(gid) == pool, (pool, gid)


def test_the_buffer_counts_stale_drops_per_pool_and_each_pool_subtracts_its_own():
    book = BufferBook(64, max_staleness=1)
    a, b = f"{group_id_prefix('0')}e0-p1", f"{group_id_prefix('1')}e0-p2"
    for gid in (a, b):
        for i in range(2):
            book.put(traj(gid, i, 2, 0))
    incomplete = f"{group_id_prefix('1')}e0-p3"
    book.put(traj(incomplete, 0, 2, 0))
    book.sample(4, 5)                      # version 5: all three are too stale
    counts = dict(book.counts)
    assert counts["dropped_stale"] == 2 and counts["dropped_stale_incomplete"] == 1
    assert counts["dropped_stale/0"] == 1 and counts["dropped_stale/1"] == 2
    assert untrained_groups(counts, "0") == 1 and untrained_groups(counts, "1") == 2
    # a buffer from before the per-pool counts: its totals (one pool then)
    assert untrained_groups({"dropped_stale": 4, "dropped_stale_incomplete": 1}, "0") == 5
