"""Group presence counts only the attempt that is current for an entry. A group requeued (its
first attempt's rollout taken for dead, or its members dropped) runs again as attempt 1; members
of attempt 0 still in the partial pool are not attempt 1's. Before, they counted as present: when
attempt 1's rollout died before its first flush, the manager settled the entry instead of
requeueing it, so the group never completed, its room stayed reserved, and `prompts_skipped`
still read 0. The prompt, partial and buffer pools are the real roles (in-process bus); the
manager's accounting pass is the real Fleet.settle_handed."""
from __future__ import annotations

import asyncio
import json

import numpy as np
import structlog
from laminar.roles.manager.fleet import Fleet, FleetSettings

from laminar.config import parse_config
from laminar.protocol import AppendDeltas, GroupPresence, RequeueGroups, TakeBatch, TokenDelta
from laminar.testing.inproc_cluster import InprocCluster


def cfg(tmp):
    data = tmp / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": str(i)}) + "\n" for i in range(4)))
    return parse_config({"run": {"workdir": str(tmp)}, "cluster": {"keys_dir": None, "broker": {"host": "h0"},
                         "hosts": {"h0": {"address": "127.0.0.1", "roles": [
                             {"role": "prompt_pool", "port": 6101}, {"role": "partial_pool", "port": 6102},
                             {"role": "experience_buffer", "port": 6103}]}}},
                         "roles": {"prompt_pool": {"dataset": str(data), "group_size": 2}}})


def seq0(spec) -> TokenDelta:
    return TokenDelta(spec.trajectory_id, 0, np.array([5], np.int32), np.zeros(1, np.float32), 0, spec=spec)


def test_old_attempt_members_in_flight_do_not_settle_the_new_attempt(tmp_path):
    async def main():
        c = InprocCluster(cfg(tmp_path))
        for r in ("prompt_pool", "partial_pool", "experience_buffer"):
            await c.start(r)
        pp, parts = c.client("prompt_pool"), c.client("partial_pool")
        first = await pp.call(TakeBatch("r0", 2, batch_seq=1))              # attempt 0 of group g, to r0
        g = first.trajectories[0].group_id
        await parts.call(AppendDeltas("r0", [seq0(s) for s in first.trajectories]))  # in flight under r0
        await pp.call(RequeueGroups([g], "r0"))                              # taken for dead: attempt 1 ...
        second = await pp.call(TakeBatch("r1", 2, batch_seq=1))             # ... handed to r1
        assert [t.trajectory_id for t in second.trajectories] == [f"{g}/0~a1", f"{g}/1~a1"]
        t = c.hub.transport()
        fleet = Fleet(t, structlog.get_logger("test"), FleetSettings(), lambda rid: "",
                      c.config.endpoint("partial_pool", "0"), {"0": c.config.endpoint("prompt_pool", "0")},
                      c.config.endpoint("experience_buffer", "0"))
        ok = await fleet.settle_handed("r1", dead=True)                      # r1 died before its first flush
        third = await pp.call(TakeBatch("r2", 2, batch_seq=1))
        old_style = await parts.call(GroupPresence([g]))                     # no attempts named: any member
        fleet.close()
        await c.close()
        return ok, g, fleet.counters, third, old_style
    ok, g, counters, third, old_style = asyncio.run(main())
    assert ok
    assert counters.requeued == 1 and counters.settled == 0
    assert [t.trajectory_id for t in third.trajectories] == [f"{g}/0~a2", f"{g}/1~a2"]   # it runs again
    assert sorted(old_style.present[g]) == [0, 1]
