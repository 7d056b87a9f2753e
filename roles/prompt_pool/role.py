"""PromptPoolRole: TakeBatch -> whole GRPO groups; RequeueGroups -> handed out again first.

Idempotent: a TakeBatch with a `batch_seq` that repeats the rollout's last one (its reply was
lost) gets the same groups again, under the attempt ids they went out with; an entry requeued
since (the manager took the rollout for dead) is left out, since it runs elsewhere as its next
attempt. RequeueGroups is answered item by item (RequeueResult): an id this pool did not make or
never handed out is named in `refused`, the others go ahead.

Order: epoch e visits the prompts in a permutation seeded by (seed, e). Whole groups only: a
batch holds floor(max_trajectories / n) groups, but at least one when asked for fewer than n.

Hand-outs: every spec goes out signed for the rollout that takes it (`spec.handout`,
roles/handout.py), a retry's too; the partial pool and the buffer accept that rollout's writes of it
and no other rollout's.

Accounting: every entry handed out (a group, or one member `<group>/<i>` requeued alone) is
recorded with the rollout (and its pid) that got it, in the same transaction as the cursor move,
and the reply goes out only after that commit. An entry stays *outstanding* until the manager
reports it settled (all its members are in the partial pool or the buffer) or requeues it (its
rollout died before they got there); the manager asks for a rollout's outstanding entries with
HandedGroups. So a handed-out group is, at every moment, outstanding, requeued or settled, and
`prompts_skipped` = fresh groups handed - settled - open ones is 0 unless that broke (it is in the
pool's counts, hence its heartbeat, and survives restarts: all of it is in the store).

Attempts: every requeue of an entry gives it a new attempt number k, the next value of one
durable counter (`attempt_seq` in `accounting`), and its members go out as `<group>/<i>~a<k>`
(attempt 0: `<group>/<i>`), with the same group id and sample index. So a re-generated member never
reuses the id of one that got as far as the partial pool, which refuses deltas for ids it completed
(a group the buffer dropped off-lineage was completed there), and the buffer still sees one group
with one slot per sample index; within a group, a later attempt has a larger number. Since the
counter alone makes new ids unique, an entry's attempt is kept (`attempts`) only while the entry is
open: handed out or waiting to be. It is deleted when the entry settles (a settled group requeued
later gets the counter's next value), so the table holds at most the open entries.

Curriculum (optional, `curriculum`; curriculum.py): GroupResults from the experience buffer give
each prompt's recent pass rate; when the cursor comes to a prompt whose weight says not this epoch
(retired, or down-weighted as always solved or never solved), it passes over it, recording the skip
in the same transaction as the cursor move. Off (the default), results are acknowledged and ignored.
Its counts go out with the pool's (heartbeat, `metrics.prompt_pool`) and, for the end-of-run
summary, to `<workdir>/prompt_pool/curriculum-<id>.json` every `CURRICULUM_FILE_S` and at stop.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import numpy as np
from laminar.bus.rpc import RequestError
from laminar.roles.pool_base import PoolRole
from laminar.roles.prompt_pool.config import PromptPoolConfig
from laminar.roles.prompt_pool.curriculum import Curriculum
from laminar.roles.prompt_pool.store import SCHEMA, attempts_from_a_counter

from laminar.datasets import load_records, prompt_encoder
from laminar.protocol import (
    Ack,
    Batch,
    GateOpen,
    GroupResults,
    HandedGroups,
    HandedList,
    RequeueGroups,
    RequeueResult,
    TakeBatch,
    TrajectorySpec,
)
from laminar.protocol.data import group_id_prefix


def untrained_groups(counts: dict, pool_id: str) -> int:
    """Groups of prompt pool `pool_id` an experience buffer removed untrained, from its published
    counts: dropped too stale (complete or not; its per-pool count, or, from a buffer without them
    (one pool then), its totals) and dropped for no signal by dynamic sampling (per pool)."""
    nosignal = int(counts.get(f"dropped_nosignal/{pool_id}", 0))
    if any(k.startswith("dropped_stale/") for k in counts):
        return int(counts.get(f"dropped_stale/{pool_id}", 0)) + nosignal
    return int(counts.get("dropped_stale", 0)) + int(counts.get("dropped_stale_incomplete", 0)) + nosignal


CURRICULUM_FILE_S = 5.0  # how often the curriculum's counts file is rewritten (a reporting period)


class PromptPoolRole(PoolRole):
    """Hands out prompt groups to rollouts, durably, with flow control and requeue of lost groups."""
    name = "prompt_pool"
    Config = PromptPoolConfig
    SCHEMA = SCHEMA
    SCHEMA_VERSION = 5  # v2: handed_to and accounting (new tables; a v1 store's hand-outs count as settled);
    # v3: attempts (a new table: what an older store requeued goes out again as attempt 0);
    # v4: curriculum and curriculum_skips (new tables: an older store starts with no results);
    # v5: attempt numbers from one counter, `attempts` rows only for open entries (an older Laminar
    # would compute a settled group's next attempt from the rows left and could reuse ids: refused)
    MIGRATIONS = {4: lambda c: attempts_from_a_counter(c)}

    async def setup(self) -> None:
        settings = self.settings
        self.records, self.skipped = load_records(settings.dataset, settings.prompt_field, settings.answer_field,
                                                  settings.id_field, settings.on_bad_row)
        enc = prompt_encoder(settings.tokenizer_dir, settings.chat_template, settings.system_prompt)
        self.tokens = [enc.encode(r) for r in self.records]
        self.index = {r.prompt_id: i for i, r in enumerate(self.records)}
        self.gate = self._gate()
        # The gate bounds groups that will still be trained: a group the experience buffer drops as
        # too stale for the mode is never trained, so its window gets a replacement. The buffers'
        # published counts say how many they dropped (monotonic, kept across their restarts).
        self.untrained: dict[str, int] = {}
        self.buffer_counts = self.ctx.transport.subscriber(["metrics.experience_buffer"]) if self.gate else None
        await super().setup()

    def fingerprint(self) -> dict:
        c = self.settings
        return {"seed": c.seed, "dataset": str(Path(c.dataset).resolve()), "prompts": len(self.records),
                "group_size": c.group_size, "id_field": c.id_field}

    def _gate(self) -> tuple[int, int] | None:
        """(lag, groups per version): a rollout holding version v gets groups only while fewer than
        (v + 1 + lag) global batches were handed out, less the groups the experience buffer dropped
        as too stale (never trained: `_follow_buffer_counts`). The barrier modes' lag
        (docs/architecture.md §8), or in the laminar modes `max_batches_ahead` (flow control), or None
        (no gate)."""
        cluster = self.cluster
        lag = cluster.run.barrier_lag if cluster is not None else None
        why = "barrier_gate"
        if lag is None:
            lag, why = self.settings.max_batches_ahead, "flow_control_gate"
        if lag is None:
            return None
        g = self.settings.groups_per_version
        if g is None:  # one global batch of the trainer (the cluster config's derived fact)
            g = cluster.global_batch_groups()
        self.log.info(why, mode=cluster.run.mode if cluster is not None else None, lag=lag, groups_per_version=g)
        return lag, g

    async def run(self) -> None:
        if self.buffer_counts is not None:
            self.spawn(self._follow_buffer_counts(), "buffer-counts")
        if self.settings.curriculum is not None and self.cluster is not None:
            self.spawn(self._write_curriculum(), "curriculum-file")
        await super().run()

    def _curriculum_file(self) -> Path:
        return self.cluster.workdir() / "prompt_pool" / f"curriculum-{self.ctx.id}.json"

    def _save_curriculum(self, counts: dict) -> None:
        """Write the curriculum's counts for the summary (atomically: a reader never sees half)."""
        out = self._curriculum_file()
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(counts) + "\n")
        os.replace(tmp, out)

    async def _write_curriculum(self) -> None:
        while True:
            if getattr(self, "curriculum", None) is not None:
                await asyncio.to_thread(self._save_curriculum, self.curriculum.counts(self._prompt_ids))
            await asyncio.sleep(CURRICULUM_FILE_S)  # the reporting period

    async def _follow_buffer_counts(self) -> None:
        """Groups each experience buffer removed untrained because they were too stale (complete
        or not): the gate's handed groups less these are the groups the trainer will still get."""
        while True:
            _, ev = await self.buffer_counts.recv()
            c = getattr(ev, "counts", None)
            if isinstance(c, dict):
                before = self.untrained.get(ev.id, 0)
                self.untrained[ev.id] = max(before, untrained_groups(c, self.ctx.id))
                if self.untrained[ev.id] > before:
                    self._gate_opened()  # their window gets replacements: rollouts at the gate ask again

    def _gate_opened(self) -> None:
        """Groups may go out again without a newer version: wake the rollouts idle at the gate
        (Batch.gated; they ask again at once, and on their own after gated_wait_s if this is lost)."""
        if self.gate is not None:
            self.pub.publish("data.gate_open", GateOpen(self.ctx.id))

    async def stop(self) -> None:
        await super().stop()
        if getattr(self, "buffer_counts", None) is not None:
            self.buffer_counts.close()
        if getattr(self, "curriculum", None) is not None and self.cluster is not None:
            self._save_curriculum(self.curriculum.counts(self._prompt_ids))  # the last word, for the summary

    @property
    def _prompt_ids(self) -> list[str]:
        return [r.prompt_id for r in self.records]

    def recover(self) -> None:
        row = self.store.read("SELECT epoch, pos, handed FROM cursor WHERE k = 0")
        self.epoch, self.pos, self.handed = row[0] if row else (0, 0, 0)
        self.requeued = [g for (g,) in self.store.read("SELECT group_id FROM requeued ORDER BY at")]
        self.last = {r: (seq, self._handed_entries(json.loads(gs)))
                     for r, seq, gs in self.store.read("SELECT rollout_id, seq, groups FROM last_batch")}
        self._order_epoch = -1
        self.out = {e: (r, pid)
                    for e, r, pid in self.store.read("SELECT entry, rollout_id, pid FROM handed_to ORDER BY rowid")}
        acc = dict(self.store.read("SELECT k, v FROM accounting"))
        if "settled" not in acc:  # a store from before the accounting: what it handed out is taken as settled
            acc["settled"] = self.handed
            self.store.write_sync([("INSERT OR REPLACE INTO accounting VALUES ('settled', ?)", (self.handed,))])
        self.settled = acc["settled"]
        self.attempts: dict[str, int] = dict(self.store.read("SELECT entry, n FROM attempts"))
        self.attempt_seq = max(int(acc.get("attempt_seq", 0)), max(self.attempts.values(), default=0))
        self.open: dict[str, int] = {}  # group id -> its entries outstanding or requeued
        for e in list(self.out) + self.requeued:
            g = self._group_of(e)
            self.open[g] = self.open.get(g, 0) + 1
        self.curriculum = None
        if self.settings.curriculum is not None:
            self.curriculum = Curriculum(self.settings.curriculum, self._prompt_ids, self.settings.seed)
            self.curriculum.load(self.store.read("SELECT gid, prompt, solved, n FROM curriculum ORDER BY rowid"),
                                 self.store.read("SELECT gid, epoch FROM curriculum_skips"),
                                 int(acc.get("curriculum_skipped", 0)))

    def _handed_entries(self, stored: list) -> list[tuple[str, int]]:
        """A stored last batch as (entry, attempt) pairs; a store from before attempts were kept
        there lists bare entries (taken as their current attempt)."""
        attempts = dict(self.store.read("SELECT entry, n FROM attempts"))
        return [(x, attempts.get(x, 0)) if isinstance(x, str) else (str(x[0]), int(x[1])) for x in stored]

    def routes(self) -> None:
        self.route(TakeBatch, self.on_take)
        self.route(RequeueGroups, self.on_requeue)
        self.route(HandedGroups, self.on_handed, changes=False)
        self.route(GroupResults, self.on_results)

    def _order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            self._perm = np.random.default_rng([self.settings.seed, epoch]).permutation(len(self.records))
            self._order_epoch = epoch
        return self._perm

    def exhausted(self) -> bool:
        if self.requeued:
            return False
        if self.curriculum is not None and self.curriculum.all_retired(self._prompt_ids):
            return True  # the curriculum retired every prompt: nothing fresh is left
        return self.settings.max_epochs is not None and self.epoch >= self.settings.max_epochs

    def _group(self, epoch: int, idx: int, attempt: int = 0) -> list[TrajectorySpec]:
        r, n = self.records[idx], self.settings.group_size
        gid = f"{self.prefix}e{epoch}-p{r.prompt_id}"
        tail = f"~a{attempt}" if attempt else ""
        return [TrajectorySpec(trajectory_id=f"{gid}/{i}{tail}", prompt_id=r.prompt_id, group_id=gid, sample_index=i,
                               group_size=n, prompt_tokens=self.tokens[idx], answer=r.answer,
                               max_tokens=self.settings.max_tokens) for i in range(n)]

    @property
    def prefix(self) -> str:
        """Group ids are unique across prompt pools: pools other than "0" prefix their id."""
        return group_id_prefix(self.ctx.id)

    def _parse(self, entry: str) -> tuple[int, str] | None:
        """(epoch, prompt id) of a group id or member id this pool made, else None."""
        group_id, member = self._split(entry)
        if not group_id.startswith(self.prefix + "e"):
            return None
        e, sep, pid = group_id[len(self.prefix) + 1:].partition("-p")
        if member is not None and not (member.isdigit() and int(member) < self.settings.group_size):
            return None
        return (int(e), pid) if sep and e.isdigit() and pid in self.index else None

    def _specs_of(self, entry: str, attempt: int | None = None) -> list[TrajectorySpec]:
        e, pid = self._parse(entry)
        specs = self._group(e, self.index[pid], self.attempts.get(entry, 0) if attempt is None else attempt)
        _, member = self._split(entry)
        return specs if member is None else [specs[int(member)]]

    def _was_handed(self, entry: str) -> bool:
        """Did the cursor pass this group (it was handed out fresh at some point)? A group the
        curriculum passed over was not (known for the current and previous epoch)."""
        e, pid = self._parse(entry)
        if self.curriculum is not None and self._group_of(entry) in self.curriculum.skips:
            return False
        if e != self.epoch:
            return e < self.epoch
        self._order(e)
        if getattr(self, "_inv_epoch", None) != e:
            self._inv, self._inv_epoch = np.argsort(self._perm), e
        return int(self._inv[self.index[pid]]) < self.pos

    async def on_take(self, req: TakeBatch) -> Batch:
        last = self.last.get(req.rollout_id)
        if req.batch_seq >= 0 and last is not None and last[0] == req.batch_seq:  # a retry
            await self.durable([])  # its answer stands once the original's cursor move is on disk
            # the entries it still holds, under the attempt they were handed out as: one requeued
            # since runs elsewhere as its next attempt, and must not run here too under those ids
            held = [(g, k) for g, k in last[1] if self.out.get(g, ("",))[0] == req.rollout_id]
            return self._batch(req, [s for g, k in held for s in self._specs_of(g, k)])
        n = self.settings.group_size
        want = max(1, min(req.max_trajectories, self.settings.max_batch_trajectories) // n)
        # Requeued groups (work lost with a rollout) go out first and pass the gate: they belong to
        # batches already counted, which the trainer may be waiting for. The gate bounds the fresh
        # groups, and `handed` counts only those.
        fresh_room = want
        if self.gate is not None and req.version >= 0:
            lag, g = self.gate
            fresh_room = (req.version + 1 + lag) * g - (self.handed - sum(self.untrained.values()))
        out: list[TrajectorySpec] = []
        took_requeued = []
        while len(out) // n < want and len(took_requeued) < len(self.requeued):
            gid = self.requeued[len(took_requeued)]
            took_requeued.append(gid)
            out += self._specs_of(gid)
        n_requeued = len(out)
        epoch, pos, fresh, scanned, skip_rows = self.epoch, self.pos, 0, 0, []
        cur = self.curriculum
        bound = cur.scan_bound(len(self.records)) if cur is not None else None
        while len(out) // n < want and fresh < fresh_room:
            if self.settings.max_epochs is not None and epoch >= self.settings.max_epochs:
                break
            if bound is not None and scanned >= bound:
                break  # every prompt left is retired
            idx = int(self._order(epoch)[pos])
            if cur is None or cur.visits(epoch, self.records[idx].prompt_id):
                out += self._group(epoch, idx)
                fresh += 1
            else:
                skip_rows += cur.skip(f"{self.prefix}e{epoch}-p{self.records[idx].prompt_id}", epoch)
            pos, scanned = pos + 1, scanned + 1
            if pos == len(self.records):
                epoch, pos = epoch + 1, 0
        if not out:  # exhausted, or (gated) this version's share is out: wait for the next version
            if skip_rows:
                self.epoch, self.pos = epoch, pos
                await self.durable([("INSERT OR REPLACE INTO cursor (k, epoch, pos, handed) VALUES (0, ?, ?, ?)",
                                     (epoch, pos, self.handed))] + skip_rows)
            exhausted = self.exhausted()
            return Batch([], exhausted=exhausted, gated=fresh_room <= 0 and not exhausted)
        # Commit the cursor move before answering; memory follows only after it is durable.
        stmts = [("INSERT OR REPLACE INTO cursor (k, epoch, pos, handed) VALUES (0, ?, ?, ?)",
                  (epoch, pos, self.handed + fresh))] + skip_rows
        stmts += [("DELETE FROM requeued WHERE group_id = ?", (g,)) for g in took_requeued]
        entries = took_requeued + list(dict.fromkeys(s.group_id for s in out[n_requeued:]))
        if req.batch_seq >= 0:  # each entry with the attempt it goes out as (what a retry answers)
            handed = [(e, self.attempts.get(e, 0)) for e in entries]
            self.last[req.rollout_id] = (req.batch_seq, handed)
            stmts.append(("INSERT OR REPLACE INTO last_batch VALUES (?, ?, ?)",
                          (req.rollout_id, req.batch_seq, json.dumps(handed))))
        for e in entries:  # who holds it now: until settled or requeued
            self.out[e] = (req.rollout_id, req.pid)
            stmts.append(("INSERT OR REPLACE INTO handed_to VALUES (?, ?, ?)", (e, req.rollout_id, req.pid)))
        for e in entries[len(took_requeued):]:
            self.open[e] = self.open.get(e, 0) + 1
        self.epoch, self.pos, self.handed = epoch, pos, self.handed + fresh
        self.requeued = self.requeued[len(took_requeued):]
        # the audit trail of hand-outs (who was given which trajectory ids: what a compromised
        # rollout may write, docs/faults.md), logged before the commit so that no committed hand-out
        # goes unlogged (one that never commits is handed out again, and logged again); a retry
        # hands out the same ids and is not logged again
        self.log.info("handed_out", rollout=req.rollout_id, pid=req.pid, batch_seq=req.batch_seq,
                      trajectories=[s.trajectory_id for s in out])
        await self.durable(stmts)
        return self._batch(req, out)

    def _batch(self, req: TakeBatch, specs: list[TrajectorySpec]) -> Batch:
        """The reply: each spec signed for the rollout it is handed to (roles/handout.py)."""
        sign = self.handouts.sign
        return Batch([sign(s, req.rollout_id) for s in specs], exhausted=self.exhausted())

    async def on_requeue(self, req: RequeueGroups) -> RequeueResult:
        """Item by item: entries this pool did not make, or never handed out, are named in
        `refused` and the others go ahead. Only a request with nothing acceptable is refused whole."""
        refused: dict[str, str] = {}
        for g in list(req.group_ids) + list(req.settled):
            if g not in refused and self._parse(g) is None:
                refused[g] = f"unknown group id {g!r} for prompt pool {self.ctx.id}"
        new = list(dict.fromkeys(g for g in req.group_ids if g not in self.requeued and g not in refused))
        for g in new:
            if not self._was_handed(g):
                refused[g] = f"group {g!r} was never handed out by prompt pool {self.ctx.id}"
        new = [g for g in new if g not in refused]
        settled_in = [e for e in req.settled if e not in refused]
        if refused and not new and not settled_in and not any(g in self.requeued for g in req.group_ids):
            first = next(iter(refused.values()))
            raise RequestError("refused", first + (f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""))
        if refused:
            self.log.warning("requeue_entries_refused", rollout=req.rollout_id,
                             refused=dict(list(refused.items())[:16]), count=len(refused))
        stmts: list = []
        for g in new:  # its next attempt: new trajectory ids for whatever runs again
            self.attempt_seq += 1
            self.attempts[g] = self.attempt_seq
            stmts.append(("INSERT OR REPLACE INTO attempts VALUES (?, ?)", (g, self.attempt_seq)))
        if new:
            stmts.append(("INSERT OR REPLACE INTO accounting VALUES ('attempt_seq', ?)", (self.attempt_seq,)))
        for g in new:  # outstanding -> requeued; anything else opens again
            if self.out.pop(g, None) is None:
                grp = self._group_of(g)
                if not self.open.get(grp):
                    self.settled -= 1  # a settled group runs again: it counts once more when it settles
                self.open[grp] = self.open.get(grp, 0) + 1
            stmts += [("DELETE FROM handed_to WHERE entry = ?", (g,)),
                      ("INSERT OR IGNORE INTO requeued (group_id, at) VALUES (?, ?)", (g, time.time()))]
        self.requeued += new
        closed: list[str] = []
        for e in dict.fromkeys(settled_in):
            held = self.out.get(e)
            if held is None or (req.rollout_id and held[0] != req.rollout_id):
                continue  # already settled or requeued, or handed to someone else since
            del self.out[e]
            closed.append(e)
            grp = self._group_of(e)
            self.open[grp] -= 1
            if not self.open[grp]:
                del self.open[grp]
                self.settled += 1
            stmts.append(("DELETE FROM handed_to WHERE entry = ?", (e,)))
            if self.attempts.pop(e, None) is not None:  # settled: the counter keeps later ids new
                stmts.append(("DELETE FROM attempts WHERE entry = ?", (e,)))
        if new or closed:
            stmts.append(("INSERT OR REPLACE INTO accounting VALUES ('settled', ?)", (self.settled,)))
        if new:
            self.log.warning("groups_requeued", rollout=req.rollout_id, entries=new[:64], count=len(new))
        await self.durable(stmts)
        if new:
            self._gate_opened()  # requeued groups pass the gate
        return RequeueResult(new, closed, refused)

    async def on_handed(self, req: HandedGroups) -> HandedList:
        got: list[tuple[str, str, int]] = []
        skip, more = req.offset, False
        for e, (r, pid) in self.out.items():
            if req.rollout_id not in ("", "*") and r != req.rollout_id:
                continue
            if req.pid and pid and pid != req.pid:  # another process of that rollout (restarted since)
                continue
            if skip:
                skip -= 1
                continue
            if len(got) >= req.limit:
                more = True
                break
            got.append((e, r, pid))
        split = [self._split(e) for e, _, _ in got]
        n = self.settings.group_size
        return HandedList([e for e, _, _ in got], [r for _, r, _ in got], [n] * len(got), more=more,
                          group_ids=[g for g, _ in split], members=[-1 if m is None else int(m) for _, m in split],
                          pids=[pid for _, _, pid in got], attempts=[self.attempts.get(e, 0) for e, _, _ in got])

    async def on_results(self, req: GroupResults) -> Ack:
        """Each completed group's result, for the curriculum (idempotent by group id). Off: ignored.
        A group id this pool did not make is refused with the others recorded."""
        if not (len(req.group_ids) == len(req.solved) == len(req.sizes)):
            raise RequestError("bad_request", f"GroupResults: {len(req.group_ids)} group_ids, {len(req.solved)} "
                               f"solved, {len(req.sizes)} sizes: they must be as many")
        if self.curriculum is None:
            return Ack("curriculum off")
        stmts, refused, recorded = [], [], 0
        for gid, solved, size in zip(req.group_ids, req.solved, req.sizes, strict=True):
            parsed = self._parse(gid)
            if parsed is None or self._split(gid)[1] is not None or not 0 <= solved <= size:
                refused.append(gid)
                continue
            rows = self.curriculum.record(parsed[1], gid, int(solved), int(size))
            stmts, recorded = stmts + rows, recorded + bool(rows)
        if refused:
            self.log.warning("group_results_refused", groups=refused[:16], count=len(refused))
        await self.durable(stmts)
        return Ack(f"recorded {recorded}, already known {len(req.group_ids) - len(refused) - recorded}, "
                   f"refused {len(refused)}")

    @property
    def prompts_skipped(self) -> int:
        """Fresh groups handed out that are neither settled nor open (outstanding or requeued)."""
        return self.handed - self.settled - len(self.open)

    def counts(self) -> dict:
        return {"epoch": self.epoch, "position": self.pos, "groups_handed": self.handed,
                "requeued": len(self.requeued), "prompts": len(self.records), "skipped_rows": self.skipped,
                "outstanding": len(self.out), "groups_settled": self.settled,
                "prompts_skipped": self.prompts_skipped,
                **(self.curriculum.counts(self._prompt_ids) if self.curriculum else {})}

    def _split(self, entry: str) -> tuple[str, str | None]:
        """A group id -> (it, None); a member id `<group>/<i>` -> (group id, "i"). (A prompt id
        may itself hold a "/": an entry is a member id only if what precedes it is a group.)"""
        group_id, sep, member = entry.rpartition("/")
        if sep and member.isdigit() and self._is_group(group_id):
            return group_id, member
        return entry, None

    def _is_group(self, group_id: str) -> bool:
        e, sep, pid = group_id[len(self.prefix) + 1:].partition("-p")
        return group_id.startswith(self.prefix + "e") and bool(sep) and e.isdigit() and pid in self.index

    def _group_of(self, entry: str) -> str:
        return self._split(entry)[0]
