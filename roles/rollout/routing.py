"""RoutingPuller: a mixture-of-experts policy's routing, from the engine into each active trajectory.

The engine records the experts it routes every processed position to (roles/rollout/engine.py,
moe_worker.py); a trajectory holds the rows of positions [0, n) of its prompt + tokens
(trajectory.py). `pull` asks the engine, in one call for all the trajectories given, for the rows
past n up to the positions whose tokens the trajectory already holds (the engine may run a step
ahead of what it has delivered), through the request each trajectory is generating now
(`Active.request_id`). Rows a trajectory holds are never replaced: one resumed on this rollout keeps
its earlier rollout's rows and takes from this engine's re-prefill only the positions after them.

When: before every flush to the partial pool (so a rollout that dies loses no more routing than
tokens), when a model turn ends (multi-turn: before the next turn's request replaces it; the
observation tokens get their rows from the next turn's prefill, the forward that processed them)
and when a trajectory's generation ends (`done`: the engine may forget the request).

A pull that fails or takes longer than `timeout_s` (the engine died: a call in flight when the
engine core is killed is never answered) is logged and counted, never raised: the flush still sends the
tokens, and the positions whose rows were lost get them from the re-prefill of whichever engine
resumes the trajectory.

Cost: the rows travel as raw bytes (one collective call per pull), and each trajectory carries
layers x top_k bytes per position (uint8 for up to 256 experts).
"""
from __future__ import annotations

import asyncio

from laminar.roles.rollout.trajectory import Active

from laminar.models.routing import nbytes


class RoutingPuller:
    """Pulls routing rows from the engine into active trajectories."""

    def __init__(self, engine, log, timeout_s: float = 30.0):
        self.engine, self.log, self.timeout_s = engine, log, timeout_s
        self.rows = 0          # rows taken in (this rollout's life)
        self.pulls = self.failures = 0

    async def pull(self, actives: list[Active], done: bool = False) -> None:
        """Rows up to each trajectory's known positions; `done`: their requests end here."""
        asks, who = [], []
        for a in actives:
            have = 0 if a.routing is None else len(a.routing)
            if a.request_id is not None and a.positions > have:
                asks.append((a.request_id, have, a.positions))
                who.append(a)
        drop = [a.request_id for a in actives if done and a.request_id is not None]
        if not asks and not drop:
            return
        try:
            got = await asyncio.wait_for(self.engine.routing(asks, drop), self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - a dead engine: the tokens still go, rows come from the next engine
            self.failures += 1
            if self.failures <= 3 or self.failures % 100 == 0:  # a dead engine fails every flush: not each logged
                self.log.warning("routing_pull_failed", trajectories=len(who), error=f"{type(exc).__name__}: {exc}",
                                 failures=self.failures)
            return
        self.pulls += 1
        for a, g in zip(who, got, strict=True):
            if g is not None:
                self.rows += a.add_routing(g[1], g[0])
        if done:
            for a in actives:
                a.request_id = None

    @staticmethod
    def bytes_of(a: Active) -> int:
        return nbytes(a.routing)
