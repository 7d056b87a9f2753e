"""Recovery: the work of dead rollouts and of failed moves, kept as orphans until it runs again.

A dead rollout's partials (InFlightOf, page by page: each reply is bounded) and those no live
rollout owns (`reconcile`: rollouts that died while no manager ran) join `orphans`, as do the
partials of a repack move whose MigrateIn was refused (`unmoved`); then its prompt pools' entries
are accounted (accounting.py). Each tick `place_orphans` sends them, by the weights they name
(lineage, version), to live rollouts of those weights (re-prefill from prompt + generated tokens).

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

State, all written under the fleet's lock (its tick, its repack) except `lost`, which the fleet's
liveness inputs append to: `orphans` (trajectory id -> (its partial, since when)), `unmoved` (the
orphans a failed move left), `lost` (dead rollouts, as (id, pid), not yet recovered).
"""
from __future__ import annotations

import asyncio
import dataclasses
import re
import time

import numpy as np
from laminar.bus.errors import RemoteError, RpcError
from laminar.roles.manager.accounting import GroupAccounting
from laminar.roles.manager.fleet_state import FleetCounters, FleetSettings, RolloutView
from laminar.roles.manager.moves import Mover

from laminar.protocol import AppendDeltas, CompletePartial, InFlightOf, MigrateIn, PartialState, TokenDelta


