"""PartialPoolRole: AppendDeltas (exactly-once by seq), queries for migration and recovery.

Durability: the single-turn deltas one request applied are one row (a chunk: the deltas in
columns, as AppendDeltaBatch carries them), so a flush of a thousand trajectories costs one row,
not a thousand; a multi-turn delta (loss mask, observation spans) is a row of its own in `deltas`.
The reply is sent after those rows commit. A chunk's row goes when the last of its trajectories
completes (state.py). Held (out-of-order) deltas are not durable and are counted
as `held` in the reply. Completing a trajectory deletes its rows and records its id, so a late
delta for it is rejected instead of resurrecting it. Restart = replay the rows in seq order.

Ownership: ReassignPartial with `fence` advances the trajectory's epoch (durable, in `owners`);
deltas carrying an older epoch are rejected from then on (state.py), so a cut-off owner that is
still running cannot write into a trajectory someone else now continues.

Lineage: a delta names the lineage epoch of its weight version (TokenDelta.lineage, the chunk's
`lineages`, the `lineage` column, -1 in rows from before it); PartialState.lineage hands it back.

A multi-turn delta's loss mask and observation spans are two more BLOB columns, NULL for a
single-turn delta. They were added after the first stores were written: a store without them gets
them at start (ALTER TABLE ADD COLUMN, which leaves the old rows NULL = all tokens the policy's).
"""
from __future__ import annotations

import asyncio
import json

from laminar.bus.auth import owned_by_other
from laminar.bus.errors import PeerUnavailable, RemoteError
from laminar.bus.rpc import RequestError, current_peer
from laminar.roles.partial_pool.awaiting import AwaitingBook
from laminar.roles.partial_pool.rows import (
    DELTA_COLUMNS,
    INSERT_DELTA,
    chunk_of,
    delta_from_row,
    delta_row,
)
from laminar.roles.partial_pool.rows import (
    MIGRATIONS as DELTA_MIGRATIONS,
)
from laminar.roles.partial_pool.rows import unbatch as _unbatch
from laminar.roles.partial_pool.state import Outcome, PartialBook
from laminar.roles.pool_base import PoolRole, now
from laminar.roles.sqlite_store import Many, pack, unpack
from pydantic import BaseModel, ConfigDict, Field

from laminar.protocol import (
    Ack,
    AppendDeltaBatch,
    AppendDeltas,
    AwaitReward,
    CompletePartial,
    DeltaResult,
    GetPartial,
    GrantPartials,
    GroupPresence,
    GroupPresenceReply,
    InFlightOf,
    LeaseRewards,
    PartialList,
    PartialState,
    PutTrajectory,
    ReassignPartial,
    RewardWork,
    ScoreResult,
    SubmitScores,
)
from laminar.protocol.data import attempt_of

GIVE_UP_CHECK_S = 1.0  # how often the pool looks for awaiting trajectories to give up on


class PartialPoolConfig(BaseModel):
    """Settings of the partial pool: held deltas, store, remembered completions."""
    model_config = ConfigDict(extra="forbid")
    max_held: int = Field(256, ge=1, description="out-of-order deltas held per trajectory")
    store_dir: str | None = Field(None, description="folder of the SQLite store (default: <workdir>/pools)")
    remember_completed: int = Field(200_000, ge=1, description="completed trajectory ids kept to refuse late "
                                    "deltas; older ones are forgotten, which bounds memory and start-up")
    max_held_only: int = Field(65_536, ge=1, description="trajectories seen only through out-of-order deltas "
                               "(no seq 0 yet) held at once; beyond it the oldest are dropped")
    page_size: int = Field(4096, ge=1, le=8192, description="most trajectories one InFlightOf reply lists (a "
                           "partial is up to five arrays, one bus frame each: 8192 stays well below the frame limit)")
    page_bytes: int = Field(8 << 20, ge=1 << 16, le=12 << 20, description="token bytes one InFlightOf reply carries "
                            "at most (below the bus's 16 MiB body limit; a page holds at least one partial)")
    experience_buffer: str = Field("0", description="id of the experience buffer that scored trajectories (those "
                                   "that awaited a model's reward here) are handed to")
    forward_retry_s: float = Field(0.2, gt=0, description="first wait before offering a scored trajectory to a "
                                   "buffer that refused it (full) or is down again; doubles up to 5 s")
    forward_window: int = Field(32, ge=1, le=1024, description="scored trajectories handed to the buffer at once "
                                "(their puts overlap, their deletes here share one commit)")
    reward_give_up_expired: int | None = Field(5, ge=1, description="expired leases of one trajectory for one "
                                               "scorer (its replicas died, hung or failed on it) after which the "
                                               "pool stops waiting and applies `reward_fallback`, flagged "
                                               "(docs/rewards.md); None: never")
    reward_give_up_s: float | None = Field(None, gt=0, description="seconds a trajectory may await a scorer before "
                                           "the pool applies `reward_fallback`, flagged (None: wait for ever)")
    reward_fallback: float = Field(0.0, description="the score a scorer given up on counts as (its weight applies)")


