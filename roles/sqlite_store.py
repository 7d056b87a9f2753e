"""Durable storage of the data pools: SQLite in WAL mode with group commit (how a pool keeps its
in-memory state in step with it is roles/pool_base.py).

Each pool keeps its authoritative working state in memory (queries never touch disk) and logs
every change here. A write is acknowledged (its future resolves) only after the transaction that
holds it has committed with synchronous=FULL, i.e. is fsynced: what was acknowledged survives a
SIGKILL or a power cut. One writer thread owns the write connection and commits everything queued
since its last commit in one transaction, so many concurrent writes share one fsync.

The cheap path, for a pool that takes a write at a time at a high rate: the writer is woken only
when it waits (a write queued while it commits joins the next group without a wake-up); with
`window_s` > 0 it gathers for that long after a group's first write before committing, so the
writes of a short span share one transaction (each write's acknowledgement waits up to the
window longer; 0, the default, commits at once); and the futures of one committed group are
settled in one call into their event loop, not one call each.

A write is a list of (sql, params) or a callable taking the connection (its return value is the
future's result). A callable may run twice (see failures below): it must only touch the connection.
Params given as `Many(rows)` run the statement once per row in one `executemany` call (SQLite's C
loop: the cheap way to write many rows of one kind).

Backpressure: at most `max_pending` writes wait; beyond that `submit` raises StoreFull at once,
nothing queued, rather than letting the queue (and the caller's latency) grow without bound.

Failures (disk full, I/O error, a bad statement): the group's transaction is rolled back and its
writes retried one transaction each, so only the bad one fails, with StoreError; the file stays
consistent (SQLite's WAL) and the writer keeps going. If the writer thread itself dies, every
waiting and later write fails with StoreError instead of hanging.

Reads use their own connection (behind a lock) so they never queue behind a commit's fsync; WAL
gives them the last committed snapshot. `read` is synchronous (start-up, tests); `aread` runs it
in a thread. `close(timeout)` drains the queue within the deadline, then fails what is left.

Versions (given `version`): a store's schema has its own version, in SQLite's `user_version`,
independent of the wire protocol's. A store written before versioning counts as v1; an older
store is brought forward at open by `migrations[v]` (v -> v+1, each in its own transaction); a
newer one is refused (StoreVersionError, naming the file). Records packed with `pack` are bus
frames: `unpack` decodes them whatever protocol version wrote them (fields are only ever added).

Corruption: at open `PRAGMA quick_check` runs. A damaged file is moved aside
(`<name>.corrupt-<utc time>`, with its WAL) and every row still readable is copied, table by table
and row by row, into a fresh file under the original name; `salvaged` reports the moved file, the
problem and the rows copied and lost, and the error is logged. The pool then starts on what could
be saved instead of failing at every start.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgpack
import structlog
from laminar.bus import codec
from laminar.bus.errors import ProtocolMismatch
from pydantic import Field

log = structlog.get_logger("laminar.sqlite_store")

Statements = Sequence[tuple[str, Sequence[Any]]]
Batch = Statements | Callable[[sqlite3.Connection], Any]
Resolve = Callable[[Any, "BaseException | None"], None]
Job = tuple[Batch, "Resolve | asyncio.Future"]  # an asyncio future is settled in its loop, a group at a time


def commit_window_field():
    """A pool's `commit_window_s` setting (the store's `window_s`), the same in every pool."""
    return Field(0.0, ge=0, le=1.0, description="seconds the store's writer gathers writes after a group's first "
                 "before committing them in one transaction (each acknowledgement waits up to this much longer; "
                 "saves CPU when writes come one at a time at a high rate; 0: commit at once)")


class Many(list):
    """Rows for one statement, executed with `executemany`."""


class StoreError(RuntimeError):
    """A write did not commit: nothing of it is on disk."""


class StoreFull(StoreError):
    """Backpressure: too many writes pending. Nothing was queued; retry later."""


StoreBusy = StoreFull  # the name the pool roles catch


class StoreClosed(StoreError):
    """The store is closed (or its writer died); the write was not made."""


class StoreVersionError(RuntimeError):
    """The store's schema is newer than this code knows, or no migration leads from it."""


Migration = Callable[[sqlite3.Connection], None]


