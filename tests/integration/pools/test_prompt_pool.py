"""Prompt pool semantics over the in-process bus: whole groups, idempotent TakeBatch, requeue,
epochs, ids unique across pools, cursor kept across a restart."""
from __future__ import annotations

import asyncio
import json

import pytest
from laminar.bus.errors import Refused

from laminar.config import parse_config
from laminar.protocol import RequeueGroups, TakeBatch
from laminar.testing.inproc_cluster import InprocCluster


def cfg(tmp, n=5):
    data = tmp / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": str(i)}) + "\n" for i in range(n)))
    return parse_config({"run": {"workdir": str(tmp)}, "cluster": {"keys_dir": None, "broker": {"host": "h0"},
                         "hosts": {"h0": {"address": "127.0.0.1", "roles": [
                             {"role": "prompt_pool", "port": 6101},
                             {"role": "prompt_pool", "id": "b", "port": 6102}]}}},
                         "roles": {"prompt_pool": {"dataset": str(data), "group_size": 3, "max_epochs": 2}}})


def test_prompt_pool_semantics(tmp_path):
    async def main():
        c = InprocCluster(cfg(tmp_path))
        await c.start("prompt_pool")
        await c.start("prompt_pool", "b")
        pp = c.client("prompt_pool")
        b1 = await pp.call(TakeBatch("r", 7, batch_seq=1))
        assert len(b1.trajectories) == 6  # floor(7 / 3) whole groups
        assert [t.sample_index for t in b1.trajectories] == [0, 1, 2, 0, 1, 2]
        again = await pp.call(TakeBatch("r", 7, batch_seq=1))  # lost reply: the same batch
        assert [t.trajectory_id for t in again.trajectories] == [t.trajectory_id for t in b1.trajectories]
        one = await pp.call(TakeBatch("r", 1, batch_seq=2))  # fewer than n: one whole group anyway
        assert len(one.trajectories) == 3
        other = await c.client("prompt_pool", "b").call(TakeBatch("r", 3))
        assert other.trajectories[0].group_id.startswith("b.e0-")
        with pytest.raises(Refused):
            await pp.call(RequeueGroups(["b.e0-p0"]))
        await pp.call(RequeueGroups([b1.trajectories[0].group_id]))
        await c.stop("prompt_pool")
        await c.start("prompt_pool")
        rest = []
        while True:
            b = await pp.call(TakeBatch("r", 30))
            rest += b.trajectories
            if b.exhausted:
                break
        groups = [t.group_id for t in rest[::3]]
        assert groups[0] == b1.trajectories[0].group_id      # requeued first, after the restart
        handed = {t.group_id for t in b1.trajectories + one.trajectories}
        assert len(groups) == 10 - 3 + 1 and len(set(groups[1:]) & handed) == 0
        await c.close()
    asyncio.run(main())


def gated_pool(tmp_path, mode: str, ahead: int | None = None) -> InprocCluster:
    c = cfg(tmp_path, n=20)
    return InprocCluster(
        parse_config(
            {
                **c.model_dump(exclude={"source"}),
                "run": {"workdir": str(tmp_path), "mode": mode},
                "roles": {
                    "prompt_pool": {**c.roles["prompt_pool"], "groups_per_version": 2, "max_batches_ahead": ahead}
                },
            }
        )
    )


@pytest.mark.parametrize("mode,lag,ahead", [("sync", 0, None), ("one_step", 1, None), ("laminar", None, None),
                                            ("laminar", 1, 1), ("laminar_norepack", 0, 0)])
def test_barrier_modes_gate_batches_by_version(tmp_path, mode, lag, ahead):
    """sync: a rollout holding version v gets only global batch v's groups; one_step one more
    batch ahead; laminar no gate, unless max_batches_ahead bounds it the same way (flow control).
    Two groups per version (the pool's groups_per_version)."""
    async def main():
        cl = gated_pool(tmp_path, mode, ahead)
        await cl.start("prompt_pool")
        pp = cl.client("prompt_pool")
        got = []
        for _ in range(6):  # a rollout at version 0 asks for one group at a time
            b = await pp.call(TakeBatch("r", 3, version=0))
            got.append(len(b.trajectories) // 3)
        expect = {0: [1, 1, 0, 0, 0, 0], 1: [1, 1, 1, 1, 0, 0], None: [1, 1, 1, 1, 1, 1]}[lag]
        assert got == expect
        if lag == 0:
            b = await pp.call(TakeBatch("r", 30, version=1))  # the next version: batch 1, exactly
            assert len(b.trajectories) == 2 * 3
            assert not (await pp.call(TakeBatch("r", 3, version=1))).trajectories
        await cl.close()
    asyncio.run(main())


def test_requeued_groups_pass_a_closed_gate_and_do_not_count(tmp_path):
    """Work lost with a rollout belongs to a batch already counted (the trainer may be waiting for
    it): once requeued it is handed out even when the gate is closed, and it does not use up the
    fresh groups the next version may have."""
    async def main():
        cl = gated_pool(tmp_path, "sync")
        await cl.start("prompt_pool")
        pp = cl.client("prompt_pool")
        b = await pp.call(TakeBatch("r", 6, version=0))            # batch 0: both groups
        gids = sorted({s.group_id for s in b.trajectories})
        assert len(gids) == 2 and not (await pp.call(TakeBatch("r", 3, version=0))).trajectories
        await pp.call(RequeueGroups([gids[0]]))                       # its rollout died
        again = await pp.call(TakeBatch("r2", 6, version=0))
        assert {s.group_id for s in again.trajectories} == {gids[0]}
        nxt = await pp.call(TakeBatch("r2", 30, version=1))  # batch 1: two fresh groups, exactly
        assert len({s.group_id for s in nxt.trajectories}) == 2 and not set(gids) & {
            s.group_id for s in nxt.trajectories
        }
        await cl.close()
    asyncio.run(main())