SCHEMA = """
CREATE TABLE IF NOT EXISTS deltas (tid TEXT, seq INTEGER, owner TEXT, version INTEGER, spec BLOB,
                                   tokens BLOB, logprobs BLOB, mask BLOB, spans BLOB, lineage INTEGER DEFAULT -1,
                                   routing BLOB, PRIMARY KEY (tid, seq));
CREATE TABLE IF NOT EXISTS owners (tid TEXT PRIMARY KEY, owner TEXT, epoch INTEGER DEFAULT 0);
CREATE TABLE IF NOT EXISTS completed (tid TEXT PRIMARY KEY);
CREATE TABLE IF NOT EXISTS chunks (id INTEGER PRIMARY KEY, owner TEXT, blob BLOB);
CREATE TABLE IF NOT EXISTS awaiting (tid TEXT PRIMARY KEY, blob BLOB, pending TEXT, scores TEXT);
"""


class PartialPoolRole(PoolRole):
    """Keeps every in-flight trajectory's tokens and owner, durably, so no failure loses work."""
    name = "partial_pool"
    Config = PartialPoolConfig
    SCHEMA = SCHEMA

    SCHEMA_VERSION = 7  # v4: chunks (a new table); v5: deltas.lineage; v6: awaiting (a new table); v7: deltas.routing
    MIGRATIONS = DELTA_MIGRATIONS

    def recover(self) -> None:
        st = PartialBook(self.cfg.max_held, self.cfg.remember_completed, self.cfg.max_held_only)
        for (tid,) in self.store.read("SELECT tid FROM completed ORDER BY rowid"):
            st.completed[tid] = None
        rows = self.store.read(f"SELECT {DELTA_COLUMNS} FROM deltas ORDER BY tid, seq")
        bad: set[str] = set()
        for row in rows:
            tid, seq, owner, spec = row[0], row[1], row[2], row[4]
            if tid in bad:
                continue
            try:
                d = delta_from_row(*row)
            except Exception as exc:  # a damaged record: the trajectory's rows go aside, the rest serves
                bad.add(tid)
                st.entries.pop(tid, None)
                self.quarantine("deltas", f"{tid}#{seq}", spec, f"{type(exc).__name__}: {exc}",
                                [("INSERT INTO quarantined SELECT 'deltas', tid || '#' || seq, tokens, "
                                  "'rest of a quarantined trajectory', ? FROM deltas WHERE tid = ? AND seq != ?",
                                  (now(), tid, seq)),
                                 ("DELETE FROM deltas WHERE tid = ?", (tid,)),
                                 ("DELETE FROM owners WHERE tid = ?", (tid,))])
                continue
            st.apply(owner, [d])
        self._replay_chunks(st)
        st.forget_old()  # a store written with a larger memory (or before it was bounded)
        if st.forgotten:
            self.store.write_sync(self._forget(st))
        for tid, owner, epoch in self.store.read("SELECT tid, owner, epoch FROM owners"):
            if tid in st.entries:
                st.entries[tid].owner, st.entries[tid].epoch = owner, epoch or 0
        self.state = st
        self.awaiting = self._recover_awaiting()

    def _recover_awaiting(self) -> AwaitingBook:
        book = AwaitingBook(self.cfg.remember_completed, self.cfg.reward_give_up_expired, self.cfg.reward_give_up_s)
        for tid, blob, pending, scores in self.store.read("SELECT tid, blob, pending, scores FROM awaiting "
                                                          "ORDER BY rowid"):
            try:
                book.add(unpack(blob), json.loads(pending), {s: tuple(x) for s, x in json.loads(scores).items()})
            except Exception as exc:  # a damaged record: set aside (its prompt is requeued as lost)
                self.quarantine("awaiting", tid, blob, f"{type(exc).__name__}: {exc}",
                                [("DELETE FROM awaiting WHERE tid = ?", (tid,))])
        book.counts.clear()
        return book

    def _replay_chunks(self, st: PartialBook) -> None:
        held, st.max_held = st.max_held, 1 << 30  # the two tables interleave: nothing may be refused for a gap
        self.next_chunk = 1
        for cid, owner, blob in self.store.read("SELECT id, owner, blob FROM chunks ORDER BY id"):
            self.next_chunk = cid + 1
            try:
                req = unpack(blob)
                deltas = _unbatch(req)
            except Exception as exc:  # a damaged chunk: set aside (its trajectories lose these deltas)
                self.quarantine("chunks", str(cid), blob, f"{type(exc).__name__}: {exc}",
                                [("DELETE FROM chunks WHERE id = ?", (cid,))])
                continue
            st.apply(owner, deltas, checked=True)
            st.add_chunk(cid, req.trajectory_ids)
        st.max_held = held
        if st.dead_chunks:
            self.store.write_sync(self._drop_chunks(st))

    @staticmethod
    def _drop_chunks(st: PartialBook) -> list:
        dead, st.dead_chunks = st.dead_chunks, []
        return [("DELETE FROM chunks WHERE id = ?", Many((c,) for c in dead))] if dead else []

    def routes(self) -> None:
        self.route(AppendDeltas, self.on_append)
        self.route(AppendDeltaBatch, self.on_append_batch)
        self.route(InFlightOf, self.on_in_flight, changes=False)
        self.route(GetPartial, self.on_get, changes=False)
        self.route(ReassignPartial, self.on_reassign)
        self.route(GrantPartials, self.on_grant, changes=False)
        self.route(CompletePartial, self.on_complete)
        self.route(GroupPresence, self.on_presence, changes=False)
        self.route(AwaitReward, self.on_await_reward)
        self.route(LeaseRewards, self.on_lease_rewards, changes=False)  # leases live in memory only
        self.route(SubmitScores, self.on_submit_scores)

    async def on_append(self, req: AppendDeltas) -> DeltaResult:
        deltas, out = self._own(list(req.deltas))
        self.state.apply(req.rollout_id, deltas, out)
        await self.durable(self._rows(out, req.rollout_id))
        return DeltaResult(applied=len(out.applied), duplicates=out.duplicates, held=out.held, rejected=out.rejected)

    async def on_append_batch(self, req: AppendDeltaBatch) -> DeltaResult:
        """The columnar AppendDeltas: unpacked into deltas (views into the request's arrays)."""
        everything = _unbatch(req)
        deltas, out = self._own(everything)
        self.state.apply(req.rollout_id, deltas, out, checked=True)
        whole = len(out.applied) == len(everything) and req.loss_mask is None and all(
            d is a for (_, d), a in zip(out.applied, deltas, strict=False))
        await self.durable(self._rows(out, req.rollout_id, req if whole else None))
        return DeltaResult(applied=len(out.applied), duplicates=out.duplicates, held=out.held, rejected=out.rejected)

    def _own(self, deltas: list) -> tuple[list, Outcome]:
        """A rollout key named after a rollout writes only into trajectories it owns (or new ones):
        before, writing the next delta into another rollout's trajectory made the writer its owner.
        The others are rejected as `fenced off` (the writer stops them, as after a fence); a delta
        of an older epoch is left to `apply`, which rejects it as fenced off too."""
        out = Outcome()
        peer = current_peer.get()
        if not (peer or "").startswith("rollout."):
            return deltas, out
        entries = self.state.entries
        for d in deltas:
            e = entries.get(d.trajectory_id)
            if e is not None and d.epoch >= e.epoch and owned_by_other(peer, e.owner):
                owner = e.owner or "(none: released)"
                out.rejected[d.trajectory_id] = f"fenced off: owned by rollout {owner}, not {peer}"
        return ([d for d in deltas if d.trajectory_id not in out.rejected] if out.rejected else deltas), out

    def _rows(self, out: Outcome, owner: str, whole: AppendDeltaBatch | None = None) -> list:
        """The applied deltas' rows: one chunk when all are single-turn, else a row each in one
        executemany (nothing if none was applied). `whole`: the request, when exactly its deltas
        were applied, in its order (the chunk is then the request itself)."""
        if not out.applied:
            return []
        if whole is None and all(d.loss_mask is None and d.obs_spans is None for _, d in out.applied):
            whole = chunk_of(owner, [d for _, d in out.applied])
        if whole is not None:
            cid, self.next_chunk = self.next_chunk, self.next_chunk + 1
            self.state.add_chunk(cid, whole.trajectory_ids)
            return [("INSERT INTO chunks (id, owner, blob) VALUES (?, ?, ?)", (cid, owner, pack(whole)))]
        return [(INSERT_DELTA, Many(delta_row(owner, d) for owner, d in out.applied))]

    async def on_in_flight(self, req: InFlightOf) -> PartialList:
        """One page, in trajectory id order after `req.after`: at most `page_size` partials (or
        `limit`) and `page_bytes` of their arrays (at least one), so any population in flight is
        listed through bounded replies. An id completed between two pages is simply not listed; one
        created meanwhile is listed if it sorts after the cursor (a live owner's new work)."""
        limit = min(req.limit or self.cfg.page_size, self.cfg.page_size)
        tids = sorted(t for t, e in self.state.entries.items()
                      if e.spec is not None and t > req.after
                      and (req.rollout_id in ("", "*") or e.owner == req.rollout_id))
        out, size = [], 0
        for t in tids[:limit]:
            e = self.state.entries[t]
            n = sum(len(x) for x in e.tokens) * 8 + len(e.spec.prompt_tokens) * 4 + sum(r.nbytes for r in e.routing)
            if out and size + n > self.cfg.page_bytes:
                break
            out.append(e.state())
            size += n
        return PartialList(out, more=len(out) < len(tids), next_after=out[-1].spec.trajectory_id if out else req.after)

    def _entry(self, tid: str):
        e = self.state.live().get(tid)
        if e is None:
            why = "completed" if tid in self.state.completed else "unknown"
            raise RequestError("refused", f"trajectory {tid!r} is {why} in the partial pool")
        return e

    async def on_get(self, req: GetPartial) -> PartialState:
        e = self._entry(req.trajectory_id)
        if owned_by_other(current_peer.get(), e.owner):  # scoped keys: a rollout reads only its own work
            raise RequestError("refused", f"forbidden: {current_peer.get()} may not read {req.trajectory_id} "
                                          f"of rollout {e.owner}")
        return e.state()

    async def on_presence(self, req: GroupPresence) -> GroupPresenceReply:
        """Members of these groups in flight here (any owner, restarted copies `~r<n>` included).
        With `attempts`, a member counts only under the attempt current for it: a member of an
        older attempt is not the new attempt's (if its rollout dies, nothing would run it again)."""
        want = set(req.group_ids)
        attempts = req.attempts or {}
        present: dict[str, list[int]] = {}
        # in flight, or finished and awaiting a model's score (safe here too): the same attempt rule
        specs = [e.spec for e in self.state.live().values()] + [a.traj.spec for a in self.awaiting.items.values()]
        for spec in specs:
            g, i = spec.group_id, spec.sample_index
            if g not in want:
                continue
            current = attempts.get(f"{g}/{i}", attempts.get(g))
            if current is not None and attempt_of(spec.trajectory_id) != current:
                continue
            present.setdefault(g, []).append(i)
        return GroupPresenceReply(present)

    async def on_reassign(self, req: ReassignPartial) -> Ack:
        e = self._entry(req.trajectory_id)
        peer = current_peer.get()
        if not req.rollout_id and owned_by_other(peer, e.owner):  # giving up another's work
            raise RequestError("refused", f"forbidden: {peer} may not release {req.trajectory_id} "
                                          f"of rollout {e.owner}")
        if req.rollout_id and owned_by_other(peer, e.owner) and not self.state.may_claim(req.trajectory_id,
                                                                                        req.rollout_id):
            raise RequestError("refused", f"forbidden: {peer} may not take over {req.trajectory_id} of rollout "
                                          f"{e.owner!r}: neither its owner nor granted it by the manager")
        if req.fence:
            self.state.fence(req.trajectory_id, req.rollout_id)
        else:
            self.state.reassign(req.trajectory_id, req.rollout_id)
        await self.durable([("INSERT OR REPLACE INTO owners (tid, owner, epoch) VALUES (?, ?, ?)",
                             (req.trajectory_id, req.rollout_id, e.epoch))])
        return Ack(f"epoch {e.epoch}" if req.fence else "")

    async def on_grant(self, req: GrantPartials) -> Ack:
        """The manager's MigrateIn is about to hand these to `rollout_id` (state.py, Claims); kept in
        memory only: a grant lost with a restart makes the claim refused, and the manager places the
        trajectory again."""
        return Ack(f"granted {self.state.grant(req.trajectory_ids, req.rollout_id)}")

    async def on_complete(self, req: CompletePartial) -> Ack:
        peer = current_peer.get()
        theirs = [t for t in req.trajectory_ids
                  if t in self.state.entries and owned_by_other(peer, self.state.entries[t].owner)]
        if theirs:  # scoped keys: a rollout completes only its own trajectories
            raise RequestError("refused", f"forbidden: {peer} may not complete {theirs[:4]} (owned by rollout "
                                          f"{self.state.entries[theirs[0]].owner})")
        stmts = []
        for tid in req.trajectory_ids:
            self.state.complete(tid)
            stmts += [("DELETE FROM deltas WHERE tid = ?", (tid,)), ("DELETE FROM owners WHERE tid = ?", (tid,)),
                      ("INSERT OR IGNORE INTO completed VALUES (?)", (tid,))]
        await self.durable(stmts + self._drop_chunks(self.state) + self._forget(self.state))
        return Ack()

    @staticmethod
    def _forget(st: PartialBook) -> list:
        gone, st.forgotten = st.forgotten, []
        return [("DELETE FROM completed WHERE tid = ?", (t,)) for t in gone]

    # -- awaiting model scores (awaiting.py; docs/rewards.md) ------------------------------------
    async def on_await_reward(self, req: AwaitReward) -> Ack:
        """A finished trajectory leaves the in-flight set and waits here for its model scores;
        durable before the reply, so the rollout forgets it then. Idempotent by trajectory id."""
        traj = req.trajectory
        tid = traj.spec.trajectory_id
        e = self.state.entries.get(tid)
        if e is not None and owned_by_other(current_peer.get(), e.owner):
            raise RequestError("refused", f"forbidden: {current_peer.get()} may not finish {tid} (owned by rollout "
                                          f"{e.owner})")
        if not req.pending:
            raise RequestError("bad_request", f"{tid}: AwaitReward names no scorer (pending is empty); a trajectory "
                                              "scored by rule functions alone goes to the buffer")
        if tid in self.awaiting.items or tid in self.awaiting.done or tid in self.state.completed:
            await self.durable([])  # a retry: acknowledged once the original is durable
            return Ack("duplicate")
        self.awaiting.add(traj, req.pending)
        self.state.complete(tid)
        pending, scores = self.awaiting.row(tid)
        await self.durable([("DELETE FROM deltas WHERE tid = ?", (tid,)), ("DELETE FROM owners WHERE tid = ?", (tid,)),
                            ("INSERT OR IGNORE INTO completed VALUES (?)", (tid,)),
                            ("INSERT OR REPLACE INTO awaiting VALUES (?, ?, ?, ?)", (tid, pack(traj), pending, scores))]
                           + self._drop_chunks(self.state) + self._forget(self.state))
        return Ack()

    async def on_lease_rewards(self, req: LeaseRewards) -> RewardWork:
        if req.max_items < 1 or not req.lease_s > 0:
            raise RequestError("bad_request", f"max_items {req.max_items} and lease_s {req.lease_s} must be positive")
        work = self.awaiting.lease(req.replica_id, req.scorer, req.max_items, req.lease_s)
        return RewardWork(work, waiting=self.awaiting.waiting(req.scorer))

    async def on_submit_scores(self, req: SubmitScores) -> ScoreResult:
        """Each score applied once (durable before the reply); a trajectory with every score goes
        to the buffer (`_forward`)."""
        if len(req.trajectory_ids) != len(req.scores):
            raise RequestError("bad_request", f"{len(req.trajectory_ids)} trajectory ids but {len(req.scores)} scores")
        applied, refused = self.awaiting.submit(req.scorer, req.trajectory_ids, req.scores, req.parse_failed)
        if refused:
            self.log.warning("scores_refused", scorer=req.scorer, replica=req.replica_id, count=len(refused),
                             first=dict(list(refused.items())[:4]))
        stmts = [("UPDATE awaiting SET pending = ?, scores = ? WHERE tid = ?", (*self.awaiting.row(t), t))
                 for t in applied]
        await self.durable(stmts)
        if self.awaiting.ready():
            self._scored.set()
        return ScoreResult(applied=len(applied), refused=refused)

    async def run(self) -> None:
        self._scored = asyncio.Event()
        if self.awaiting.ready():
            self._scored.set()
        self.spawn(self._forward(), "forward")
        self.spawn(self._give_up(), "give_up")
        await super().run()

    async def _give_up(self) -> None:
        """Score by the fallback what its scorer failed on too often or too long (awaiting.py)."""
        while True:
            await asyncio.sleep(GIVE_UP_CHECK_S)  # a periodic sweep: give-ups need no precise timing
            given = self.awaiting.give_up(self.cfg.reward_fallback)
            if not given:
                continue
            await self.durable([("UPDATE awaiting SET pending = ?, scores = ? WHERE tid = ?",
                                 (*self.awaiting.row(t), t)) for t in dict.fromkeys(t for t, _, _ in given)])
            for tid, scorer, why in given:
                self.log.error("reward_gave_up", trajectory=tid, scorer=scorer, why=why,
                               fallback=self.cfg.reward_fallback)
            if self.awaiting.ready():
                self._scored.set()

    async def _forward(self) -> None:
        """Hand every fully scored trajectory to the experience buffer (PutTrajectory until it
        holds it: stored or duplicate), then forget it here. Nothing leaves unscored. Up to
        `forward_window` go at once: their puts overlap and their deletes share one commit."""
        buffer = None
        while True:
            await self._scored.wait()
            self._scored.clear()
            ready = self.awaiting.ready()
            if ready and buffer is None:
                buffer = self.ctx.transport.client(self.cluster.endpoint("experience_buffer",
                                                                         self.cfg.experience_buffer))
            w = self.cfg.forward_window
            for i in range(0, len(ready), w):
                await asyncio.gather(*(self._forward_one(buffer, tid) for tid in ready[i:i + w]))

    async def _forward_one(self, buffer, tid: str) -> None:
        """One scored trajectory into the buffer (retried with backoff while it is full or down),
        then deleted here; the delete's commit is shared with the others of its window."""
        traj = self.awaiting.final(tid)
        delay = self.cfg.forward_retry_s
        while True:
            try:
                put = await buffer.call(PutTrajectory(traj), timeout=5.0)
                if put.status in ("stored", "duplicate"):
                    break
                why = f"{put.status}: {put.detail}"
            except (PeerUnavailable, RemoteError) as exc:
                why = str(exc)
            self.awaiting.counts["forward_retries"] += 1
            self.log.warning("scored_put_retry", trajectory=tid, why=why, retry_in_s=delay)
            await asyncio.sleep(delay)  # backoff: the buffer is full or down; the item stays durable here
            delay = min(delay * 2, 5.0)
        try:
            await self.durable([("DELETE FROM awaiting WHERE tid = ?", (tid,))])
        except RequestError as exc:  # the buffer holds it; a later round forgets it here (duplicate)
            self.log.warning("forward_record_failed", trajectory=tid, error=str(exc))
            await asyncio.sleep(delay)  # backoff: the store is refusing writes
            self._scored.set()
            return
        self.awaiting.forwarded(tid)
        # the provenance ledger's line for a trajectory that awaited its reward here
        self.log.info("trajectory_stored", trajectory=tid, version=traj.version, lineage=traj.lineage,
                      tokens=len(traj.response_tokens), status=put.status, reward=round(traj.reward, 4),
                      components={k: round(v, 4) for k, v in traj.reward_components.items()},
                      rollout=traj.rollout_id, via="partial_pool")

    def counts(self) -> dict:
        live = self.state.live()
        return {"in_flight": len(live), "tokens": int(sum(sum(len(t) for t in e.tokens) for e in live.values())),
                "completed": len(self.state.completed), "chunks": len(self.state.chunk_live),
                **self.awaiting.stats()}

