"""Group-commit store, the cheap path: a commit window that gathers the writes of a short span
into one transaction, an idle writer woken by the first write only, one wake-up of the event loop
per committed group. Acknowledged still means on disk: each write is read back from a separate
connection at the moment its future resolves."""
from __future__ import annotations

import asyncio
import sqlite3
import time

import pytest
from laminar.roles.sqlite_store import GroupCommitStore

SCHEMA = "CREATE TABLE IF NOT EXISTS kv (k INTEGER PRIMARY KEY, v BLOB);"


def on_disk(path, k: int) -> bool:
    """Whether row k is committed, read by a connection of its own (not the store's)."""
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT count(*) FROM kv WHERE k = ?", (k,)).fetchone()[0] == 1
    finally:
        conn.close()


def test_writes_within_the_window_share_one_commit_and_each_ack_is_on_disk(tmp_path):
    path = tmp_path / "w.sqlite"

    async def main():
        s = GroupCommitStore(path, SCHEMA, window_s=0.2)
        seen: dict[int, bool] = {}
        futs = []
        for i in range(20):  # one at a time, as a pool's handlers submit them
            f = s.submit([("INSERT INTO kv VALUES (?, ?)", (i, b"x"))])
            f.add_done_callback(lambda _f, i=i: seen.__setitem__(i, on_disk(path, i)))
            futs.append(f)
            await asyncio.sleep(0.001)
        await asyncio.gather(*futs)
        await asyncio.sleep(0)  # let the done callbacks run
        s.close()
        return s.commits, s.writes, seen
    commits, writes, seen = asyncio.run(main())
    assert writes == 20
    assert commits <= 2, commits  # 20 writes ~20 ms apart in all, a 200 ms window: one group (two at worst)
    assert seen == {i: True for i in range(20)}  # every acknowledged write was already committed


def test_an_ack_waits_at_most_about_the_window(tmp_path):
    async def main():
        s = GroupCommitStore(tmp_path / "l.sqlite", SCHEMA, window_s=0.05)
        waits = []
        for i in range(5):
            t0 = time.monotonic()
            await s.write([("INSERT INTO kv VALUES (?, ?)", (i, b"x"))])
            waits.append(time.monotonic() - t0)
        s.close()
        return waits
    waits = asyncio.run(main())
    assert min(waits) >= 0.04  # each lone write waited for the window ...
    assert max(waits) < 2.0    # ... and no longer than the window and a commit (generous on a loaded machine)


@pytest.mark.parametrize("window_s", [0.0, 0.005])
def test_an_idle_writer_wakes_for_a_lone_write(tmp_path, window_s):
    """The writer is woken only when it waits; a write that arrives while it sleeps still commits."""
    path = tmp_path / "i.sqlite"

    async def main():
        s = GroupCommitStore(path, SCHEMA, window_s=window_s)
        for i in range(30):
            await asyncio.wait_for(s.write([("INSERT INTO kv VALUES (?, ?)", (i, b"x"))]), 5)
            assert on_disk(path, i)
            await asyncio.sleep(0.002 * (i % 3))  # sometimes the writer is back asleep, sometimes not
        s.close()
        return s.writes
    assert asyncio.run(main()) == 30


def test_a_group_wakes_the_event_loop_once(tmp_path):
    """The futures of one committed group are settled in one call into the loop, not one each."""
    async def main():
        s = GroupCommitStore(tmp_path / "g.sqlite", SCHEMA, window_s=0.1)
        loop = asyncio.get_running_loop()
        calls = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a, **k: (calls.append(a[0]), real(*a, **k))[1]
        await asyncio.gather(*(s.write([("INSERT INTO kv VALUES (?, ?)", (i, b"x"))]) for i in range(50)))
        s.close()
        return len(calls), s.commits
    wakeups, commits = asyncio.run(main())
    assert wakeups == commits <= 2


def test_close_commits_what_waits_in_the_window(tmp_path):
    path = tmp_path / "c.sqlite"
    s = GroupCommitStore(path, SCHEMA, window_s=5.0)
    f = s.submit_sync([("INSERT INTO kv VALUES (1, x'00')", ())])
    t0 = time.monotonic()
    s.close(timeout=10)
    assert f.result(1) is None and on_disk(path, 1)
    assert time.monotonic() - t0 < 4  # closing cuts the window short


def test_a_negative_window_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="window_s"):
        GroupCommitStore(tmp_path / "n.sqlite", SCHEMA, window_s=-1)
