"""ManagerConfig: the manager's settings (roles.manager in a cluster file).

The fleet (fleet.py) runs by these too: FleetSettings.from_config resolves them for the cluster,
and each setting has its one default here.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ManagerConfig(BaseModel):
    """Settings of the manager (roles.manager): the relay chain's and the rollout fleet's."""

    model_config = ConfigDict(extra="forbid")
    probe_timeout_s: float = Field(0.3, gt=0, description="deadline of the TCP probe of a relay reported down")
    rpc_timeout_s: float = Field(5.0, gt=0, description="deadline of the manager's requests: SetDownstream "
                                 "to relays, and the fleet's calls to rollouts and pools")
    state_interval_s: float = Field(2.0, gt=0, description="period of the ChainState republication")
    dead_after_s: float | None = Field(None, gt=0, description="heartbeat silence that declares a relay dead "
                                       "(default: cluster.dead_after_s)")
    address: str = Field("tcp://127.0.0.1:0", description="bind address when the config gives no port")
    repack: bool | None = Field(None, description="dynamic repack (default: on in laminar mode, off otherwise)")
    repack_interval_s: float = Field(5.0, gt=0, description="period of the repack plan (also run after each new "
                                     "version)")
    c_max: float = Field(0.99, gt=0, le=1, description="KV-cache fraction a destination may reach "
                         "(docs/architecture.md §7, C_max)")
    repack_trend: str = Field("peak", pattern="^(peak|previous)$", description="when a replica counts as draining "
                              "(a repack candidate): its KV usage is below its batch's peak (peak: since it last "
                              "admitted work) or below its previous report (previous: the paper's listing, which "
                              "a long tail's creeping KV defeats between finishes)")
    batch_bound: int = Field(32, ge=1, description="B: largest decode batch whose step time stays near batch 1 "
                             "(the roofline knee), used when no curve_path is given")
    curve_path: str | None = Field(None, description="step-latency curve (JSON of `python bench/step_curve.py --out`, "
                                   "or [[batch, ms], ...]): B is derived from it (step <= 1.2 x batch 1)")
    rollout_dead_after_s: float | None = Field(None, gt=0, description="rollout silence that declares it dead "
                                               "(default: dead_after_s, else cluster.dead_after_s)")
    orphan_wait_s: float = Field(30.0, gt=0, description="how long a dead rollout's trajectories wait for a live "
                                 "rollout of their version")
    orphan_policy: str = Field("restart", pattern="^(restart|wait|retained)$", description="then: restart them from "
                               "their prompts on the newest version (new id <id>~r<n>); wait (and warn) for a rollout "
                               "of their version; or retained: a rollout whose relay retains their version (relay "
                               "retain_versions) adopts them and resumes them on it, else restart")
    partial_pool: str = Field("0", description="id of the partial pool role (in-flight state of dead rollouts)")
    experience_buffer: str = Field("0", description="id of the experience buffer (where finished groups are)")
    settle_interval_s: float = Field(10.0, gt=0, description="period of the prompt pools' accounting: groups "
                                     "handed out that reached the partial pool or buffer are settled, and those of "
                                     "dead rollouts that reached neither are requeued")
    stall_lag_versions: int = Field(4, ge=0, description="K of the weights_stalled alarm: raised when the trainer's "
                                    "newest version leads the version live rollouts serve (same lineage; at "
                                    "stall_quantile) by more than K versions ...")
    stall_after_s: float = Field(120.0, gt=0, description="... for T seconds; cleared when the lag is back within K")
    stall_quantile: float = Field(0.0, ge=0, le=1, description="which rollout the weights_stalled alarm compares: "
                                  "the quantile of the live rollouts' versions (0: the slowest, so any rollout "
                                  "left behind raises it; 0.5: the median; 1: the newest)")

    def relay_dead_after_s(self, cluster) -> float:
        """Heartbeat silence that declares a relay dead: dead_after_s, else the cluster's (5 s when
        the manager runs without a cluster config)."""
        return self.dead_after_s or (cluster.cluster.dead_after_s if cluster is not None else 5.0)
