"""A requeued group runs again under new trajectory ids (an attempt number), so the partial pool,
which refuses deltas for ids it completed, takes the re-generated members.

The case: a group's members were generated, completed in the partial pool and stored in the
buffer; the buffer then drops the group (its weights were on a lineage a restarted trainer
discarded) and requeues its prompt. Its new members must get through the partial pool."""
from __future__ import annotations

import asyncio
import json

import numpy as np

from laminar.config import parse_config
from laminar.protocol import AppendDeltas, CompletePartial, RequeueGroups, TakeBatch, TokenDelta
from laminar.testing.inproc_cluster import InprocCluster


def cfg(tmp):
    data = tmp / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": str(i)}) + "\n" for i in range(4)))
    return parse_config({"run": {"workdir": str(tmp)}, "cluster": {"keys_dir": None, "broker": {"host": "h0"},
                         "hosts": {"h0": {"address": "127.0.0.1", "roles": [
                             {"role": "prompt_pool", "port": 6131}, {"role": "partial_pool", "port": 6132}]}}},
                         "roles": {"prompt_pool": {"dataset": str(data), "group_size": 3}}})


def seq0(spec) -> TokenDelta:
    return TokenDelta(spec.trajectory_id, 0, np.array([7, 8], np.int32), np.zeros(2, np.float32), 0, spec)


def test_a_requeued_group_gets_new_trajectory_ids_the_partial_pool_takes(tmp_path):
    async def main():
        cl = InprocCluster(cfg(tmp_path))
        await cl.start("prompt_pool")
        await cl.start("partial_pool")
        pp, part = cl.client("prompt_pool"), cl.client("partial_pool")
        first = (await pp.call(TakeBatch("r", 3, batch_seq=1))).trajectories
        gid = first[0].group_id
        res = await part.call(AppendDeltas("r", [seq0(s) for s in first]))
        assert res.applied == 3
        await part.call(CompletePartial([s.trajectory_id for s in first]))  # stored in the buffer
        await pp.call(RequeueGroups([gid]))                                 # ... which dropped it off-lineage
        second = (await pp.call(TakeBatch("r2", 3, batch_seq=1))).trajectories
        assert [(s.group_id, s.sample_index) for s in second] == [(gid, i) for i in range(3)]
        assert not {s.trajectory_id for s in second} & {s.trajectory_id for s in first}
        res = await part.call(AppendDeltas("r2", [seq0(s) for s in second]))
        assert res.applied == 3 and not res.rejected, res
        # a lost reply's retry gets this attempt's ids again, also after a restart of the pool
        await cl.stop("prompt_pool")
        await cl.start("prompt_pool")
        again = (await pp.call(TakeBatch("r2", 3, batch_seq=1))).trajectories
        assert [s.trajectory_id for s in again] == [s.trajectory_id for s in second]
        # one member requeued alone (the others got through): a third attempt, new ids again
        await part.call(CompletePartial([s.trajectory_id for s in second]))
        await pp.call(RequeueGroups([f"{gid}/1"]))
        third = (await pp.call(TakeBatch("r3", 3))).trajectories
        assert [(s.group_id, s.sample_index) for s in third if s.group_id == gid] == [(gid, 1)]
        member = next(s for s in third if s.group_id == gid)
        assert member.trajectory_id not in {s.trajectory_id for s in first + second}
        res = await part.call(AppendDeltas("r3", [seq0(member)]))
        assert res.applied == 1 and not res.rejected, res
        await cl.close()
    asyncio.run(main())
