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
  InFlightOf(dead rollout) from the partial pool, then MigrateIn of those partials to live
  rollouts of the same version (recovery.py); HandedGroups / GroupPresence / RequeueGroups for the
  prompt pools' group accounting (accounting.py, its rule in handed.py).

The fleet is a wiring shell around its components, each given what it needs, none knowing the
fleet (the rollout role's recipe):
    fleet_state.py  FleetSettings, FleetCounters, RolloutView: its data
    repack.py       plan_repack: which sources empty into which destinations (pure)
    moves.py        Mover: GrantPartials + MigrateIn, the rollouts' control clients
    recovery.py     Recovery: the orphans: dead rollouts' and failed moves' work, placed, adopted, restarted
    accounting.py   GroupAccounting: the prompt pools' handed-out entries, settled or requeued
    handed.py       settle_entries: that accounting's ownership rule (pure)

Tasks: the manager feeds `on_stats` / `on_heartbeat` / `new_version` from its subscription, and
owns `run` (the tick). Who writes what:

  views            on_stats / on_heartbeat (add, refresh, revive); sweep and on_heartbeat declare
                   one dead (alive False); repack's move empties a source's stats until its next
                   report; the mover stamps `received_at`. Everyone else reads.
  recovery.lost    appended by _declare_dead (any input), drained by the tick under `lock`.
  recovery.orphans, .unmoved
                   the tick and the repack, both under `lock` (recovery, reconcile, placement, a
                   failed move); the mover removes ids answered `gone`, inside those same calls.
  accounting.strangers
                   the accounting pass alone (under `lock`).
  counters         each by the component doing the counted thing; read by the manager's status.
One lock serializes plans, recoveries and placements; one event loop, so nothing interleaves
between two awaits.
"""
from __future__ import annotations

import asyncio
import json
import time

from laminar.bus.errors import RpcError
from laminar.roles.manager.accounting import GroupAccounting
from laminar.roles.manager.fleet_state import FleetCounters, FleetSettings, RolloutView, emptied
from laminar.roles.manager.moves import Mover
from laminar.roles.manager.recovery import Recovery
from laminar.roles.manager.repack import ReplicaLoad, plan_repack

from laminar import failpoints
from laminar.logs import RotatingFile
from laminar.protocol import Heartbeat, MigrateOut, PartialState, RolloutStats

__all__ = ["Fleet", "FleetCounters", "FleetSettings", "RolloutView"]


class Fleet:
    """The manager's picture of the rollouts and what it does with it: liveness (from their reports
    and heartbeats), dynamic repack (plan_repack, executed as MigrateOut/MigrateIn), and, through its
    components, recovery of dead rollouts' work (Recovery) and the prompt pools' group accounting
    (GroupAccounting). Owns `views` (one RolloutView per rollout), `counters`, the repack and timeline
    JSONL files, and the tick (`run`)."""

    def __init__(self, transport, log, settings: FleetSettings, address_of, partial_pool_address: str | None,
                 prompt_pool_addresses: dict[str, str] | None = None, buffer_address: str | None = None):
        self.transport, self.log, self.settings = transport, log, settings
        self.partials = transport.client(partial_pool_address) if partial_pool_address else None
        self.prompt_pools = {i: transport.client(a) for i, a in (prompt_pool_addresses or {}).items()}
        self.buffer = transport.client(buffer_address) if buffer_address else None
        self.views: dict[str, RolloutView] = {}
        self.counters = FleetCounters()
        self.kick = asyncio.Event()
        self.lock = asyncio.Lock()
        self.mover = Mover(transport, address_of, self.partials, self.views, settings, log,
                           forget=lambda tids: self.recovery.forget(tids))
        self.accounting = GroupAccounting(self.prompt_pools, self.partials, self.buffer, self.views, settings,
                                          self.counters, log)
        self.recovery = Recovery(self.views, self.partials, self.mover, self.accounting, settings,
                                 self.counters, log)
        self._repacks: RotatingFile | None = None  # opened at the first repack
        self._timeline: RotatingFile | None = None
        if settings.timeline_path is not None:  # line-buffered (readable live), rotated by size
            self._timeline = RotatingFile(settings.timeline_path, settings.timeline_max_bytes, settings.timeline_keep)

    @property
    def orphans(self) -> dict[str, tuple[PartialState, float]]:
        """The work waiting for a rollout (Recovery.orphans)."""
        return self.recovery.orphans

    async def settle_handed(self, rollout_id: str = "*", pid: int = 0, dead: bool = False) -> bool:
        """The prompt pools' accounting pass for one rollout or all (GroupAccounting.settle)."""
        return await self.accounting.settle(rollout_id, pid, dead)

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
            if v.alive and now - v.seen_at > self.settings.rollout_dead_after_s:
                self._declare_dead(v, f"silent for {now - v.seen_at:.1f}s")

    def _declare_dead(self, v: RolloutView, why: str) -> None:
        v.alive = False
        self.counters.dead += 1
        self.log.warning("rollout_dead", rollout=v.id, why=why, version=v.stats.version)
        try:
            self.recovery.lost.put_nowait((v.id, v.pid))
        except asyncio.QueueFull:
            self.log.error("lost_queue_full", rollout=v.id)
        self.kick.set()

    # -- loops (owned by the manager role) -------------------------------------------------------
    async def run(self) -> None:
        """Periodic tick: sweep liveness, recover dead rollouts' work, place orphans, repack."""
        tick = min(self.settings.repack_interval_s, max(self.settings.rollout_dead_after_s / 2, 0.2))
        next_repack = time.monotonic() + self.settings.repack_interval_s
        # first reconcile once every live rollout had time to report (a restarted manager)
        next_reconcile = time.monotonic() + 2 * self.settings.rollout_dead_after_s
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
                lost = self.recovery.lost
                for rid, pid in [lost.get_nowait() for _ in range(lost.qsize())]:
                    await self.recovery.recover(rid, pid)  # one that fails goes back in the queue for the next tick
                if time.monotonic() >= next_reconcile:
                    next_reconcile = time.monotonic() + self.settings.reconcile_s
                    await self.recovery.reconcile()
                if time.monotonic() >= next_settle:
                    next_settle = time.monotonic() + self.settings.settle_interval_s
                    await self.settle_handed()
                await self.recovery.place_orphans()
                if self.settings.repack and (kicked or time.monotonic() >= next_repack):
                    next_repack = time.monotonic() + self.settings.repack_interval_s
                    await self.repack()

    def new_version(self, version: int) -> None:
        """weights.version: the paper repacks right after each new version."""
        self.kick.set()

    # -- repack -----------------------------------------------------------------------------------
    def _trusted_loads(self) -> list[ReplicaLoad]:
        """Live rollouts whose latest report postdates any migration into them."""
        return [v.load(self.settings.repack_trend) for v in self.views.values()
                if v.alive and v.stats.state != "loading" and v.reported_at > v.received_at]

    async def repack(self) -> list[dict]:
        loads = self._trusted_loads()
        moves = plan_repack(loads, self.settings.c_max, self.settings.batch_bound)
        if not moves:
            return []
        self.counters.plans += 1
        t0 = time.monotonic()
        done = []
        for m in moves:
            moved = await self._move(m.source, m.dest, m.version)
            done.append({"source": m.source, "dest": m.dest, "version": m.version, "planned": m.running,
                         "moved": moved, "kv": round(m.kv, 4)})
        took = time.monotonic() - t0
        self.counters.last_repack_s = took
        rec = {"ts": time.time(), "moves": done, "seconds": round(took, 4)}
        self.counters.history = (self.counters.history + [rec])[-50:]
        if self.settings.log_path is not None:
            if self._repacks is None:
                s = self.settings
                self._repacks = RotatingFile(s.log_path, s.timeline_max_bytes, s.timeline_keep)
            self._repacks.write(json.dumps(rec) + "\n")
        self.log.info("repacked", moves=len(done), trajectories=sum(d["moved"] for d in done), seconds=round(took, 4))
        return done

    async def _move(self, source: str, dest: str, version: int) -> int:
        try:
            out = await self.mover.client(source).call(MigrateOut([], reason="repack", everything=True),
                                                  timeout=self.settings.rpc_timeout_s)
        except RpcError as exc:
            self.counters.failed_moves += 1
            self.log.warning("migrate_out_failed", source=source, error=str(exc))
            return 0
        parts = list(out.partials)
        if not parts:
            return 0
        self.views[source].stats = emptied(self.views[source].stats)
        failpoints.hit("manager.after_migrate_out")  # chaos: the window between the move's two calls
        placed = await self.mover.migrate_in(dest, parts)
        self.recovery.unplaced(parts, placed)
        if len(placed) < len(parts):
            self.counters.failed_moves += 1
            await self.recovery.place_orphans()
        self.counters.repacks += 1
        self.counters.moved_trajectories += len(placed)
        return len(placed)

    # -- plumbing ---------------------------------------------------------------------------------
    def close(self) -> None:
        self.mover.close()
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