class GroupCommitStore:
    def __init__(self, path: str | Path, schema: str = "", max_pending: int = 10_000, max_batch: int = 512,
                 *, version: int = 0, migrations: dict[int, Migration] | None = None, check: bool = True,
                 window_s: float = 0.0):
        if not window_s >= 0:
            raise ValueError(f"window_s must be at least 0 (seconds the writer gathers writes), got {window_s!r}")
        self.path = Path(path)
        self.window_s = window_s
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_pending, self.max_batch = max_pending, max_batch
        self.salvaged: dict | None = None  # what a salvage at open did (None: the file was sound)
        if check and self.path.exists():
            problem = _integrity_problem(self.path)
            if problem is not None:
                self.salvaged = _salvage(self.path, problem)
        self._wconn = self._connect()
        if version:
            self._migrate(version, migrations or {})
        if schema:
            self._wconn.executescript(f"BEGIN IMMEDIATE; {schema}; COMMIT;")  # all or nothing, one fsync
        if version:
            self._wconn.execute(f"PRAGMA user_version = {int(version)}")
        self._rconn = self._connect()
        self._rlock = threading.Lock()
        self._cv = threading.Condition()
        self._queue: deque[Job] = deque()
        self._idle = False      # the writer waits for a first write (only then is it notified)
        self._closing = False
        self._dead: str | None = None  # why the writer thread ended early
        self.commits = 0        # transactions committed (group commit: fewer than writes)
        self.writes = 0         # writes acknowledged
        self._thread = threading.Thread(target=self._writer, name=f"sqlite:{self.path.name}", daemon=True)
        self._thread.start()

    def _migrate(self, version: int, migrations: dict[int, Migration]) -> None:
        c = self._wconn
        have = c.execute("PRAGMA user_version").fetchone()[0]
        if have == 0 and c.execute("SELECT count(*) FROM sqlite_master WHERE type = 'table'").fetchone()[0]:
            have = 1  # written before stores had versions
        if have > version:
            raise StoreVersionError(f"{self.path}: schema v{have} was written by a newer Laminar; this one reads up "
                                    f"to v{version}. Run the newer version, or move the file aside to start empty")
        for v in range(have or version, version):
            step = migrations.get(v)
            c.execute("BEGIN IMMEDIATE")
            try:
                if step is not None:
                    step(c)
                c.execute(f"PRAGMA user_version = {v + 1}")
                c.execute("COMMIT")
            except BaseException:
                c.execute("ROLLBACK")
                raise
            log.info("store_migrated", path=str(self.path), to_version=v + 1)

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA busy_timeout=10000")  # a checkpoint may briefly hold the other connection
        return conn

    # -- writes ---------------------------------------------------------------------------------
    def _refuse_if_no_room(self) -> None:  # the caller holds self._cv
        if self._dead or self._closing:
            raise StoreClosed(f"{self.path}: {self._dead or 'store is closed'}")
        if len(self._queue) >= self.max_pending:
            raise StoreFull(f"{self.path.name}: {self.max_pending} writes pending; retry later")

    def check_room(self) -> None:
        """Raise StoreFull/StoreClosed now if a submit would; lets a caller refuse before it
        changes any state of its own."""
        with self._cv:
            self._refuse_if_no_room()

    def _enqueue(self, batch: Batch, resolve: Resolve | asyncio.Future) -> None:
        with self._cv:
            self._refuse_if_no_room()
            self._queue.append((batch, resolve))
            if self._idle or len(self._queue) == self.max_batch:  # a busy writer takes it unwoken,
                self._idle = False                                 # one gathering stops at a full group
                self._cv.notify()

    def submit(self, batch: Batch) -> asyncio.Future:
        """Queue one atomic write; the future resolves once it is committed (durable)."""
        fut = asyncio.get_running_loop().create_future()
        self._enqueue(batch, fut)
        return fut

    async def write(self, batch: Batch) -> Any:
        return await self.submit(batch)

    def submit_sync(self, batch: Batch) -> concurrent.futures.Future:
        """As submit, for code without an event loop (tests, start-up, threads)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def resolve(result: Any, exc: BaseException | None) -> None:
            if not fut.done():
                fut.set_exception(exc) if exc else fut.set_result(result)

        self._enqueue(batch, resolve)
        return fut

    def write_sync(self, batch: Batch, timeout: float | None = 30.0) -> Any:
        return self.submit_sync(batch).result(timeout)

    @property
    def pending(self) -> int:
        return len(self._queue)

    # -- the writer thread ----------------------------------------------------------------------
    def _next_group(self) -> list[Job] | None:
        with self._cv:
            while not self._queue and not self._closing:
                self._idle = True
                self._cv.wait()
            self._idle = False
            if not self._queue:
                return None  # closing and drained
            if self.window_s and not self._closing and len(self._queue) < self.max_batch:
                self._cv.wait(self.window_s)  # gather; only close() cuts it short
            return [self._queue.popleft() for _ in range(min(len(self._queue), self.max_batch))]

    def _writer(self) -> None:
        group: list = []
        try:
            while (group := self._next_group()) is not None:
                self._commit_group(group)
                group = []
        except BaseException as exc:  # a bug or MemoryError: fail every waiter, loudly, never hang
            log.error("sqlite_writer_died", path=str(self.path), error=repr(exc), exc_info=exc)
            with self._cv:
                self._dead = f"writer thread died: {exc!r}"
                left, self._queue = group + list(self._queue), deque()
            _answer([(resolve, None, StoreClosed(f"{self.path}: {self._dead}")) for _, resolve in left])

    def _commit_group(self, group: list[Job]) -> None:
        try:
            results = self._transaction([b for b, _ in group])
        except Exception as exc:
            if len(group) > 1:  # isolate the failing write; the others still commit
                for job in group:
                    self._commit_group([job])
            else:
                _answer([(group[0][1], None, self._error(exc))])
            return
        self.writes += len(group)
        _answer([(resolve, r, None) for (_, resolve), r in zip(group, results, strict=False)])

    def _transaction(self, batches: list[Batch]) -> list[Any]:
        c = self._wconn
        c.execute("BEGIN IMMEDIATE")
        try:
            out = [b(c) if callable(b) else _run(c, b) for b in batches]
            c.execute("COMMIT")
        except BaseException:
            if c.in_transaction:  # SQLite rolls some errors (disk full, I/O) back by itself
                try:
                    c.execute("ROLLBACK")
                except sqlite3.Error as exc:
                    log.error("sqlite_rollback_failed", path=str(self.path), error=str(exc))
            raise
        self.commits += 1
        return out

    def _error(self, exc: BaseException) -> StoreError:
        name = getattr(exc, "sqlite_errorname", type(exc).__name__)
        err = StoreError(f"{self.path}: write failed and was rolled back ({name}: {exc})")
        err.__cause__ = exc
        return err

    # -- reads ----------------------------------------------------------------------------------
    def read(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        """Rows of the last committed state (blocking: call from a thread or at start-up)."""
        with self._rlock:
            return self._rconn.execute(sql, params).fetchall()

    async def aread(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        return await asyncio.to_thread(self.read, sql, params)

    # -- shutdown -------------------------------------------------------------------------------
    def close(self, timeout: float = 10.0) -> None:
        """Commit what is queued within `timeout` s; fail the rest with StoreClosed."""
        with self._cv:
            self._closing = True
            self._cv.notify()  # wakes the writer whether it waits for a write or gathers in its window
        self._thread.join(timeout)
        with self._cv:
            left, self._queue = list(self._queue), deque()
        _answer([(resolve, None, StoreClosed(f"{self.path}: closed before this write was committed"))
                 for _, resolve in left])
        with self._rlock:
            self._rconn.close()
        if self._thread.is_alive():  # stuck in fsync: the thread still owns the connection
            log.error("sqlite_close_timeout", path=str(self.path), timeout_s=timeout)
            return
        self._wconn.close()


def _run(conn: sqlite3.Connection, statements: Statements) -> None:
    for sql, params in statements:
        if isinstance(params, Many):
            conn.executemany(sql, params)
        else:
            conn.execute(sql, params)


def _settle(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if not fut.done():  # the waiter may have been cancelled
        fut.set_exception(exc) if exc else fut.set_result(result)


def _settle_all(answers: list[tuple[asyncio.Future, Any, BaseException | None]]) -> None:
    for fut, result, exc in answers:
        _settle(fut, result, exc)


def _answer(answers: list[tuple[Resolve | asyncio.Future, Any, BaseException | None]]) -> None:
    """From the writer thread: each write's answer. The asyncio futures of one loop are settled in
    one call into that loop (one wake-up a group); a synchronous resolver is called here."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for resolve, result, exc in answers:
        if isinstance(resolve, asyncio.Future):
            by_loop.setdefault(resolve.get_loop(), []).append((resolve, result, exc))
        else:
            resolve(result, exc)
    for loop, settled in by_loop.items():
        try:
            loop.call_soon_threadsafe(_settle_all, settled)
        except RuntimeError:
            pass  # the loop is closed: nobody is waiting for these answers any more


