"""ExperienceBufferRole: PutTrajectory (idempotent), SampleGroups, BufferStatsRequest.

Durability: a stored trajectory is a row (its event as a BLOB); handing out / dropping / evicting
a group deletes its rows and records the group id with why, in the same transaction, after which
the reply goes out. A restarted buffer replays the rows (in arrival order) and the removed group
ids, so nothing acknowledged is lost and nothing handed out is handed out again — except on
purpose: a trainer that checkpoints sends `committed`, and the groups it was handed after that
stay leased (rows kept, position in `handed`) until a later `committed` passes them; a request
whose `cursor` is behind gets them again (state.py, Leases).
"""
from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, Field

from laminar.protocol import (BufferStats, BufferStatsRequest, GroupPresence, GroupPresenceReply, PutResult,
                              PutTrajectory, SampleGroups, Samples)
from laminar.roles.experience_buffer.state import BufferBook, Change
from laminar.roles.pool_base import PoolRole
from laminar.roles.sqlite_store import pack, unpack


class ExperienceBufferConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    capacity: int = Field(100_000, ge=1, description="most trajectories stored (complete groups or not)")
    eviction: str = Field("drop_oldest", pattern="^(drop_oldest|reject)$", description="what to do when full")
    sampler: str = Field("fifo", description="fifo | freshest")
    max_staleness: int | None = Field(None, ge=0, description="drop groups older than this many versions (None: keep all)")
    store_dir: str | None = Field(None, description="folder of the SQLite store (default: <workdir>/pools)")
    remember_removed: int = Field(200_000, ge=1, description="removed (handed, stale, evicted) group ids kept to "
                                  "refuse late duplicates; older ones are forgotten, which bounds memory and start-up")


SCHEMA = """
CREATE TABLE IF NOT EXISTS trajs (n INTEGER PRIMARY KEY AUTOINCREMENT, tid TEXT UNIQUE, gid TEXT, blob BLOB);
CREATE INDEX IF NOT EXISTS trajs_gid ON trajs (gid);
CREATE TABLE IF NOT EXISTS gone (gid TEXT PRIMARY KEY, why TEXT);
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT);
CREATE TABLE IF NOT EXISTS handed (pos INTEGER PRIMARY KEY, gid TEXT);
"""


