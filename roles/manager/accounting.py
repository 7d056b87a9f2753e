"""GroupAccounting: the prompt pools' side of recovery, the I/O around handed.py's rule.

A group handed to a rollout lives only in its memory until the first delta flush. The prompt pools
record what they hand to whom; this pass reads those lists (HandedGroups, paged), asks the partial
pool and then the buffer which members each holds (GroupPresence, in that order, so a trajectory
moving from one to the other is seen in one of them), lets `settle_entries` decide, and sends the
decision (RequeueGroups: what to hand out again, what is settled). The fleet calls it for a dead
rollout (recovery.py) and for every rollout every `settle_interval_s`, which keeps the pools' lists
as short as the work in flight.

Nothing is requeued on a guess: a pool that does not answer ends the pass with False (call again).
State: `strangers`, the owners the pass met that the fleet never heard from, and when (handed.py).
"""
from __future__ import annotations

import time

from laminar.bus.errors import RpcError
from laminar.roles.manager.fleet_state import FleetCounters, FleetSettings, RolloutView
from laminar.roles.manager.handed import HandedRow, Owners, Settlement, settle_entries

from laminar.protocol import GroupPresence, HandedGroups, HandedList, RequeueGroups


class GroupAccounting:
    """Settles or requeues the prompt pools' handed-out entries, one rollout's or everyone's."""

    def __init__(self, prompt_pools: dict, partials, buffer, views: dict[str, RolloutView],
                 settings: FleetSettings, counters: FleetCounters, log):
        self.prompt_pools, self.partials, self.buffer = prompt_pools, partials, buffer
        self.views, self.settings, self.counters, self.log = views, settings, counters, log
        self.strangers: dict[str, float] = {}  # owner never reported -> when the pass first met it

    async def settle(self, rollout_id: str = "*", pid: int = 0, dead: bool = False) -> bool:
        """Account the prompt pools' outstanding entries of one rollout (or all): settle those whose
        members are all in the partial pool or the buffer; requeue, for a dead owner, what is
        nowhere (the whole group, or the missing members alone). False: a pool did not answer
        (nothing was requeued on a guess; call again)."""
        if not self.prompt_pools or self.partials is None or self.buffer is None:
            return True
        known = frozenset(self.views)
        live = {v.id: v.pid for v in self.views.values() if v.alive}
        self.strangers = {o: t for o, t in self.strangers.items() if o not in known}
        now, ok = time.monotonic(), True
        for pool_id, pool in self.prompt_pools.items():  # a pool that does not answer: the others still go
            ok = await self._settle_pool(pool_id, pool, rollout_id, pid, dead, known, live, now) and ok
        return ok

    async def _settle_pool(self, pool_id: str, pool, rollout_id: str, pid: int, dead: bool,
                           known: frozenset[str], live: dict[str, int], now: float) -> bool:
        """One prompt pool's list, page by page; False when it or a presence source did not answer."""
        offset = 0
        while True:
            try:
                page = await pool.call(HandedGroups(rollout_id, pid, self.settings.settle_page, offset),
                                       timeout=self.settings.rpc_timeout_s)
                present = await self._present(page)
            except RpcError as exc:
                self.log.warning("settle_deferred", prompt_pool=pool_id, rollout=rollout_id, error=str(exc))
                return False
            owners = Owners(known, live, self.strangers, now, self.settings.rollout_dead_after_s, dead)
            decision = settle_entries(_rows(page), present, owners)
            self.strangers.update(decision.strangers)
            if (decision.requeue or decision.settled) and not await self._send(pool_id, pool, rollout_id, decision):
                return False
            if not page.more:
                return True
            offset += decision.kept  # settled and requeued entries left the list; the kept ones stay ahead

    async def _present(self, page: HandedList) -> dict[str, set[int]]:
        """Group id -> the members the partial pool or the buffer holds (asked in that order: a
        trajectory moving from one to the other is seen once). The partial pool counts, of an entry
        in flight, only members of the attempt it went out as."""
        gids = sorted(set(page.group_ids))
        attempts = (dict(zip(page.entries, page.attempts, strict=True))
                    if len(page.attempts) == len(page.entries) else {})
        present: dict[str, set[int]] = {}
        for src in (self.partials, self.buffer):
            got = await src.call(GroupPresence(gids, attempts if src is self.partials else {}),
                                 timeout=self.settings.rpc_timeout_s)
            for g, idx in got.present.items():
                present.setdefault(g, set()).update(idx)
        return present

    async def _send(self, pool_id: str, pool, rollout_id: str, decision: Settlement) -> bool:
        """RequeueGroups with the decision; counts and logs what the pool took. False: no answer."""
        requeue, settled = decision.requeue, decision.settled
        try:
            res = await pool.call(RequeueGroups(requeue, rollout_id if rollout_id != "*" else "", settled),
                                  timeout=self.settings.rpc_timeout_s)
        except RpcError as exc:
            self.log.warning("settle_deferred", prompt_pool=pool_id, rollout=rollout_id, error=str(exc))
            return False
        refused = dict(getattr(res, "refused", None) or {})  # per item (an older pool: an Ack)
        if refused:
            self.log.error("requeue_entries_refused", prompt_pool=pool_id, rollout=rollout_id,
                           refused=dict(list(refused.items())[:16]), count=len(refused))
            requeue = [e for e in requeue if e not in refused]
            settled = [e for e in settled if e not in refused]
        self.counters.requeued += len(requeue)
        self.counters.settled += len(settled)
        if requeue:
            self.log.warning("groups_requeued", prompt_pool=pool_id, rollout=rollout_id,
                             entries=requeue[:64], count=len(requeue))
        return True


def _rows(page: HandedList) -> list[HandedRow]:
    """A HandedList page as rows."""
    return [HandedRow(e, owner, size, g, m, p) for e, owner, size, g, m, p in
            zip(page.entries, page.rollout_ids, page.group_sizes, page.group_ids, page.members, page.pids,
                strict=False)]
