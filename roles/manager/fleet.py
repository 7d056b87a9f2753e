"""Fleet: the manager's view of the rollouts, dynamic repack, and recovery of a dead rollout's work.

Inputs (all pub/sub, each report carries the full current state, so a lost one costs nothing):
  rollout.stats.<id>  KV usage, running/waiting, active, version, control address (docs/architecture.md §7)
  hb.rollout.<id>     liveness; silence for rollout_dead_after_s, or a new pid, declares the old one dead
  weights.version     a relay made a new version visible: repack now (draining replicas of the
                      old version get freed for the new one)
Outputs (request/reply, must arrive):
  MigrateOut(everything) to a source, MigrateIn(partials) to its destination (one version),
  each MigrateIn preceded by GrantPartials to the partial pool (a rollout key takes over only
  what it owns or was granted: docs/security.md);
  InFlightOf(dead rollout) from the partial pool (page by page: each reply is bounded), then
  MigrateIn of those partials to live rollouts of the same version (re-prefill from prompt +
  generated tokens).

Nothing is lost on a failed step: a partial whose MigrateIn is refused (the destination moved to
another version, is full, or died) joins `orphans`, durable in the partial pool all along, and is
placed again on every tick. An orphan that finds no live rollout of its version for
`orphan_wait_s` (every rollout moved on to newer weights) is handled by `orphan_policy`:
`restart` (default) starts it again from its prompt on the live rollout with most room, at that
rollout's version, under the id `<id>~r<n>` (same group and sample index: the buffer takes
whichever of the two arrives first), and completes the old partial; `wait` keeps it until a
rollout of its version appears, warning as `orphans_stuck`; `retained` offers them (MigrateIn
with adopt) to live rollouts, fewest active first, until one whose relay retains their version
takes them: it finishes its current work, loads that version, and resumes them on it (no tokens
lost, no new id); whatever no rollout adopts is restarted. One lock serializes plans,
recoveries and placements.

Group accounting (the prompt pools' side of recovery): a group handed to a rollout lives only in
its memory until the first delta flush. The prompt pools record what they hand to whom; the fleet
settles an entry once every member is in the partial pool or the buffer (asked in that order, so
a trajectory moving from one to the other is seen in one of them), and for a dead rollout (or one
no live rollout owns once the fleet has heard from everyone) it requeues what is nowhere: the
whole group, or only its missing members. Live rollouts' entries are settled every `settle_interval_s`,
which keeps the pools' lists as short as the work in flight.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from laminar.bus.errors import RemoteError, RpcError
from laminar.roles.manager.config import ManagerConfig
from laminar.roles.manager.repack import ReplicaLoad, plan_repack

from laminar import failpoints
from laminar.logs import RotatingFile
from laminar.protocol import (
    AppendDeltas,
    CompletePartial,
    GrantPartials,
    GroupPresence,
    HandedGroups,
    Heartbeat,
    InFlightOf,
    MigrateIn,
    MigrateOut,
    PartialState,
    RequeueGroups,
    RolloutStats,
    TokenDelta,
)


@dataclass
class RolloutView:
    id: str
    stats: RolloutStats
    kv_prev: float             # the previous report's KV usage
    seen_at: float
    pid: int = 0
    alive: bool = True
    reported_at: float = 0.0   # when its last RolloutStats arrived
    received_at: float = 0.0   # last MigrateIn here: until its next report, its load is unknown
    kv_peak: float = 0.0       # highest KV usage since it last admitted work (its batch's peak)

    def observe(self, s: RolloutStats) -> None:
        """Take a new report: new work (more running, any waiting, other weights) starts a new peak."""
        old = self.stats
        admitted = (s.running > old.running or s.waiting > 0 or s.version != old.version
                    or s.lineage != old.lineage)
        self.kv_peak = s.kv_usage if admitted else max(self.kv_peak, s.kv_usage)
        self.kv_prev, self.stats = old.kv_usage, s

    def load(self, trend: str = "peak") -> ReplicaLoad:
        """Its input to the plan; C_prev is its batch's peak (`trend` peak) or the previous report's
        usage (previous: the paper's listing)."""
        s = self.stats
        ref = self.kv_peak if trend == "peak" else self.kv_prev
        return ReplicaLoad(self.id, s.version, s.kv_usage, ref, s.running, s.waiting)


def _manager(name: str):
    """ManagerConfig's default of setting `name`: the one default of each setting the fleet shares."""
    return ManagerConfig.model_fields[name].default


@dataclass
class FleetSettings:
    """The fleet's settings: the manager's (ManagerConfig's names and defaults), resolved for the
    cluster by from_config, and the fleet's own constants."""

    repack: bool = True           # ManagerConfig.repack (None) resolved: on in the laminar mode
    repack_interval_s: float = _manager("repack_interval_s")
    c_max: float = _manager("c_max")
    repack_trend: str = _manager("repack_trend")   # C_prev of the candidate test: peak | previous (repack.py)
    batch_bound: int = _manager("batch_bound")     # or B derived from ManagerConfig.curve_path
    rollout_dead_after_s: float = ManagerConfig().relay_dead_after_s(None)  # resolved: the manager's own, alone
    rpc_timeout_s: float = _manager("rpc_timeout_s")
    orphan_wait_s: float = _manager("orphan_wait_s")
    orphan_policy: str = _manager("orphan_policy")  # restart | wait | retained
    settle_interval_s: float = _manager("settle_interval_s")  # period of the prompt pools' accounting pass
    concurrency: dict[str, int] = field(default_factory=dict)  # rollout id -> its own max_concurrency
    log_path: Path | None = None  # JSONL of every repack (for summaries)
    timeline_path: Path | None = None  # JSONL of every rollout report (idle fraction, KV usage)
    # the fleet's own, no manager setting:
    max_concurrency: int = 64     # a rollout's max_concurrency, when `concurrency` does not name it
    reconcile_s: float = 30.0     # period of the partial-pool scan for work of unknown owners
    settle_page: int = 4096       # entries asked per request of the accounting pass
    # both JSONL files rotate by size (laminar/logs.py): None = LAMINAR_LOG_MAX_BYTES / LAMINAR_LOG_KEEP
    timeline_max_bytes: int | None = None
    timeline_keep: int | None = None

    @classmethod
    def from_config(cls, settings: ManagerConfig, cluster=None, batch_bound: int | None = None) -> FleetSettings:
        """The settings of a manager's fleet (`cluster`: the LaminarConfig, None when the manager runs
        alone). `batch_bound`: B as derived from settings.curve_path (None: settings.batch_bound)."""
        mode = cluster.run.mode if cluster is not None else "laminar"
        folder = cluster.workdir() / "manager" if cluster is not None else None
        shared = {f.name: getattr(settings, f.name) for f in dataclasses.fields(cls)
                  if f.name in ManagerConfig.model_fields}
        return cls(**{**shared,  # then what the cluster resolves:
                      "repack": settings.repack if settings.repack is not None else mode == "laminar",
                      "batch_bound": batch_bound or settings.batch_bound,
                      "rollout_dead_after_s": settings.rollout_dead_after_s or settings.relay_dead_after_s(cluster)},
                   concurrency=cluster.rollout_concurrency() if cluster is not None else {},
                   log_path=folder / "repacks.jsonl" if folder else None,
                   timeline_path=folder / "fleet.jsonl" if folder else None)

    def max_concurrency_of(self, rollout_id: str) -> int:
        return self.concurrency.get(rollout_id, self.max_concurrency)


@dataclass
class FleetCounters:
    repacks: int = 0              # executed moves
    plans: int = 0                # non-empty plans
    moved_trajectories: int = 0
    recovered: int = 0            # trajectories of dead rollouts placed on live ones
    replaced: int = 0             # trajectories of a failed repack move placed on another rollout
    restarted: int = 0            # orphans started again from their prompt (orphan_policy restart)
    requeued: int = 0             # prompt-pool entries handed to dead rollouts and found nowhere: handed out again
    settled: int = 0              # prompt-pool entries found whole in the partial pool or buffer
    adopted: int = 0              # orphans resumed on their own, retained version (orphan_policy retained)
    dead: int = 0
    last_repack_s: float = 0.0
    failed_moves: int = 0
    history: list[dict] = field(default_factory=list)


class Fleet:
    def __init__(self, transport, log, settings: FleetSettings, address_of, partial_pool_address: str | None,
                 prompt_pool_addresses: dict[str, str] | None = None, buffer_address: str | None = None):
        self.t, self.log, self.s = transport, log, settings
        self.address_of = address_of           # rollout id -> control address (from config)
        self.partials = transport.client(partial_pool_address) if partial_pool_address else None
        self.prompt_pools = {i: transport.client(a) for i, a in (prompt_pool_addresses or {}).items()}
        self.buffer = transport.client(buffer_address) if buffer_address else None
        self.views: dict[str, RolloutView] = {}
        self.clients: dict[str, object] = {}
        self.orphans: dict[str, tuple[PartialState, float]] = {}
        self.unmoved: set[str] = set()  # orphans a failed repack move left, not a dead rollout's work
        self.lost: asyncio.Queue[tuple[str, int]] = asyncio.Queue(maxsize=1024)  # (rollout id, its dead pid)
        self.kick = asyncio.Event()
        self.lock = asyncio.Lock()
        self.c = FleetCounters()
        self._timeline = self._repacks = None
        if settings.timeline_path is not None:  # line-buffered (readable live), rotated by size
            self._timeline = RotatingFile(settings.timeline_path, settings.timeline_max_bytes, settings.timeline_keep)

    # -- inputs -------------------------------------------------------------------------------
    def on_stats(self, s: RolloutStats) -> None:
        v = self.views.get(s.rollout_id)
        now = time.monotonic()
        if self._timeline is not None:
            self._timeline.write(json.dumps({"ts": s.ts, "id": s.rollout_id, "v": s.version, "kv": round(s.kv_usage, 4),
                                             "run": s.running, "wait": s.waiting, "act": s.active, "st": s.state,
                                             "tps": round(s.tokens_per_s, 1)}) + "\n")
        if v is None:
            self.views[s.rollout_id] = RolloutView(s.rollout_id, s, s.kv_usage, now, reported_at=now,
                                                   kv_peak=s.kv_usage)
            return
        v.observe(s)
        v.seen_at, v.reported_at = now, now
        if not v.alive:
            v.alive = True
            self.log.info("rollout_back", rollout=s.rollout_id, version=s.version)

    def on_heartbeat(self, hb: Heartbeat) -> None:
        v = self.views.get(hb.id)
        if v is None:
            return  # no stats yet: nothing of it to recover either
        if v.pid and hb.pid != v.pid and v.alive:  # restarted within dead_after_s
            self._declare_dead(v, f"restarted (pid {v.pid} -> {hb.pid})")
        v.pid, v.seen_at = hb.pid, max(v.seen_at, time.monotonic())
        if not v.alive:
            v.alive = True

    def sweep(self) -> None:
        now = time.monotonic()
        for v in self.views.values():
            if v.alive and now - v.seen_at > self.s.rollout_dead_after_s:
                self._declare_dead(v, f"silent for {now - v.seen_at:.1f}s")

    def _declare_dead(self, v: RolloutView, why: str) -> None:
        v.alive = False
        self.c.dead += 1
        self.log.warning("rollout_dead", rollout=v.id, why=why, version=v.stats.version)
        try:
            self.lost.put_nowait((v.id, v.pid))
        except asyncio.QueueFull:
            self.log.error("lost_queue_full", rollout=v.id)
        self.kick.set()

    # -- loops (owned by the manager role) -------------------------------------------------------
    async def run(self) -> None:
        """Periodic tick: sweep liveness, recover dead rollouts' work, place orphans, repack."""
        tick = min(self.s.repack_interval_s, max(self.s.rollout_dead_after_s / 2, 0.2))
        next_repack = time.monotonic() + self.s.repack_interval_s
        # first reconcile once every live rollout had time to report (a restarted manager)
        next_reconcile = time.monotonic() + 2 * self.s.rollout_dead_after_s
        next_settle = next_reconcile
        while True:
            try:
                await asyncio.wait_for(self.kick.wait(), tick)
            except TimeoutError:
                pass
            kicked = self.kick.is_set()
            self.kick.clear()
            self.sweep()
            async with self.lock:
                lost = [self.lost.get_nowait() for _ in range(self.lost.qsize())]
                for rid, pid in lost:  # one that fails goes back in the queue for the next tick
                    await self._recover(rid, pid)
                if time.monotonic() >= next_reconcile:
                    next_reconcile = time.monotonic() + self.s.reconcile_s
                    await self.reconcile()
                if time.monotonic() >= next_settle:
                    next_settle = time.monotonic() + self.s.settle_interval_s
                    await self.settle_handed()
                await self._place_orphans()
                if self.s.repack and (kicked or time.monotonic() >= next_repack):
                    next_repack = time.monotonic() + self.s.repack_interval_s
                    await self.repack()

    def new_version(self, version: int) -> None:
        """weights.version: the paper repacks right after each new version."""
        self.kick.set()

    # -- repack -----------------------------------------------------------------------------------
    def _trusted_loads(self) -> list[ReplicaLoad]:
        """Live rollouts whose latest report postdates any migration into them."""
        return [v.load(self.s.repack_trend) for v in self.views.values()
                if v.alive and v.stats.state != "loading" and v.reported_at > v.received_at]

    async def repack(self) -> list[dict]:
        loads = self._trusted_loads()
        moves = plan_repack(loads, self.s.c_max, self.s.batch_bound)
        if not moves:
            return []
        self.c.plans += 1
        t0 = time.monotonic()
        done = []
        for m in moves:
            moved = await self._move(m.source, m.dest, m.version)
            done.append({"source": m.source, "dest": m.dest, "version": m.version, "planned": m.running,
                         "moved": moved, "kv": round(m.kv, 4)})
        took = time.monotonic() - t0
        self.c.last_repack_s = took
        rec = {"ts": time.time(), "moves": done, "seconds": round(took, 4)}
        self.c.history = (self.c.history + [rec])[-50:]
        if self.s.log_path is not None:
            if self._repacks is None:
                self._repacks = RotatingFile(self.s.log_path, self.s.timeline_max_bytes, self.s.timeline_keep)
            self._repacks.write(json.dumps(rec) + "\n")
        self.log.info("repacked", moves=len(done), trajectories=sum(d["moved"] for d in done), seconds=round(took, 4))
        return done

    async def _move(self, source: str, dest: str, version: int) -> int:
        try:
            out = await self._client(source).call(MigrateOut([], reason="repack", everything=True),
                                                  timeout=self.s.rpc_timeout_s)
        except RpcError as exc:
            self.c.failed_moves += 1
            self.log.warning("migrate_out_failed", source=source, error=str(exc))
            return 0
        parts = list(out.partials)
        if not parts:
            return 0
        self.views[source].stats = _emptied(self.views[source].stats)
        failpoints.hit("manager.after_migrate_out")  # chaos: the window between the move's two calls
        placed = await self._migrate_in(dest, parts)
        for p in parts:
            if p.spec.trajectory_id not in placed:
                self.orphans[p.spec.trajectory_id] = (p, time.monotonic())
                self.unmoved.add(p.spec.trajectory_id)
        if len(placed) < len(parts):
            self.c.failed_moves += 1
            await self._place_orphans()
        self.c.repacks += 1
        self.c.moved_trajectories += len(placed)
        return len(placed)

    async def _grant(self, dest: str, parts: list[PartialState]) -> bool:
        """Let rollout `dest` take these over in the partial pool (no owner changes until it does);
        False if the pool did not answer (the MigrateIn is then not sent: its claims would be refused)."""
        if self.partials is None:
            return True
        try:
            await self.partials.call(GrantPartials([p.spec.trajectory_id for p in parts], dest),
                                     timeout=self.s.rpc_timeout_s)
            return True
        except RpcError as exc:
            self.log.warning("grant_failed", dest=dest, trajectories=len(parts), error=str(exc))
            return False

    async def _migrate_in(self, dest: str, parts: list[PartialState]) -> set[str]:
        if not await self._grant(dest, parts):
            return set()
        try:
            res = await self._client(dest).call(MigrateIn(parts), timeout=self.s.rpc_timeout_s)
        except RpcError as exc:
            self.log.warning("migrate_in_failed", dest=dest, trajectories=len(parts), error=str(exc))
            return set()
        v = self.views.get(dest)
        if v is not None:
            v.received_at = time.monotonic()
        for tid in res.gone:  # finished elsewhere meanwhile (e.g. its rollout came back): not an orphan
            self.orphans.pop(tid, None)
        return set(res.accepted) | set(res.gone)  # gone ones need no placing either

    # -- recovery ---------------------------------------------------------------------------------
    async def _recover(self, rollout_id: str, pid: int = 0) -> None:
        if self.partials is None:  # a cluster without a partial pool keeps no in-flight state
            self.log.warning("recover_impossible", rollout=rollout_id, why="no partial pool in the config")
            return
        try:
            partials = await self.in_flight(rollout_id)
        except RpcError as exc:  # the partial pool is down: try again on the next tick
            self.log.warning("recover_deferred", rollout=rollout_id, error=str(exc))
            self.lost.put_nowait((rollout_id, pid))
            return
        now = time.monotonic()
        for p in partials:
            self.orphans.setdefault(p.spec.trajectory_id, (p, now))
        self.log.info("recovering", rollout=rollout_id, trajectories=len(partials),
                      ids=[p.spec.trajectory_id for p in partials][:64],
                      versions=[p.version for p in partials][:64])
        if not await self.settle_handed(rollout_id, pid, dead=True):  # its groups not yet anywhere
            self.lost.put_nowait((rollout_id, pid))

    async def settle_handed(self, rollout_id: str = "*", pid: int = 0, dead: bool = False) -> bool:
        """Account the prompt pools' outstanding entries of one rollout (or all): settle those whose
        members are all in the partial pool or the buffer; requeue, for a dead owner, what is
        nowhere (the whole group, or the missing members alone). False: a pool did not answer
        (nothing was requeued on a guess; call again)."""
        if not self.prompt_pools or self.partials is None or self.buffer is None:
            return True
        live = {v.id: v.pid for v in self.views.values() if v.alive}
        now = time.monotonic()
        known = set(self.views)
        self._strangers = {o: t for o, t in getattr(self, "_strangers", {}).items() if o not in known}
        ok = True
        for pool_id, pool in self.prompt_pools.items():
            offset = 0
            while True:
                try:
                    h = await pool.call(HandedGroups(rollout_id, pid, self.s.settle_page, offset),
                                        timeout=self.s.rpc_timeout_s)
                    gids = sorted(set(h.group_ids))
                    # the attempt each entry went out as: in flight, only its members count
                    attempts = dict(zip(h.entries, h.attempts, strict=True)) if len(h.attempts) == len(
                        h.entries) else {}
                    have: dict[str, set[int]] = {}
                    for src in (self.partials, self.buffer):  # this order: a moving trajectory is seen once
                        ask = GroupPresence(gids, attempts if src is self.partials else {})
                        got = await src.call(ask, timeout=self.s.rpc_timeout_s)
                        for g, idx in got.present.items():
                            have.setdefault(g, set()).update(idx)
                except RpcError as exc:
                    self.log.warning("settle_deferred", prompt_pool=pool_id, rollout=rollout_id, error=str(exc))
                    ok = False
                    break
                requeue, settled, kept = [], [], 0
                rows = zip(h.entries, h.rollout_ids, h.group_sizes, h.group_ids, h.members, h.pids, strict=False)
                for e, owner, size, g, m, p in rows:
                    want = set(range(size)) if m < 0 else {m}
                    held = have.get(g, set())
                    missing = set() if -1 in held else want - held
                    if not missing:
                        settled.append(e)
                        continue
                    if owner not in known:  # never reported: dead only once it stays silent past its first report
                        first = self._strangers.setdefault(owner, now)
                        owner_dead = dead or now - first > 2 * self.s.rollout_dead_after_s
                    else:
                        owner_dead = dead or owner not in live or bool(p and live[owner] and p != live[owner])
                    if not owner_dead:
                        kept += 1
                    elif missing == want:
                        requeue.append(e)
                    else:  # some members got through: only the others run again
                        requeue += [f"{g}/{i}" for i in sorted(missing)]
                        settled.append(e)
                if requeue or settled:
                    try:
                        res = await pool.call(RequeueGroups(requeue, rollout_id if rollout_id != "*" else "",
                                                            settled), timeout=self.s.rpc_timeout_s)
                    except RpcError as exc:
                        self.log.warning("settle_deferred", prompt_pool=pool_id, rollout=rollout_id, error=str(exc))
                        ok = False
                        break
                    refused = dict(getattr(res, "refused", None) or {})  # per item (an older pool: an Ack)
                    if refused:
                        self.log.error("requeue_entries_refused", prompt_pool=pool_id, rollout=rollout_id,
                                       refused=dict(list(refused.items())[:16]), count=len(refused))
                        requeue = [e for e in requeue if e not in refused]
                        settled = [e for e in settled if e not in refused]
                    self.c.requeued += len(requeue)
                    self.c.settled += len(settled)
                    if requeue:
                        self.log.warning("groups_requeued", prompt_pool=pool_id, rollout=rollout_id,
                                         entries=requeue[:64], count=len(requeue))
                if not h.more:
                    break
                offset += kept  # settled and requeued entries left the list; the kept ones stay ahead
        return ok

    async def reconcile(self) -> None:
        """Partials owned by no live rollout become orphans: the work of rollouts that died while
        no manager was running (or before this one saw them), which no silence would reveal."""
        if self.partials is None:
            return
        try:
            partials = await self.in_flight("*")
        except RpcError as exc:
            self.log.warning("reconcile_deferred", error=str(exc))
            return
        live = {v.id for v in self.views.values() if v.alive}
        now, found = time.monotonic(), 0
        for p in partials:
            if p.rollout_id not in live and p.spec.trajectory_id not in self.orphans:
                self.orphans[p.spec.trajectory_id] = (p, now)
                found += 1
        if found:
            self.log.warning("orphans_found", trajectories=found,
                             owners=sorted({p.rollout_id for p in partials} - live))

    async def in_flight(self, rollout_id: str) -> list[PartialState]:
        """Every partial of `rollout_id` ("*": of anyone) in the partial pool, read page by page
        (InFlightOf replies are bounded, whatever the population in flight)."""
        out: list[PartialState] = []
        after = ""
        while True:
            res = await self.partials.call(InFlightOf(rollout_id, after=after), timeout=self.s.rpc_timeout_s)
            out += res.partials
            if not res.more or not res.partials:
                return out
            after = res.next_after

    async def _place_orphans(self) -> None:
        self.unmoved &= self.orphans.keys()  # placed, restarted or finished elsewhere: no longer orphans
        if not self.orphans:
            return
        by_weights: dict[tuple[int, int], list[PartialState]] = {}
        for p, _ in self.orphans.values():
            by_weights.setdefault((p.lineage, p.version), []).append(p)
        for (lineage, version), parts in by_weights.items():
            for dest in self._hosts_of(version, lineage):
                room = 2 * self.s.max_concurrency_of(dest.id) - dest.stats.active  # MigrateIn's own bound
                if room <= 0 or not parts:
                    continue
                batch, parts = parts[:room], parts[room:]
                placed = await self._migrate_in(dest.id, batch)
                for tid in placed:
                    self.orphans.pop(tid, None)
                self._count_placed(placed)
                if placed:
                    self.log.info("orphans_placed", dest=dest.id, version=version, trajectories=len(placed))
                parts += [p for p in batch if p.spec.trajectory_id not in placed]
        now = time.monotonic()
        stuck = [t for t, (_, since) in self.orphans.items() if now - since > self.s.orphan_wait_s]
        if stuck and self.s.orphan_policy == "retained":
            stuck = await self._adopt(stuck)
        if stuck and self.s.orphan_policy in ("restart", "retained"):
            await self._restart(stuck)
        elif stuck:
            self.log.warning("orphans_stuck", trajectories=len(stuck), waiting_s=self.s.orphan_wait_s)

    def _count_placed(self, tids) -> None:
        """Orphans now running on a live rollout: a failed move's (`replaced`) or a dead rollout's
        (`recovered`), so the counter of dead rollouts' work counts nothing else."""
        for tid in tids:
            if tid in self.unmoved:
                self.unmoved.discard(tid)
                self.c.replaced += 1
            else:
                self.c.recovered += 1

    async def _adopt(self, tids: list[str]) -> list[str]:
        """Offer stuck orphans, by the weights they name, (lineage, version), to live rollouts (fewest
        active first) for adoption on exactly those weights from a retained copy (a relay retains
        the new lineage's versions under the numbers a discarded one used: the number alone names
        nothing); returns the ids nobody took."""
        by_weights: dict[tuple[int, int], list[PartialState]] = {}
        for tid in tids:
            p = self.orphans[tid][0]
            by_weights.setdefault((p.lineage, p.version), []).append(p)
        left: list[str] = []
        for (lineage, version), parts in by_weights.items():
            declined: dict[str, str] = {}  # dest -> why (not_retained, busy): logged once per version
            for dest in sorted((v for v in self.views.values() if v.alive and v.stats.state != "loading"),
                               key=lambda v: v.stats.active):
                if not parts:
                    break
                batch = parts[:2 * self.s.max_concurrency_of(dest.id)]
                if not await self._grant(dest.id, batch):
                    break
                try:
                    res = await self._client(dest.id).call(MigrateIn(batch, adopt=True), timeout=self.s.rpc_timeout_s)
                except RemoteError as exc:
                    if exc.code not in ("not_retained", "busy"):
                        self.log.warning("adopt_refused", dest=dest.id, version=version, lineage=lineage,
                                         error=str(exc))
                    declined[dest.id] = exc.code
                    continue
                except RpcError as exc:
                    self.log.warning("adopt_failed", dest=dest.id, version=version, lineage=lineage, error=str(exc))
                    continue
                took = set(res.accepted) | set(res.gone)
                for tid in took:
                    self.orphans.pop(tid, None)
                self._count_placed(res.accepted)
                self.c.adopted += len(res.accepted)
                if res.accepted:
                    self.log.info("orphans_adopted", dest=dest.id, version=version, lineage=lineage,
                                  ids=sorted(res.accepted)[:64], trajectories=len(res.accepted))
                parts = [p for p in parts if p.spec.trajectory_id not in took]
            if parts:
                self.log.info("orphans_not_adopted", version=version, lineage=lineage, trajectories=len(parts),
                              declined=declined)
            left += [p.spec.trajectory_id for p in parts]
        return left

    async def _restart(self, tids: list[str]) -> None:
        """Start stuck orphans again from their prompts on the roomiest live rollout."""
        live = sorted((v for v in self.views.values() if v.alive and v.stats.state != "loading"),
                      key=lambda v: v.stats.active)
        if not live:
            return
        dest = live[0]
        fresh, old = [], {}
        for tid in tids[:max(0, 2 * self.s.max_concurrency_of(dest.id) - dest.stats.active)]:
            p, _ = self.orphans[tid]
            new_id = restarted_id(tid)
            fresh.append(PartialState(spec=dataclasses.replace(p.spec, trajectory_id=new_id),
                                      tokens=np.zeros(0, np.int32), logprobs=np.zeros(0, np.float32),
                                      version=dest.stats.version, rollout_id=dest.id, next_seq=1))
            old[new_id] = tid
        if fresh:  # the new copies exist in the partial pool (seq 0, no tokens) before the old ones are completed,
            try:   # so that no moment leaves the work only in one rollout's memory; the rollout resumes at seq 1
                await self.partials.call(AppendDeltas(dest.id, [
                    TokenDelta(p.spec.trajectory_id, 0, np.zeros(0, np.int32), np.zeros(0, np.float32), p.version,
                               p.spec)
                    for p in fresh]), timeout=self.s.rpc_timeout_s)
            except RpcError as exc:
                self.log.warning("orphan_restart_deferred", trajectories=len(fresh), error=str(exc))
                return
        placed = await self._migrate_in(dest.id, fresh) if fresh else set()
        done = [old[n] for n in placed]
        if done:
            try:  # the old partial must not be found and resumed again
                await self.partials.call(CompletePartial(done), timeout=self.s.rpc_timeout_s)
            except RpcError as exc:
                self.log.warning("orphan_complete_failed", trajectories=len(done), error=str(exc))
            for tid in done:
                self.orphans.pop(tid, None)
            self.c.restarted += len(done)
            self.log.warning("orphans_restarted", dest=dest.id, version=dest.stats.version, ids=sorted(placed)[:64],
                             why=f"no live rollout of their version for {self.s.orphan_wait_s}s")

    def _hosts_of(self, version: int, lineage: int = -1) -> list[RolloutView]:
        """Live rollouts holding `version` (of `lineage`, when the work names one: the same number on
        another lineage is other weights, which MigrateIn refuses), most room first."""
        vs = [v for v in self.views.values() if v.alive and v.stats.version == version and v.stats.state != "loading"
              and (lineage < 0 or v.stats.lineage == lineage)]
        return sorted(vs, key=lambda v: v.stats.active)

    # -- plumbing ---------------------------------------------------------------------------------
    def _client(self, rollout_id: str):
        addr = self.views[rollout_id].stats.control_address or self.address_of(rollout_id)
        c = self.clients.get(rollout_id)
        if c is None or getattr(c, "address", addr) != addr:
            if c is not None:
                c.close()
            c = self.clients[rollout_id] = self.t.client(addr)
        return c

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
        if self.partials is not None:
            self.partials.close()
        for c in self.prompt_pools.values():
            c.close()
        if self.buffer is not None:
            self.buffer.close()
        if self._timeline is not None:
            self._timeline.close()
        if self._repacks is not None:
            self._repacks.close()

    def view(self) -> dict:
        return {v.id: {"version": v.stats.version, "kv": round(v.stats.kv_usage, 3), "running": v.stats.running,
                       "waiting": v.stats.waiting, "active": v.stats.active, "state": v.stats.state,
                       "alive": v.alive, "tokens_per_s": round(v.stats.tokens_per_s, 1)}
                for v in sorted(self.views.values(), key=lambda v: v.id)}


_RESTART = re.compile(r"~r(\d+)$")


def restarted_id(tid: str) -> str:
    """The id of an orphan restarted from its prompt: `~r<n+1>` in place of a trailing `~r<n>`, else
    `~r1` appended. Only a trailing suffix counts: a prompt id may itself contain `~r` (before, the
    first `~r` anywhere was taken for it, and `int()` of the rest crashed the manager in a loop)."""
    m = _RESTART.search(tid)
    return f"{tid[:m.start()]}~r{int(m.group(1)) + 1}" if m else f"{tid}~r1"


def _emptied(s: RolloutStats) -> RolloutStats:
    """The source's view right after MigrateOut: it holds nothing until its next report."""
    return dataclasses.replace(s, kv_usage=0.0, running=0, waiting=0, active=0)

