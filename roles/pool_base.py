"""What the three data pools share: a durable store under the run's workdir, a request/reply
server on the role's port, a periodic counts event on `metrics.<role>`, and the discipline that
makes "acknowledged" mean "on disk".

Memory is the working copy, SQLite the truth. A handler that changes state (`route(...,
changes=True)`) first checks the write queue has room (`busy` before anything changes), changes
memory at once — so concurrent callers see each other's effect and never hand out the same thing
twice — then awaits the commit of its rows (`durable`) and only then replies. A handler whose
change has no rows (a retried request memory already holds) waits for the last write submitted
(the writer commits in order), so a retry is never acknowledged before the original is durable.
A write that fails or is refused after memory changed leaves memory possibly ahead of disk: the
pool marks itself stale and answers `unavailable`/`busy`; the next request waits until every
handler and commit in flight has settled, then rebuilds memory from disk (`recover`) before it
runs. Queries (`changes=False`) read memory and never wait for room.

A pool that cannot serve says so instead of failing in a loop: if rebuilding memory from disk
fails (at start or after a failed write), the pool still runs, heartbeats `serving: false` with
the reason (`fault`), answers every request `unavailable` with that reason, and tries again on the
next request. A record that cannot be decoded is moved to the store's `quarantined` table (with
why) by `quarantine`, so one bad row costs that row, not the pool. Each store has a schema version
(`SCHEMA_VERSION`, `MIGRATIONS`: roles/sqlite_store.py).

Identity: a store records the run name and the pool's `fingerprint()` (the settings that give its
rows their meaning: seed, dataset and its size, capacity, ...) when it is made. Started again with
different ones, the pool refuses to serve (fault naming each setting's stored and configured
value) rather than repeat or skip prompts, unless the setting is one `migrate_setting` carries out
(the buffer applies a new capacity on disk), after which the new value is recorded.

Hand-outs (roles/handout.py): every pool holds the hand-out key (`handouts`: the prompt pool signs
what it hands out, the partial pool and the buffer check a rollout's writes against it) and counts
the writes it refused for want of one (`refusals`), which its status carries (the `writes_refused`
alarm names the key and its host).
"""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from laminar.bus.rpc import RequestError
from laminar.roles.handout import Handouts, Refusals
from laminar.roles.sqlite_store import GroupCommitStore, StoreBusy, StoreError

from laminar.handout_key import handout_key
from laminar.protocol import PoolCount
from laminar.role_base import Role

QUARANTINE_SCHEMA = """
CREATE TABLE IF NOT EXISTS quarantined (tbl TEXT, key TEXT, blob BLOB, why TEXT, at REAL);
CREATE TABLE IF NOT EXISTS identity (k TEXT PRIMARY KEY, v TEXT);
"""


def _store_refusal(exc: StoreError) -> RequestError:
    return RequestError("busy" if isinstance(exc, StoreBusy) else "unavailable", str(exc))


