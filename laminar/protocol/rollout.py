"""Kinds of the rollout role (docs/architecture.md §5, §7): its periodic report and the migration commands.

RolloutStats is pub/sub on `rollout.stats.<id>` (each carries the full current state, so a lost
one costs nothing); MigrateOut/MigrateIn are request/reply from the manager and must arrive.
"""
from __future__ import annotations

import dataclasses

from laminar.protocol.data import PartialState
from laminar.protocol.registry import event

__all__ = ["RolloutStats", "MigrateOut", "MigrateIn", "MigrateInResult"]


@event("rollout.stats")
class RolloutStats:
    rollout_id: str
    host: str
    version: int              # weight version loaded in the engine
    kv_usage: float           # 0..1, from vLLM's scheduler statistics
    running: int              # trajectories the engine is decoding
    waiting: int              # trajectories queued in the engine
    active: int               # trajectories this rollout owns (running + waiting + finishing)
    tokens_per_s: float       # generated tokens per second over the last interval
    state: str                # idle | generating | loading | draining
    batches: int = 0
    generated_tokens: int = 0
    control_address: str = ""  # where MigrateOut/MigrateIn go
    ts: float = 0.0
    lineage: int = 0          # lineage epoch of the loaded weights (with version: which weights)
    weight_pull_failures: int = 0  # weight loads that failed (the rollout kept its weights)
    puts_refused: int = 0     # PutTrajectory answers other than stored/duplicate (retried)
    run_id: str = ""          # the run of the loaded weights (with lineage and version: which weights)


@event("rollout.migrate_out")
class MigrateOut:
    """Abort these trajectories and return their final partial state (durable in the pool first).
    `everything`: all of the rollout's trajectories still generating (a repack empties a source)."""
    trajectory_ids: list[str]
    reason: str = "repack"
    everything: bool = False


@event("rollout.migrate_in")
class MigrateIn:
    """Continue these trajectories here: prompt + generated tokens become the new prefix.

    Refused (code `refused`) unless every partial's version equals this rollout's version, or
    `adopt` is set: then the partials (one version) are queued, and when the rollout's current
    work is done it loads that version from its relay's retained versions, generates them and
    nothing else, and moves on to the newest version (refused `not_retained` if the relay has
    no such version, `busy` if it already holds adopted work of another version).
    """
    partials: list[PartialState]
    adopt: bool = False


@event("rollout.migrate_in_result")
class MigrateInResult:
    accepted: list[str]
    version: int
    gone: list[str] = dataclasses.field(default_factory=list)  # no longer in flight (completed elsewhere): drop them
