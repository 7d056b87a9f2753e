"""Group-commit store: durable acknowledgements, bounded queue, a full disk fails cleanly."""
from __future__ import annotations

import asyncio

import pytest

from laminar.roles.sqlite_store import GroupCommitStore, StoreBusy, StoreError

SCHEMA = "CREATE TABLE IF NOT EXISTS kv (k INTEGER PRIMARY KEY, v BLOB);"


def test_concurrent_writes_share_commits_and_persist(tmp_path):
    async def main():
        s = GroupCommitStore(tmp_path / "a.sqlite", SCHEMA)
        await asyncio.gather(*(s.write([("INSERT INTO kv VALUES (?, ?)", (i, b"x"))]) for i in range(500)))
        commits = s.commits
        s.close()
        return commits
    commits = asyncio.run(main())
    assert commits < 500  # group commit: many writes per transaction
    s = GroupCommitStore(tmp_path / "a.sqlite", SCHEMA)
    assert s.read("SELECT COUNT(*) FROM kv") == [(500,)]
    s.close()


def test_full_disk_fails_only_the_bad_write_and_store_stays_usable(tmp_path):
    async def main():
        s = GroupCommitStore(tmp_path / "b.sqlite", SCHEMA)
        await s.write([("INSERT INTO kv VALUES (1, ?)", (b"small",))])
        s.conn.execute("PRAGMA max_page_count = %d" % s.conn.execute("PRAGMA page_count").fetchone()[0])
        with pytest.raises(StoreError, match="full"):
            await s.write([("INSERT INTO kv VALUES (2, ?)", (b"y" * 200_000,))])
        await s.write([("UPDATE kv SET v = ? WHERE k = 1", (b"tiny",))])  # still writable in place
        rows = s.read("SELECT k, v FROM kv")
        s.close()
        return rows
    assert asyncio.run(main()) == [(1, b"tiny")]


def test_bounded_queue_refuses_instead_of_growing(tmp_path):
    async def main():
        s = GroupCommitStore(tmp_path / "c.sqlite", SCHEMA, max_pending=1)
        s.jobs.put(None)           # park the writer so nothing drains the queue
        s._thread.join(5)
        s.submit([("INSERT INTO kv VALUES (1, x'00')", ())])  # fills the queue
        with pytest.raises(StoreBusy, match="1 writes pending"):
            s.submit([("INSERT INTO kv VALUES (2, x'00')", ())])
        s.conn.close()
    asyncio.run(main())
