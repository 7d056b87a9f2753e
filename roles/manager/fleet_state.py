"""The fleet's data: its settings, its counters and its view of one rollout (roles/manager/fleet.py).

Plain dataclasses, no I/O. `FleetSettings` resolves the manager's settings (ManagerConfig's names
and defaults) for the cluster; `FleetCounters` is what the manager reports in its status;
`RolloutView` is the fleet's picture of one rollout, rebuilt from its reports (each carries the
full state) and heartbeats, and its input to the repack plan (`load`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from laminar.roles.manager.config import ManagerConfig
from laminar.roles.manager.repack import ReplicaLoad

from laminar.protocol import RolloutStats


@dataclass
class RolloutView:
    """The fleet's view of one rollout: its latest report, when it was last heard, whether it is alive."""

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
    """What the fleet did, reported in the manager's status."""

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


def emptied(s: RolloutStats) -> RolloutStats:
    """The source's view right after MigrateOut: it holds nothing until its next report."""
    return dataclasses.replace(s, kv_usage=0.0, running=0, waiting=0, active=0)