def pack(ev: Any) -> bytes:
    """An event as one blob (the bus codec's frames, msgpack-framed) for a BLOB column."""
    return msgpack.packb([bytes(f) for f in codec.encode(ev)])


def unpack(blob: bytes) -> Any:
    """The event of a `pack`ed blob, whatever protocol version wrote it: a stored record is read
    by a later Laminar, whose kinds only ever gain fields (with defaults) at the end. Raises the
    codec's errors (or msgpack's) on a damaged blob."""
    frames = msgpack.unpackb(blob)
    try:
        return codec.decode(frames)[0]
    except ProtocolMismatch:
        _, meta, fields = msgpack.unpackb(frames[1], strict_map_key=False)
        frames = [frames[0], msgpack.packb([codec.PROTOCOL_VERSION, meta, fields]), *frames[2:]]
        return codec.decode(frames)[0]


# -- corruption ---------------------------------------------------------------------------------
def _integrity_problem(path: Path) -> str | None:
    """None if SQLite's quick check passes, else what it (or opening the file) reported."""
    try:
        conn = sqlite3.connect(path, isolation_level=None)
        try:
            rows = conn.execute("PRAGMA quick_check").fetchall()
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        return f"{type(exc).__name__}: {exc}"
    if rows == [("ok",)]:
        return None
    return "; ".join(str(r[0]) for r in rows[:5]) + (f" (+{len(rows) - 5} more)" if len(rows) > 5 else "")