class PoolRole(Role):
    """The shared lifecycle of the three pools: a SQLite store, a request server, stats on the bus."""
    SCHEMA = ""
    SCHEMA_VERSION = 1
    MIGRATIONS: dict = {}                 # v -> function(connection) bringing a store from v to v+1
    counts_interval_s = 1.0
    fault: str | None = None              # why the pool cannot serve now (None: it can)
    refusal: str | None = None            # the store belongs to other settings: never serve
    MIGRATABLE: frozenset = frozenset()   # fingerprint keys `migrate_setting` can carry out
    quarantined_rows = 0
    _stale = False                        # memory may be ahead of disk: reload before the next request
    _in_flight = 0                        # writes submitted and not yet settled
    _active = 0                           # handlers running
    _last: asyncio.Future | None = None   # the write submitted last

    def store_path(self) -> Path:
        d = getattr(self.settings, "store_dir", None)
        base = Path(d) if d else self.cluster.workdir() / "pools"
        return base / f"{self.ctx.role}-{self.ctx.id}.sqlite"

    async def setup(self) -> None:
        self.handouts = Handouts(await asyncio.to_thread(handout_key, self.cluster))
        self.refusals = Refusals(self.cluster, self.log)
        self.store = await asyncio.to_thread(GroupCommitStore, self.store_path(), self.SCHEMA + QUARANTINE_SCHEMA,
                                             version=self.SCHEMA_VERSION, migrations=self.MIGRATIONS,
                                             window_s=getattr(self.settings, "commit_window_s", 0.0))
        self.refusal = await asyncio.to_thread(self._check_identity)
        if self.refusal is not None:
            self.log.error("pool_refuses_store", store=str(self.store_path()), why=self.refusal)
        else:
            try:
                await asyncio.to_thread(self._recover_counted)
                await asyncio.to_thread(self._migrate_settings)
            except Exception as exc:  # serve nothing, say why, retry on the next request: never a restart loop
                self._fail(exc)
        self.server = self.ctx.transport.server(self.cluster.bind_endpoint(self.ctx.role, self.ctx.id),
                                                self.ctx.role, self.ctx.id)
        self.routes()
        await self.server.start()
        self.log.info("pool_ready", store=str(self.store_path()), **self.status())

    def fingerprint(self) -> dict:
        """Settings the store's contents depend on (JSON values); see the module docstring."""
        return {}

    def _identity(self) -> dict:
        cluster = self.cluster
        return {"run": cluster.run.name if cluster is not None else "", **self.fingerprint()}

    def _check_identity(self) -> str | None:
        """None if the store was made with these settings (recording them in a store that has
        none); else why not, naming each differing setting's stored and configured values."""
        want = self._identity()
        have = {k: json.loads(v) for k, v in self.store.read("SELECT k, v FROM identity")}
        if not have:
            self.store.write_sync([("INSERT OR REPLACE INTO identity VALUES (?, ?)", (k, json.dumps(v)))
                                   for k, v in want.items()])
            return None
        differ = [k for k in sorted(set(want) | set(have)) if have.get(k) != want.get(k)]
        self._pending_migrations = {k: (have.get(k), want.get(k)) for k in differ if k in self.MIGRATABLE}
        refused = [k for k in differ if k not in self.MIGRATABLE]
        if not refused:
            return None
        what = ", ".join(f"{k}: stored {have.get(k)!r}, configured {want.get(k)!r}" for k in refused)
        return (f"store {self.store_path()} was made with other settings ({what}); refusing to serve it. "
                f"Start with the settings it was made with, or give this run another workdir/store_dir "
                f"(or move the file aside) to start anew")

    def _migrate_settings(self) -> None:
        for k, (old, new) in getattr(self, "_pending_migrations", {}).items():
            self.migrate_setting(k, old, new)
            self.store.write_sync([("INSERT OR REPLACE INTO identity VALUES (?, ?)", (k, json.dumps(new)))])
            self.log.warning("store_setting_migrated", store=str(self.store_path()), setting=k, old=old, new=new)
        self._pending_migrations = {}

    def migrate_setting(self, key: str, old, new) -> None:
        """Carry a changed setting out on the recovered state and the store (blocking)."""
        raise NotImplementedError(key)

    def _recover_counted(self) -> None:
        self.recover()
        self.quarantined_rows = self.store.read("SELECT count(*) FROM quarantined")[0][0]

    def _fail(self, exc: BaseException) -> None:
        self._stale = True
        self.fault = f"cannot rebuild state from {self.store_path()}: {type(exc).__name__}: {exc}"
        self.log.error("pool_not_serving", fault=self.fault, way_out="fix or move the store aside and restart; "
                       "every request retries meanwhile")

    def quarantine(self, table: str, key: str, blob: bytes | None, why: str, deletes: list) -> None:
        """Set a stored record that cannot be decoded aside (blocking; from `recover`)."""
        self.store.write_sync([("INSERT INTO quarantined VALUES (?, ?, ?, ?, ?)", (table, key, blob, why, now())),
                               *deletes])
        self.log.error("record_quarantined", store=str(self.store_path()), table=table, key=key, why=why)

    def recover(self) -> None:
        """Rebuild the in-memory state from the store (start-up and after a failed write)."""

    def routes(self) -> None:
        """Register the handlers with `self.route`."""
        raise NotImplementedError

    def route(self, kind, handler, *, changes: bool = True) -> None:
        async def guarded(req):
            if self._stale:
                await self._reload()
            if self.refusal is not None or self.fault is not None:
                raise RequestError("unavailable", self.refusal or self.fault)
            if changes:
                try:
                    self.store.check_room()
                except StoreError as exc:
                    raise _store_refusal(exc) from None
            self._active += 1
            try:
                return await handler(req)
            finally:
                self._active -= 1
                self._maybe_idle()
        self.server.route(kind, guarded)

    def _maybe_idle(self) -> None:
        if not self._active and not self._in_flight and getattr(self, "_idle", None) is not None:
            self._idle.set()

    async def _reload(self) -> None:
        """Wait for every handler and commit in flight to settle, then rebuild memory from disk."""
        self._reload_lock = getattr(self, "_reload_lock", None) or asyncio.Lock()
        async with self._reload_lock:
            while self._stale:
                while self._active or self._in_flight:
                    self._idle = asyncio.Event()
                    await self._idle.wait()
                try:
                    await asyncio.to_thread(self._recover_counted)
                except Exception as exc:
                    self._fail(exc)
                    raise RequestError("unavailable", self.fault) from None
                self._stale, self.fault = False, None
                self.log.warning("pool_reloaded_from_store", store=str(self.store_path()), **self.counts())

    def counts(self) -> dict:
        return {}

    async def durable(self, statements) -> None:
        """Return once the rows of a change already made in memory are committed (see above)."""
        if not statements:  # nothing new: rest on the writes already queued
            last = self._last
            if last is not None and not last.done():
                await asyncio.wait([last])
            if self._stale or (last is not None and (last.cancelled() or last.exception() is not None)):
                raise RequestError("unavailable", "an earlier write of this pool failed; retry")
            return
        try:
            fut = self.store.submit(statements)
        except StoreError as exc:  # memory changed but nothing was queued
            self._stale = True
            raise _store_refusal(exc) from None
        self._in_flight += 1
        self._last = fut
        fut.add_done_callback(self._write_settled)
        try:
            await asyncio.shield(fut)  # a cancelled waiter must not hide the write's outcome
        except StoreError as exc:
            self.log.error("store_write_failed", error=str(exc))
            raise RequestError("unavailable", str(exc)) from None

    def _write_settled(self, fut: asyncio.Future) -> None:
        self._in_flight -= 1
        if fut.cancelled() or fut.exception() is not None:
            self._stale = True
        self._maybe_idle()

    async def run(self) -> None:
        self.spawn(self._publish_counts(), "counts")
        await self.wait_stopped()

    async def _publish_counts(self) -> None:
        while True:
            if self.fault is None and self.refusal is None:
                self.pub.publish(f"metrics.{self.ctx.role}", PoolCount(self.ctx.role, self.ctx.id, self.counts()))
            await asyncio.sleep(self.counts_interval_s)  # the reporting period

    async def stop(self) -> None:
        await super().stop()
        if getattr(self, "server", None):
            await self.server.close()
        if getattr(self, "store", None):
            await asyncio.to_thread(self.store.close)

    def status(self) -> dict:
        if not getattr(self, "store", None):
            return {}
        health = {"serving": self.fault is None and self.refusal is None, "quarantined_rows": self.quarantined_rows}
        if self.refusal is not None or self.fault is not None:
            return {**health, "fault": self.refusal or self.fault}
        if self.store.salvaged is not None:
            health["store_salvaged"] = self.store.salvaged
        return {**self.counts(), **self.refusals.status(), **health}


def now() -> float:
    return time.time()
