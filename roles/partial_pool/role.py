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

import dataclasses
import json

from laminar.bus.auth import owned_by_other
from laminar.bus.rpc import RequestError, current_peer
from laminar.roles.handout import NOT_HANDED, checked
from laminar.roles.partial_pool.awaiting import AwaitingBook
from laminar.roles.partial_pool.columns import all_own, apply_continuing, check_batch, continues, unbatch
from laminar.roles.partial_pool.config import PartialPoolConfig
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
from laminar.roles.partial_pool.scoring import RewardDesk
from laminar.roles.partial_pool.state import Outcome, PartialBook
from laminar.roles.pool_base import PoolRole, now
from laminar.roles.sqlite_store import Many, pack, unpack

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
    ReassignPartial,
    SubmitScores,
)
from laminar.protocol.data import attempt_of

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
        c = self.settings
        st = PartialBook(c.max_held, c.remember_completed, c.max_held_only, c.max_held_bytes)
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
                st.drop_entry(tid)
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
        c = self.settings
        book = AwaitingBook(c.remember_completed, c.reward_give_up_expired, c.reward_give_up_s, c.reward_never_leased_s,
                            c.max_awaiting, c.max_awaiting_bytes, c.lease_shared_after_s)
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
        # the two tables interleave: nothing may be refused for a gap, by count or by bytes
        (held, held_bytes), (st.max_held, st.max_held_bytes) = (st.max_held, st.max_held_bytes), (1 << 30, 1 << 62)
        self.next_chunk = 1
        for cid, owner, blob in self.store.read("SELECT id, owner, blob FROM chunks ORDER BY id"):
            self.next_chunk = cid + 1
            try:
                req = unpack(blob)
                deltas = unbatch(req)
            except Exception as exc:  # a damaged chunk: set aside (its trajectories lose these deltas)
                self.quarantine("chunks", str(cid), blob, f"{type(exc).__name__}: {exc}",
                                [("DELETE FROM chunks WHERE id = ?", (cid,))])
                continue
            st.apply(owner, deltas, checked=True)
            st.add_chunk(cid, req.trajectory_ids)
        st.max_held, st.max_held_bytes = held, held_bytes
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
        self.desk = RewardDesk(lambda: self.awaiting, self.settings, self.durable, self._buffer, self.log,
                               self.refusals)
        self.route(LeaseRewards, self.desk.lease, changes=False)  # leases live in memory only
        self.route(SubmitScores, self.desk.submit)

    async def on_append(self, req: AppendDeltas) -> DeltaResult:
        deltas, out = self._own(list(req.deltas), req.rollout_id, AppendDeltas.kind)
        self.state.apply(req.rollout_id, deltas, out)
        await self.durable(self._rows(out, req.rollout_id))
        return DeltaResult(applied=len(out.applied), duplicates=out.duplicates, held=out.held, rejected=out.rejected)

    async def on_append_batch(self, req: AppendDeltaBatch) -> DeltaResult:
        """The columnar AppendDeltas: the common flush applied as a whole (columns.py), any other
        unpacked into deltas (views into the request's arrays) for the rules of state.py."""
        check_batch(req)
        peer = current_peer.get()
        found = continues(self.state, req, peer if checked(peer) else None)
        if found is not None:
            cid, self.next_chunk = self.next_chunk, self.next_chunk + 1
            n = apply_continuing(self.state, found, req, req.rollout_id, cid)
            await self.durable([("INSERT INTO chunks (id, owner, blob) VALUES (?, ?, ?)", (cid, req.rollout_id,
                                                                                            pack(req)))])
            return DeltaResult(applied=n, duplicates=0, held=0, rejected={})
        everything = unbatch(req)
        deltas, out = self._own(everything, req.rollout_id, AppendDeltaBatch.kind)
        self.state.apply(req.rollout_id, deltas, out, checked=True)
        whole = len(out.applied) == len(everything) and req.loss_mask is None and req.obs_spans is None and all(
            d is a for (_, d), a in zip(out.applied, deltas, strict=False))
        await self.durable(self._rows(out, req.rollout_id, req if whole else None))
        return DeltaResult(applied=len(out.applied), duplicates=out.duplicates, held=out.held, rejected=out.rejected)

    def _own(self, deltas: list, rollout_id: str, kind: str) -> tuple[list, Outcome]:
        """A rollout key writes only into trajectories it owns, and creates only those handed to
        the rollout it writes as: a trajectory not in flight here starts with its seq 0, whose spec
        carries the prompt pool's hand-out for `rollout_id` (roles/handout.py). Before, writing
        the first delta under another rollout's (predictable) id made the writer its owner, and
        writing the next delta into another rollout's trajectory did too. The others are rejected:
        `fenced off` (the writer stops them, as after a fence) or `not handed out` (refused and
        counted against the key: the pool's writes_refused alarm). A delta of an older epoch is
        left to `apply`, which rejects it as fenced off too. One keyed hash per new trajectory,
        none per delta."""
        out = Outcome()
        peer = current_peer.get()
        if not checked(peer):
            return deltas, out
        st = self.state
        if all_own(st.entries, deltas, peer):
            return deltas, out  # the usual flush: nothing new, nothing of another's (set operations)
        entries, completed, handed = st.entries, st.completed, set()
        for d in deltas:
            tid = d.trajectory_id
            e = entries.get(tid)
            if e is not None and e.spec is not None:
                if d.epoch >= e.epoch and owned_by_other(peer, e.owner):
                    out.rejected[tid] = f"fenced off: owned by rollout {e.owner or '(none: released)'}, not {peer}"
                continue
            if tid in completed or tid in handed or tid in out.rejected:
                continue  # `apply` refuses a completed one; the rest follow their seq 0
            why = (self.handouts.refusal(d.spec, rollout_id) if d.seq == 0 else
                   f"{NOT_HANDED}: {tid} is not in flight here and seq {d.seq} carries no spec (seq 0 comes first)")
            if why:
                out.rejected[tid] = why
                continue
            handed.add(tid)
            if e is not None:  # deltas held for it that someone else wrote before its seq 0: never applied
                st.forget_held_only(tid)
        if refused := [t for t, why in out.rejected.items() if why.startswith(NOT_HANDED)]:
            self.refusals.record(peer, kind, refused, out.rejected[refused[0]])
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
        limit = min(req.limit or self.settings.page_size, self.settings.page_size)
        tids = sorted(t for t, e in self.state.entries.items()
                      if e.spec is not None and t > req.after
                      and (req.rollout_id in ("", "*") or e.owner == req.rollout_id))
        out, size = [], 0
        for t in tids[:limit]:
            e = self.state.entries[t]
            n = sum(len(x) for x in e.tokens) * 8 + len(e.spec.prompt_tokens) * 4 + sum(r.nbytes for r in e.routing)
            if out and size + n > self.settings.page_bytes:
                break
            out.append(e.state())
            size += n
        return PartialList(out, more=len(out) < len(tids), next_after=out[-1].spec.trajectory_id if out else req.after)

    def _entry(self, tid: str):
        e = self.state.live_entry(tid)
        if e is None:
            why = "completed" if tid in self.state.completed else "unknown"
            raise RequestError("refused", f"trajectory {tid!r} is {why} in the partial pool")
        return e

    async def on_get(self, req: GetPartial) -> PartialState:
        e = self._entry(req.trajectory_id)
        if owned_by_other(current_peer.get(), e.owner):  # scoped keys: a rollout reads only its own work
            raise RequestError("refused", f"forbidden: {current_peer.get()} may not read {req.trajectory_id} "
                                          f"of rollout {e.owner}")
        st = e.state()  # signed for its owner: a rollout that took it over (granted) stores it with this
        return dataclasses.replace(st, spec=self.handouts.sign(st.spec, e.owner)) if e.owner else st

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
        peer = current_peer.get()
        if e is not None and owned_by_other(peer, e.owner):
            raise RequestError("refused", f"forbidden: {peer} may not finish {tid} (owned by rollout {e.owner})")
        if checked(peer) and (why := self._await_refusal(req)):
            self.refusals.record(peer, AwaitReward.kind, [tid], why)
            raise RequestError("refused", why)
        if not req.pending:
            raise RequestError("bad_request", f"{tid}: AwaitReward names no scorer (pending is empty); a trajectory "
                                              "scored by rule functions alone goes to the buffer")
        if tid in self.awaiting.items or tid in self.awaiting.done or tid in self.state.completed:
            await self.durable([])  # a retry: acknowledged once the original is durable
            return Ack("duplicate")
        if why := self.awaiting.full():  # backpressure: the rollout keeps it and asks again
            raise RequestError("busy", why)
        self.awaiting.add(traj, req.pending)
        self.state.complete(tid)
        pending, scores = self.awaiting.row(tid)
        await self.durable([("DELETE FROM deltas WHERE tid = ?", (tid,)), ("DELETE FROM owners WHERE tid = ?", (tid,)),
                            ("INSERT OR IGNORE INTO completed VALUES (?)", (tid,)),
                            ("INSERT OR REPLACE INTO awaiting VALUES (?, ?, ?, ?)", (tid, pack(traj), pending, scores))]
                           + self._drop_chunks(self.state) + self._forget(self.state))
        return Ack()

    def _await_refusal(self, req: AwaitReward) -> str:
        """Why a rollout key may not hand this trajectory over to await scores ("" = it may): the
        spec must carry a hand-out for the rollout it names (as a first delta must)."""
        traj = req.trajectory
        if req.rollout_id != traj.rollout_id:
            return f"{NOT_HANDED}: AwaitReward as rollout {req.rollout_id} of a trajectory of rollout {traj.rollout_id}"
        return self.handouts.refusal(traj.spec, traj.rollout_id)

    async def run(self) -> None:
        if getattr(self, "awaiting", None) is not None and self.awaiting.ready():
            self.desk.scored.set()
        self.spawn(self.desk.forward_loop(), "forward")
        self.spawn(self.desk.give_up_loop(), "give_up")
        await super().run()

    def _buffer(self):
        """The experience buffer's client, made on first use (scored trajectories go there)."""
        if getattr(self, "buffer", None) is None:
            self.buffer = self.ctx.transport.client(self.cluster.endpoint("experience_buffer",
                                                                          self.settings.experience_buffer))
        return self.buffer

    def counts(self) -> dict:
        st = self.state  # counted without copying: the heartbeat asks every second
        return {"in_flight": sum(e.spec is not None for e in st.entries.values()), "tokens": st.tokens,
                "completed": len(st.completed), "chunks": len(st.chunk_live),
                **self.awaiting.stats()}