def _salvage(path: Path, problem: str) -> dict:
    """Move a damaged store aside and copy every readable row into a fresh file at `path`."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = path.with_name(f"{path.name}.corrupt-{stamp}")
    for suffix in ("", "-wal", "-shm"):
        if Path(f"{path}{suffix}").exists():
            os.replace(f"{path}{suffix}", f"{aside}{suffix}")
    copied = lost = 0
    tables: list[str] = []
    old = sqlite3.connect(aside, isolation_level=None)
    new = sqlite3.connect(path, isolation_level=None)
    try:
        try:
            objects = old.execute("SELECT type, name, sql FROM sqlite_master WHERE sql IS NOT NULL "
                                  "AND name NOT LIKE 'sqlite_%' ORDER BY type = 'index'").fetchall()
            user_version = old.execute("PRAGMA user_version").fetchone()[0]
        except sqlite3.DatabaseError:
            objects, user_version = [], 0  # even the schema is gone: the pool starts empty
        new.execute("BEGIN")
        for kind, name, sql in objects:
            new.execute(sql)
            if kind != "table":
                continue
            tables.append(name)
            got, ranges = _copy_table(old, new, name)
            copied, lost = copied + got, lost + ranges
        new.execute(f"PRAGMA user_version = {int(user_version)}")
        new.execute("COMMIT")
    finally:
        old.close()
        new.close()
    report = {"file": str(aside), "problem": problem, "tables": tables, "rows_copied": copied,
              "damaged_ranges": lost}
    log.error("store_corrupt_salvaged", path=str(path), **report,
              way_out=f"the damaged file is kept as {aside}; what was readable now serves from {path}")
    return report


def _copy_table(old: sqlite3.Connection, new: sqlite3.Connection, table: str) -> tuple[int, int]:
    """Copy every readable row in rowid order; returns (rows copied, damaged rowid ranges skipped).
    A damaged page stops a scan with an error: the scan resumes at the first rowid from which a
    seek reads again (found by doubling, then halving, the step past the last good row)."""
    q = '"' + table.replace('"', '""') + '"'
    lo, copied, skipped, top = -(2 ** 63), 0, 0, 2 ** 62

    def seeks(x: int) -> bool:
        try:
            old.execute(f"SELECT rowid FROM {q} WHERE rowid > ? ORDER BY rowid LIMIT 1", (x,)).fetchone()
            return True
        except sqlite3.DatabaseError:
            return False

    while True:
        try:
            for row in old.execute(f"SELECT rowid, * FROM {q} WHERE rowid > ? ORDER BY rowid", (lo,)):
                _insert(new, q, [row[1:]])
                lo, copied = row[0], copied + 1
            return copied, skipped
        except sqlite3.DatabaseError:
            skipped += 1
        step = 1
        while lo + step < top and not seeks(lo + step):
            step *= 2
        if lo + step >= top:
            return copied, skipped
        bad, good = lo + step // 2, lo + step  # smallest start that reads lies in (bad, good]
        while good - bad > 1:
            mid = (bad + good) // 2
            bad, good = (bad, mid) if seeks(mid) else (mid, good)
        lo = good


def _insert(conn: sqlite3.Connection, table: str, rows: list[tuple]) -> None:
    if rows:
        marks = ",".join("?" * len(rows[0]))
        conn.executemany(f"INSERT OR IGNORE INTO {table} VALUES ({marks})", rows)
