"""Mover: the requests that move in-flight work onto a rollout, and the rollouts' control clients.

A rollout takes over in the partial pool only what it owns or was granted (docs/security.md), so
every MigrateIn is preceded by GrantPartials for the same trajectories; a grant the pool does not
answer sends no MigrateIn (its claims would be refused). Used by the repack (fleet.py: a source's
work to its destination) and by recovery (recovery.py: orphans to live rollouts).

State: `clients`, one control client per rollout, replaced when its reported address changes.
A MigrateIn marks its destination `received_at` (its load is unknown until its next report) and
hands the ids the rollout answered `gone` (finished elsewhere) to `forget`: they are no orphans.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from laminar.bus.errors import RpcError
from laminar.roles.manager.fleet_state import FleetSettings, RolloutView

from laminar.protocol import GrantPartials, MigrateIn, PartialState


class Mover:
    """GrantPartials then MigrateIn to a rollout, over one cached control client per rollout."""

    def __init__(self, transport, address_of: Callable[[str], str], partials, views: dict[str, RolloutView],
                 settings: FleetSettings, log, forget: Callable[[set[str]], None]):
        self.transport, self.address_of, self.partials = transport, address_of, partials
        self.views, self.settings, self.log = views, settings, log
        self.forget = forget  # forget(ids): these finished elsewhere (Recovery.forget)
        self.clients: dict[str, object] = {}

    def client(self, rollout_id: str):
        """The control client of `rollout_id`, at the address its latest report names."""
        addr = self.views[rollout_id].stats.control_address or self.address_of(rollout_id)
        c = self.clients.get(rollout_id)
        if c is None or getattr(c, "address", addr) != addr:
            if c is not None:
                c.close()
            c = self.clients[rollout_id] = self.transport.client(addr)
        return c

    async def grant(self, dest: str, parts: list[PartialState]) -> bool:
        """Let rollout `dest` take these over in the partial pool (no owner changes until it does);
        False if the pool did not answer (the MigrateIn is then not sent: its claims would be refused)."""
        if self.partials is None:
            return True
        try:
            await self.partials.call(GrantPartials([p.spec.trajectory_id for p in parts], dest),
                                     timeout=self.settings.rpc_timeout_s)
            return True
        except RpcError as exc:
            self.log.warning("grant_failed", dest=dest, trajectories=len(parts), error=str(exc))
            return False

    async def migrate_in(self, dest: str, parts: list[PartialState]) -> set[str]:
        """Grant, then MigrateIn: the ids `dest` took, or that need no placing (gone); empty on failure."""
        if not await self.grant(dest, parts):
            return set()
        try:
            res = await self.client(dest).call(MigrateIn(parts), timeout=self.settings.rpc_timeout_s)
        except RpcError as exc:
            self.log.warning("migrate_in_failed", dest=dest, trajectories=len(parts), error=str(exc))
            return set()
        v = self.views.get(dest)
        if v is not None:
            v.received_at = time.monotonic()
        self.forget(set(res.gone))  # finished elsewhere meanwhile (e.g. its rollout came back): not an orphan
        return set(res.accepted) | set(res.gone)  # gone ones need no placing either

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
