"""Group-commit store: durable acknowledgements (SIGKILL), bounded queue, failures that stay
typed and local (full disk, a bad write, a dead writer), bounded close."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from laminar.roles.sqlite_store import GroupCommitStore, StoreClosed, StoreError, StoreFull

SCHEMA = "CREATE TABLE IF NOT EXISTS kv (k INTEGER PRIMARY KEY, v BLOB);"


def park_writer(s: GroupCommitStore) -> threading.Event:
    """Block the writer thread inside a write until the returned event is set."""
    inside, release = threading.Event(), threading.Event()
    s.submit_sync(lambda c: (inside.set(), release.wait(10)))
    assert inside.wait(5)
    return release


def test_concurrent_writes_share_commits_and_persist(tmp_path):
    async def main():
        s = GroupCommitStore(tmp_path / "a.sqlite", SCHEMA)
        await asyncio.gather(*(s.write([("INSERT INTO kv VALUES (?, ?)", (i, b"x"))]) for i in range(500)))
        s.close()
        return s.commits, s.writes
    commits, writes = asyncio.run(main())
    assert writes == 500 and commits < 500  # group commit: many writes per transaction
    s = GroupCommitStore(tmp_path / "a.sqlite", SCHEMA)
    assert s.read("SELECT COUNT(*) FROM kv") == [(500,)]
    s.close()


def test_callable_batch_and_sync_api(tmp_path):
    s = GroupCommitStore(tmp_path / "b.sqlite", SCHEMA)
    rowid = s.write_sync(lambda c: c.execute("INSERT INTO kv (v) VALUES (?)", (b"a",)).lastrowid)
    assert s.read("SELECT k, v FROM kv") == [(rowid, b"a")]
    s.close()


def test_full_disk_fails_only_the_bad_write_and_store_stays_usable(tmp_path):
    async def main():
        s = GroupCommitStore(tmp_path / "c.sqlite", SCHEMA)
        await s.write([("INSERT INTO kv VALUES (1, ?)", (b"small",))])
        await s.write(lambda c: c.execute(f"PRAGMA max_page_count = {c.execute('PRAGMA page_count').fetchone()[0]}"))
        release = park_writer(s)  # so the next three writes land in one group
        big = s.submit([("INSERT INTO kv VALUES (2, ?)", (b"y" * 200_000,))])
        ok = s.submit([("UPDATE kv SET v = ? WHERE k = 1", (b"tiny",))])  # fits in place
        dup = s.submit([("INSERT INTO kv VALUES (1, x'00')", ())])        # a constraint error
        release.set()
        with pytest.raises(StoreError, match=r"c\.sqlite: write failed and was rolled back \(SQLITE_FULL"):
            await big
        await ok
        with pytest.raises(StoreError, match="SQLITE_CONSTRAINT"):
            await dup
        rows = s.read("SELECT k, v FROM kv")
        s.close()
        return rows
    assert asyncio.run(main()) == [(1, b"tiny")]
    s = GroupCommitStore(tmp_path / "c.sqlite", SCHEMA)  # reopens consistent
    assert s.read("PRAGMA integrity_check") == [("ok",)] and s.read("SELECT k FROM kv") == [(1,)]
    s.close()


def test_bounded_queue_refuses_at_once_instead_of_growing(tmp_path):
    async def main():
        s = GroupCommitStore(tmp_path / "d.sqlite", SCHEMA, max_pending=3)
        release = park_writer(s)
        futs = [s.submit([("INSERT INTO kv VALUES (?, x'00')", (i,))]) for i in range(3)]
        with pytest.raises(StoreFull, match="3 writes pending"):
            s.submit([("INSERT INTO kv VALUES (9, x'00')", ())])
        with pytest.raises(StoreFull):
            s.check_room()
        release.set()
        await asyncio.gather(*futs)
        s.check_room()
        s.close()
    asyncio.run(main())


def test_close_is_bounded_and_fails_what_it_could_not_commit(tmp_path):
    s = GroupCommitStore(tmp_path / "e.sqlite", SCHEMA)
    release = park_writer(s)
    left = s.submit_sync([("INSERT INTO kv VALUES (1, x'00')", ())])
    t0 = time.monotonic()
    s.close(timeout=0.2)
    assert time.monotonic() - t0 < 2
    with pytest.raises(StoreClosed, match="closed before this write was committed"):
        left.result(1)
    with pytest.raises(StoreClosed):
        s.submit_sync([("INSERT INTO kv VALUES (2, x'00')", ())])
    release.set()


def test_close_drains_what_is_queued(tmp_path):
    s = GroupCommitStore(tmp_path / "f.sqlite", SCHEMA)
    futs = [s.submit_sync([("INSERT INTO kv VALUES (?, x'00')", (i,))]) for i in range(100)]
    s.close()
    assert all(f.result(0) is None for f in futs)
    s = GroupCommitStore(tmp_path / "f.sqlite", SCHEMA)
    assert s.read("SELECT COUNT(*) FROM kv") == [(100,)]
    s.close()


def test_a_dead_writer_fails_every_waiter_with_a_typed_error(tmp_path):
    s = GroupCommitStore(tmp_path / "g.sqlite", SCHEMA)

    def crash(conn):
        raise KeyboardInterrupt("simulated crash of the writer thread")  # not an Exception: escapes

    with pytest.raises(StoreClosed, match="writer thread died"):
        s.write_sync(crash)
    with pytest.raises(StoreClosed, match="writer thread died"):
        s.submit_sync([("INSERT INTO kv VALUES (1, x'00')", ())])
    s.close(timeout=1)


CHILD = textwrap.dedent("""
    import asyncio, itertools, sys
    from laminar.roles.sqlite_store import GroupCommitStore

    async def main():
        s = GroupCommitStore(sys.argv[1], "CREATE TABLE IF NOT EXISTS log (id INTEGER, payload BLOB)")
        ids = itertools.count()

        async def worker():
            while True:
                i = next(ids)
                await s.write([("INSERT INTO log VALUES (?, ?)", (i, bytes(200)))])
                sys.stdout.write(f"{i}\\n")
                sys.stdout.flush()

        await asyncio.gather(*(worker() for _ in range(32)))

    asyncio.run(main())
""")


def test_sigkill_loses_no_acknowledged_write_and_duplicates_none(tmp_path):
    db = tmp_path / "kill.sqlite"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(db)], stdout=subprocess.PIPE, text=True)
    acked: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(acked) < 3000 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            acked.append(int(line))
        os.kill(proc.pid, signal.SIGKILL)  # mid-stream: 32 writes in flight
        rest = proc.stdout.read()          # printed (so acknowledged) before the kill
        acked += [int(x) for x in rest.split("\n")[:-1]]  # the last piece may be a torn line
    finally:
        proc.kill()
        proc.wait(10)
    assert len(acked) >= 3000, "the writer process did not get going"
    s = GroupCommitStore(db)
    counts = dict(s.read("SELECT id, COUNT(*) FROM log GROUP BY id"))
    s.close()
    assert not [i for i in acked if i not in counts], "acknowledged writes lost"
    assert max(counts.values()) == 1, "a write stored twice"
