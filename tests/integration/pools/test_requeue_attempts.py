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


def test_attempts_are_kept_only_while_open_and_ids_are_never_reused(tmp_path):
    """Before: every requeued entry (a group, or a member alone) kept its row in `attempts` for
    good, since a settled group may be requeued again later and its next attempt was 1 + the
    largest of its group's rows: the table grew with every group ever requeued. Now attempt numbers
    come from one durable counter (larger than any given before), so a row is needed only while its
    entry is open (handed out or waiting to be): it goes when the entry settles. Ids are still never
    reused, across restarts too, and a settled group requeued later gets new ones."""
    async def main():
        cl = InprocCluster(cfg(tmp_path))
        role = await cl.start("prompt_pool")
        pp = cl.client("prompt_pool")
        seen: list[str] = []

        def rows(role) -> int:
            return role.store.read("SELECT count(*) FROM attempts")[0][0]

        async def cycle(rollout: str, gid: str | None = None, member: int | None = None) -> str:
            """Hand a group out, lose it with its rollout (requeue), hand it out again, settle it."""
            if gid is None:
                got = (await pp.call(TakeBatch(rollout, 3))).trajectories
                seen.extend(t.trajectory_id for t in got)
                gid = got[0].group_id
            entry = gid if member is None else f"{gid}/{member}"
            await pp.call(RequeueGroups([entry], rollout))
            again = (await pp.call(TakeBatch(rollout + "b", 3))).trajectories
            assert again[0].group_id == gid  # first; a member alone is topped up with a fresh group
            seen.extend(t.trajectory_id for t in again)
            fresh = sorted({t.group_id for t in again} - {gid})
            await pp.call(RequeueGroups([], rollout + "b", settled=[entry, *fresh]))
            return gid

        groups = [await cycle(f"r{i}") for i in range(4)]          # four groups, each requeued once
        assert rows(role) == 0                                      # before: 4
        await cl.stop("prompt_pool")
        role = await cl.start("prompt_pool")
        for i, g in enumerate(groups):                              # settled groups requeued later
            await cycle(f"s{i}", g)
            await cycle(f"m{i}", g, member=1)                       # and one member alone
        assert rows(role) == 0                                      # before: 8
        await cl.stop("prompt_pool")
        role = await cl.start("prompt_pool")
        await cycle("t", groups[0])                                 # after a restart: new ids again
        await pp.call(RequeueGroups([groups[1]], "nobody"))         # open: its row stays until it settles
        assert rows(role) == 1
        assert len(seen) == len(set(seen)), sorted(t for t in seen if seen.count(t) > 1)
        await cl.close()
    asyncio.run(main())


def test_a_v4_store_is_migrated_its_counter_above_every_attempt_given(tmp_path):
    """A store from before the counter (v4): its rows for settled entries go, and the counter starts
    above the largest attempt they held, so a settled group requeued after the upgrade gets ids
    none of its earlier attempts had."""
    import sqlite3

    async def main():
        cl = InprocCluster(cfg(tmp_path))
        role = await cl.start("prompt_pool")
        pp = cl.client("prompt_pool")
        got = (await pp.call(TakeBatch("r", 3))).trajectories
        gid = got[0].group_id
        await pp.call(RequeueGroups([], "r", settled=[gid]))
        path = role.store_path()
        await cl.stop("prompt_pool")
        with sqlite3.connect(path) as con:  # as v4 left it: rows of settled entries, no counter
            con.executemany("INSERT INTO attempts VALUES (?, ?)", [(gid, 6), (f"{gid}/2", 7)])
            con.execute("DELETE FROM accounting WHERE k = 'attempt_seq'")
            con.execute("PRAGMA user_version = 4")
        role = await cl.start("prompt_pool")
        assert role.store.read("SELECT count(*) FROM attempts")[0][0] == 0
        await pp.call(RequeueGroups([gid], "buffer"))
        again = (await pp.call(TakeBatch("r2", 3))).trajectories
        assert [t.trajectory_id for t in again] == [f"{gid}/{i}~a8" for i in range(3)]
        await cl.close()
    asyncio.run(main())
