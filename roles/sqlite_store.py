"""Durable storage of the data pools: SQLite in WAL mode with group commit.

Each pool keeps its authoritative state in memory (reads never touch disk) and logs every change
here; a request is acknowledged only after the transaction holding its change has committed
(synchronous=FULL: fsynced). One writer thread owns the connection and commits everything queued
since its last commit in one transaction, so many concurrent writes share one fsync.

Backpressure: the job queue is bounded (`max_pending`); beyond it `submit` raises StoreBusy at
once. A failing transaction (disk full, I/O error) is rolled back and its jobs retried one by one
so that only the bad one fails, with StoreError; the file stays consistent (SQLite's journal), and
the pool reloads its memory from disk after such a failure.
"""
from __future__ import annotations

import asyncio
import queue
import sqlite3
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

Statements = Sequence[tuple[str, Sequence[Any]]]


class StoreError(RuntimeError):
    pass


class StoreBusy(StoreError):
    pass


class GroupCommitStore:
    def __init__(self, path: str | Path, schema: str, max_pending: int = 10000, max_batch: int = 512):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_batch = max_batch
        self.jobs: queue.Queue = queue.Queue(maxsize=max_pending)
        self.conn = self._connect()
        self.conn.executescript(schema)
        self.conn.commit()
        self.commits = 0
        self._thread = threading.Thread(target=self._writer, name=f"sqlite:{self.path.name}", daemon=True)
        self._thread.start()

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        return conn

    def read(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        """Read at start-up (recovery) — before any write is submitted."""
        return self.conn.execute(sql, params).fetchall()

    def submit(self, statements: Statements) -> asyncio.Future:
        """Queue one atomic write; the future resolves once it is committed (durable)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        try:
            self.jobs.put_nowait((list(statements), fut, loop))
        except queue.Full:
            raise StoreBusy(f"{self.path.name}: {self.jobs.maxsize} writes pending; retry later") from None
        return fut

    async def write(self, statements: Statements) -> None:
        await self.submit(statements)

    def _writer(self) -> None:
        while True:
            first = self.jobs.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < self.max_batch:
                try:
                    nxt = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self.jobs.put(None)  # stop after this batch
                    break
                batch.append(nxt)
            try:
                self._commit([s for job in batch for s in job[0]])
                self._resolve(batch, None)
            except sqlite3.Error:
                for job in batch:  # isolate the failing write; the others still commit
                    try:
                        self._commit(job[0])
                        self._resolve([job], None)
                    except sqlite3.Error as exc:
                        self._resolve([job], StoreError(f"{self.path}: write failed: {exc}"))

    def _commit(self, statements: Statements) -> None:
        c = self.conn
        try:
            c.execute("BEGIN IMMEDIATE")
            for sql, params in statements:
                c.execute(sql, params)
            c.execute("COMMIT")
            self.commits += 1
        except sqlite3.Error:
            if c.in_transaction:
                c.execute("ROLLBACK")
            raise

    @staticmethod
    def _resolve(batch: list, exc: Exception | None) -> None:
        for _, fut, loop in batch:
            def done(f=fut) -> None:
                if not f.done():
                    f.set_exception(exc) if exc else f.set_result(None)
            loop.call_soon_threadsafe(done)

    def close(self, timeout: float = 10.0) -> None:
        self.jobs.put(None)
        self._thread.join(timeout)
        self.conn.close()


def pack(ev: Any) -> bytes:
    """An event as one blob (the bus codec's frames, msgpack-framed) for a BLOB column."""
    import msgpack

    from laminar.bus.codec import encode
    return msgpack.packb([bytes(f) for f in encode(ev)])


def unpack(blob: bytes) -> Any:
    import msgpack

    from laminar.bus.codec import decode
    return decode(msgpack.unpackb(blob))[0]


Callback = Callable[[], None]