class ExperienceBufferRole(PoolRole):
    name = "experience_buffer"
    Config = ExperienceBufferConfig
    SCHEMA = SCHEMA
    MIGRATABLE = frozenset({"capacity"})

    def fingerprint(self) -> dict:
        return {"capacity": self.cfg.capacity}

    def migrate_setting(self, key: str, old, new) -> None:
        """A new capacity: growing needs nothing; shrinking with drop_oldest evicts the oldest groups
        now, on disk too (with reject, new groups wait until enough are sampled)."""
        b, ch = self.book, Change()
        if self.cfg.eviction == "drop_oldest":
            while b.stored > b.capacity and b.groups:
                victim = next((x for x in b.groups.values() if x.complete), None) or next(iter(b.groups.values()))
                b._remove(victim.group_id, "evicted", ch)
                b.counts["evicted"] += 1
        if ch.removed_groups:
            self.store.write_sync(self._statements(ch))
        self.log.warning("buffer_capacity_changed", old=old, new=new, evicted_groups=len(ch.removed_groups),
                         stored=b.stored)

    def _max_staleness(self) -> int | None:
        """A barrier mode bounds staleness (sync 0, one_step and stream 1): groups that finish too
        late for it are dropped (and counted), as those systems' global sync would never train them."""
        cfg, bound = self.ctx.config, self.cfg.max_staleness
        lag = cfg.run.barrier_lag if cfg is not None else None
        if lag is not None and (bound is None or bound > lag):
            self.log.info("staleness_bound_from_mode", mode=cfg.run.mode, max_staleness=lag, configured=bound)
            return lag
        return bound

    def recover(self) -> None:
        c = self.cfg
        # replayed with room for every stored row, so replay never refuses what was acknowledged (a
        # capacity that shrank is applied afterwards, on disk too: migrate_setting)
        book = BufferBook(1 << 62, c.eviction, c.sampler, self._max_staleness(), c.remember_removed)
        for gid, why in self.store.read("SELECT gid, why FROM gone ORDER BY rowid"):
            book.gone[gid] = why
        for n, gid, blob in self.store.read("SELECT n, gid, blob FROM trajs ORDER BY n"):
            if gid not in book.gone:  # a leased group's rows: kept for a re-hand, not sampleable
                try:
                    t = unpack(blob)
                except Exception as exc:  # a damaged record: set aside, the rest serves
                    self.quarantine("trajs", f"{gid}#{n}", blob, f"{type(exc).__name__}: {exc}",
                                    [("DELETE FROM trajs WHERE n = ?", (n,))])
                    continue
                book.put(t)
        book.leased.update(self.store.read("SELECT pos, gid FROM handed ORDER BY pos"))
        meta = dict(self.store.read("SELECT k, v FROM meta"))
        book.cursor = int(meta.get("cursor", 0))
        book.staleness.update({int(k): v for k, v in json.loads(meta.get("staleness", "{}")).items()})
        book.counts.update(json.loads(meta.get("counts", "{}")))
        book.capacity = c.capacity
        self.book = book
        ch = Change()
        book.forget_old(ch)  # a store written with a larger memory (or before it was bounded)
        if ch.forgotten:
            self.store.write_sync(self._statements(ch))

    def routes(self) -> None:
        self.route(PutTrajectory, self.on_put)
        self.route(SampleGroups, self.on_sample)
        self.route(BufferStatsRequest, self.on_stats, changes=False)
        self.route(GroupPresence, self.on_presence, changes=False)

    def _statements(self, ch: Change) -> list:
        st = [("INSERT OR IGNORE INTO trajs (tid, gid, blob) VALUES (?, ?, ?)",
               (t.spec.trajectory_id, t.spec.group_id, pack(t))) for t in ch.put]
        leased = {gid for _, gid in ch.leased}
        for gid, why in ch.removed_groups:
            if gid not in leased:
                st.append(("DELETE FROM trajs WHERE gid = ?", (gid,)))
            st.append(("INSERT OR REPLACE INTO gone VALUES (?, ?)", (gid, why)))
        st += [("DELETE FROM gone WHERE gid = ?", (gid,)) for gid in ch.forgotten]
        st += [("INSERT OR REPLACE INTO handed VALUES (?, ?)", lease) for lease in ch.leased]
        if ch.released_below is not None:
            st += [("DELETE FROM trajs WHERE gid IN (SELECT gid FROM handed WHERE pos < ?)", (ch.released_below,)),
                   ("DELETE FROM handed WHERE pos < ?", (ch.released_below,))]
        if ch.removed_groups:
            b = self.book
            st += [("INSERT OR REPLACE INTO meta VALUES ('cursor', ?)", (str(b.cursor),)),
                   ("INSERT OR REPLACE INTO meta VALUES ('staleness', ?)", (json.dumps(dict(b.staleness)),)),
                   ("INSERT OR REPLACE INTO meta VALUES ('counts', ?)", (json.dumps(dict(b.counts)),))]
        return st

    async def on_put(self, req: PutTrajectory) -> PutResult:
        status, ch = self.book.put(req.trajectory)
        await self.durable(self._statements(ch))
        head, _, detail = status.partition(": ")
        return PutResult(head, detail)

    async def on_sample(self, req: SampleGroups) -> Samples:
        b, released = self.book, Change()
        if req.committed is not None:
            b.release(req.committed, released)
        if req.cursor is not None and req.cursor < b.cursor:  # behind us: leased groups again, in order
            gids, after = b.rehand(req.cursor, req.num_groups)
            if gids:
                groups = [await self._leased_group(g) for g in gids]
                await self.durable(self._statements(released))
                self.log.info("groups_handed_again", position=req.cursor, groups=len(gids), buffer_cursor=b.cursor)
                return Samples(groups=[g for g in groups if g], cursor=after)
        elif req.cursor is not None and req.cursor > b.cursor:
            self.log.warning("trainer_cursor_ahead", trainer_cursor=req.cursor, buffer_cursor=b.cursor)
        groups, dropped, ch = b.sample(req.num_groups, req.trainer_version, lease=req.committed is not None)
        ch.released_below = released.released_below
        await self.durable(self._statements(ch))
        return Samples(groups=groups, cursor=b.cursor, dropped_stale=dropped)

    async def _leased_group(self, gid: str) -> list:
        rows = await self.store.aread("SELECT blob FROM trajs WHERE gid = ? ORDER BY n", (gid,))
        if not rows:
            self.log.error("leased_group_missing", group=gid)
        return sorted((unpack(blob) for (blob,) in rows), key=lambda t: t.spec.sample_index)

    async def on_presence(self, req: GroupPresence) -> GroupPresenceReply:
        """Members stored here; [-1] for a group already handed out, dropped or evicted."""
        b, present = self.book, {}
        for gid in req.group_ids:
            if gid in b.gone:
                present[gid] = [-1]
            elif gid in b.groups:
                present[gid] = sorted(t.spec.sample_index for t in b.groups[gid].members.values())
        return GroupPresenceReply(present)

    async def on_stats(self, req: BufferStatsRequest) -> BufferStats:
        return BufferStats(self.book.stats(), {str(k): v for k, v in sorted(self.book.staleness.items())})

    def counts(self) -> dict:
        return self.book.stats()
