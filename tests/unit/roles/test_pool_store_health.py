"""A store outlives protocol versions and its own schema versions, and a damaged store neither
stalls its pool nor loops it through restarts: corruption is found at open and the readable rows
are rebuilt into a fresh file (the damaged one kept aside, named in the report), an undecodable
record is quarantined, and a pool that cannot serve says so in its status and in every reply."""
from __future__ import annotations

import asyncio
import dataclasses
import sqlite3

import numpy as np
import pytest
from laminar.bus import codec
from laminar.bus.errors import RemoteError
from laminar.roles import sqlite_store
from laminar.roles.sqlite_store import GroupCommitStore, pack, unpack

from laminar.protocol import AppendDeltas, GetPartial, InFlightOf, Trajectory, TrajectorySpec
from laminar.testing.inproc_cluster import InprocCluster
from tests.unit.roles.test_pool_write_failures import cfg, delta

pytestmark = pytest.mark.timeout(60)


def traj() -> Trajectory:
    spec = TrajectorySpec(trajectory_id="g/0", prompt_id="p", group_id="g", sample_index=0, group_size=1,
                          prompt_tokens=np.array([1, 2], np.int32))
    return Trajectory(spec=spec, response_tokens=np.array([5, 6], np.int32), logprobs=np.zeros(2, np.float32),
                      version=3, rollout_id="r", reward=1.0)


def test_stored_records_outlive_a_protocol_bump(monkeypatch):
    blob = pack(traj())
    monkeypatch.setattr(codec, "PROTOCOL_VERSION", codec.PROTOCOL_VERSION + 1)  # a later Laminar reads it
    back = unpack(blob)
    assert back.version == 3 and back.response_tokens.tolist() == [5, 6]


def test_schema_versions_migrate_forward_and_refuse_a_newer_store(tmp_path):
    path = tmp_path / "s.sqlite"
    s = GroupCommitStore(path, "CREATE TABLE IF NOT EXISTS t (k INTEGER PRIMARY KEY);", version=1)
    s.write_sync([("INSERT INTO t VALUES (1)", ())])
    s.close()
    v2 = {1: lambda c: c.execute("ALTER TABLE t ADD COLUMN extra TEXT DEFAULT 'x'")}
    s = GroupCommitStore(path, "CREATE TABLE IF NOT EXISTS t (k INTEGER PRIMARY KEY, extra TEXT);", version=2,
                         migrations=v2)
    assert s.read("PRAGMA user_version") == [(2,)] and s.read("SELECT k, extra FROM t") == [(1, "x")]
    s.close()
    with pytest.raises(sqlite_store.StoreVersionError) as err:
        GroupCommitStore(path, "CREATE TABLE IF NOT EXISTS t (k INTEGER PRIMARY KEY);", version=1)
    assert str(path) in str(err.value) and "v2" in str(err.value)


def test_a_torn_page_is_found_at_open_and_the_readable_rows_rebuilt(tmp_path):
    path = tmp_path / "c.sqlite"
    s = GroupCommitStore(path, "CREATE TABLE IF NOT EXISTS t (k INTEGER PRIMARY KEY, v BLOB);", version=1)
    s.write_sync([("INSERT INTO t VALUES (?, ?)", (i, bytes(3000))) for i in range(40)])
    s.close()
    with sqlite3.connect(path) as c:  # fold the WAL into the main file
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    page = 4096
    with open(path, "r+b") as f:     # tear one page in the middle of the table
        f.seek(page * 10)
        f.write(b"\xff" * page)
    s = GroupCommitStore(path, "CREATE TABLE IF NOT EXISTS t (k INTEGER PRIMARY KEY, v BLOB);", version=1)
    report = s.salvaged
    assert report is not None and report["file"] != str(path)
    assert (tmp_path / report["file"]).exists() or __import__("os").path.exists(report["file"])
    kept = s.read("SELECT count(*) FROM t")[0][0]
    assert 0 < kept < 40 and report["rows_copied"] == kept
    assert s.read("PRAGMA quick_check") == [("ok",)]
    s.close()


@pytest.mark.parametrize("turns", ["single", "multi"])
def test_an_undecodable_record_is_quarantined_not_a_restart_loop(tmp_path, turns):
    def d(tid):  # single-turn deltas are stored in chunks (one per request), multi-turn ones a row each
        x = delta(tid, 0)
        return x if turns == "single" else dataclasses.replace(x, loss_mask=np.ones(len(x.tokens), np.uint8))

    async def go():
        c = InprocCluster(cfg(tmp_path))
        await c.start("partial_pool")
        client = c.client("partial_pool")
        await client.call(AppendDeltas("r0", [d("good")]))
        await client.call(AppendDeltas("r0", [d("bad")]))
        await c.stop("partial_pool")
        db = tmp_path / "run" / "pools" / "partial_pool-0.sqlite"
        with sqlite3.connect(db) as conn:
            if turns == "single":
                conn.execute("UPDATE chunks SET blob = ? WHERE id = (SELECT max(id) FROM chunks)", (b"\x93garbage",))
            else:
                conn.execute("UPDATE deltas SET spec = ? WHERE tid = 'bad'", (b"\x93garbage",))
        pool = await c.start("partial_pool")   # starts: the bad record is set aside
        assert (await client.call(GetPartial("good"))).tokens.tolist() == [10, 20]
        assert [p.spec.trajectory_id for p in (await client.call(InFlightOf("*"))).partials] == ["good"]
        assert pool.status()["quarantined_rows"] == 1
        await c.close()
    asyncio.run(go())


def test_a_pool_whose_reload_fails_says_so(tmp_path):
    async def go():
        c = InprocCluster(cfg(tmp_path))
        pool = await c.start("partial_pool")
        client = c.client("partial_pool")
        real = pool.recover

        def broken():
            raise sqlite3.DatabaseError("database disk image is malformed")
        pool.recover, pool._stale = broken, True
        with pytest.raises(RemoteError) as err:
            await client.call(AppendDeltas("r0", [delta("t", 0)]))
        assert err.value.code == "unavailable" and "malformed" in str(err.value)
        status = pool.status()
        assert status["serving"] is False and "malformed" in status["fault"]
        pool.recover = real                     # the cause went away: the next request reloads and serves
        assert (await client.call(AppendDeltas("r0", [delta("t", 0)]))).applied == 1
        assert pool.status()["serving"] is True
        await c.close()
    asyncio.run(go())