class Recovery:
    """Owns the orphans: finds them (dead rollouts, reconcile), places, adopts or restarts them."""

    def __init__(self, views: dict[str, RolloutView], partials, mover: Mover, accounting: GroupAccounting,
                 settings: FleetSettings, counters: FleetCounters, log):
        self.views, self.partials, self.mover, self.accounting = views, partials, mover, accounting
        self.settings, self.counters, self.log = settings, counters, log
        self.orphans: dict[str, tuple[PartialState, float]] = {}
        self.unmoved: set[str] = set()  # orphans a failed repack move left, not a dead rollout's work
        self.lost: asyncio.Queue[tuple[str, int]] = asyncio.Queue(maxsize=1024)  # (rollout id, its dead pid)

    def forget(self, tids) -> None:
        """These finished elsewhere (MigrateIn answered them `gone`): no longer orphans."""
        for tid in tids:
            self.orphans.pop(tid, None)

    def unplaced(self, parts: list[PartialState], placed: set[str]) -> None:
        """A repack move's partials its destination did not take: orphans, placed again on every tick."""
        now = time.monotonic()
        for p in parts:
            if p.spec.trajectory_id not in placed:
                self.orphans[p.spec.trajectory_id] = (p, now)
                self.unmoved.add(p.spec.trajectory_id)

    async def recover(self, rollout_id: str, pid: int = 0) -> None:
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
        if not await self.accounting.settle(rollout_id, pid, dead=True):  # its groups not yet anywhere
            self.lost.put_nowait((rollout_id, pid))

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
            res = await self.partials.call(InFlightOf(rollout_id, after=after), timeout=self.settings.rpc_timeout_s)
            out += res.partials
            if not res.more or not res.partials:
                return out
            after = res.next_after

    async def place_orphans(self) -> None:
        self.unmoved &= self.orphans.keys()  # placed, restarted or finished elsewhere: no longer orphans
        if not self.orphans:
            return
        by_weights: dict[tuple[int, int], list[PartialState]] = {}
        for p, _ in self.orphans.values():
            by_weights.setdefault((p.lineage, p.version), []).append(p)
        for (lineage, version), parts in by_weights.items():
            for dest in self.hosts_of(version, lineage):
                room = 2 * self.settings.max_concurrency_of(dest.id) - dest.stats.active  # MigrateIn's own bound
                if room <= 0 or not parts:
                    continue
                batch, parts = parts[:room], parts[room:]
                placed = await self.mover.migrate_in(dest.id, batch)
                for tid in placed:
                    self.orphans.pop(tid, None)
                self.count_placed(placed)
                if placed:
                    self.log.info("orphans_placed", dest=dest.id, version=version, trajectories=len(placed))
                parts += [p for p in batch if p.spec.trajectory_id not in placed]
        now = time.monotonic()
        stuck = [t for t, (_, since) in self.orphans.items() if now - since > self.settings.orphan_wait_s]
        if stuck and self.settings.orphan_policy == "retained":
            stuck = await self.adopt(stuck)
        if stuck and self.settings.orphan_policy in ("restart", "retained"):
            await self.restart(stuck)
        elif stuck:
            self.log.warning("orphans_stuck", trajectories=len(stuck), waiting_s=self.settings.orphan_wait_s)

    def count_placed(self, tids) -> None:
        """Orphans now running on a live rollout: a failed move's (`replaced`) or a dead rollout's
        (`recovered`), so the counter of dead rollouts' work counts nothing else."""
        for tid in tids:
            if tid in self.unmoved:
                self.unmoved.discard(tid)
                self.counters.replaced += 1
            else:
                self.counters.recovered += 1

    async def adopt(self, tids: list[str]) -> list[str]:
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
                batch = parts[:2 * self.settings.max_concurrency_of(dest.id)]
                if not await self.mover.grant(dest.id, batch):
                    break
                try:
                    res = await self.mover.client(dest.id).call(MigrateIn(batch, adopt=True),
                                                                timeout=self.settings.rpc_timeout_s)
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
                self.count_placed(res.accepted)
                self.counters.adopted += len(res.accepted)
                if res.accepted:
                    self.log.info("orphans_adopted", dest=dest.id, version=version, lineage=lineage,
                                  ids=sorted(res.accepted)[:64], trajectories=len(res.accepted))
                parts = [p for p in parts if p.spec.trajectory_id not in took]
            if parts:
                self.log.info("orphans_not_adopted", version=version, lineage=lineage, trajectories=len(parts),
                              declined=declined)
            left += [p.spec.trajectory_id for p in parts]
        return left

    async def restart(self, tids: list[str]) -> None:
        """Start stuck orphans again from their prompts on the roomiest live rollout."""
        live = sorted((v for v in self.views.values() if v.alive and v.stats.state != "loading"),
                      key=lambda v: v.stats.active)
        if not live:
            return
        dest = live[0]
        fresh, old = [], {}
        for tid in tids[:max(0, 2 * self.settings.max_concurrency_of(dest.id) - dest.stats.active)]:
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
                    for p in fresh]), timeout=self.settings.rpc_timeout_s)
            except RpcError as exc:
                self.log.warning("orphan_restart_deferred", trajectories=len(fresh), error=str(exc))
                return
        placed = await self.mover.migrate_in(dest.id, fresh) if fresh else set()
        done = [old[n] for n in placed]
        if done:
            try:  # the old partial must not be found and resumed again
                await self.partials.call(CompletePartial(done), timeout=self.settings.rpc_timeout_s)
            except RpcError as exc:
                self.log.warning("orphan_complete_failed", trajectories=len(done), error=str(exc))
            for tid in done:
                self.orphans.pop(tid, None)
            self.counters.restarted += len(done)
            self.log.warning("orphans_restarted", dest=dest.id, version=dest.stats.version, ids=sorted(placed)[:64],
                             why=f"no live rollout of their version for {self.settings.orphan_wait_s}s")

    def hosts_of(self, version: int, lineage: int = -1) -> list[RolloutView]:
        """Live rollouts holding `version` (of `lineage`, when the work names one: the same number on
        another lineage is other weights, which MigrateIn refuses), most room first."""
        vs = [v for v in self.views.values() if v.alive and v.stats.version == version and v.stats.state != "loading"
              and (lineage < 0 or v.stats.lineage == lineage)]
        return sorted(vs, key=lambda v: v.stats.active)


_RESTART = re.compile(r"~r(\d+)$")


def restarted_id(tid: str) -> str:
    """The id of an orphan restarted from its prompt: `~r<n+1>` in place of a trailing `~r<n>`, else
    `~r1` appended. Only a trailing suffix counts: a prompt id may itself contain `~r` (before, the
    first `~r` anywhere was taken for it, and `int()` of the rest crashed the manager in a loop)."""
    m = _RESTART.search(tid)
    return f"{tid[:m.start()]}~r{int(m.group(1)) + 1}" if m else f"{tid}~r1"
