"""The settings of the scale simulator's trainer (`roles.trainer.sim`, with `engine: sim`).

Kept apart from the engine (sim_engine.py) so that reading a config imports only pydantic and the
cost model's constants: the trainer's TrainerConfig types its `sim` section with these models.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from laminar.sim.trainer_cost import TRAIN_MFU, NcclBroadcast, RelayLink


class RelaySettings(BaseModel):
    """The modeled relay chain the sim trainer charges for delivering a version."""
    model_config = ConfigDict(extra="forbid")
    bandwidth_gbps: float = Field(RelayLink.bandwidth_gbps, gt=0,
                                  description="one hop's bandwidth, GB/s (trainer_cost.RelayLink)")
    chunk_mib: float = Field(RelayLink.chunk_mib, gt=0, description="chunk size of the chain, MiB")
    alpha_s: float = Field(RelayLink.alpha_s, ge=0, description="per-chunk overhead of one hop, s")


class DeliverTarget(BaseModel):
    """One rollout host whose relay folder the sim trainer fills with each version."""
    model_config = ConfigDict(extra="forbid")
    host: str = Field(description="rollout host whose relay this stands for")
    dir: str = Field(description="the host's weight folder (the rollouts' shm_dir)")


class NcclSettings(BaseModel):
    """The blocking NCCL broadcast the sim trainer may charge instead of the relay stall."""
    model_config = ConfigDict(extra="forbid")
    bandwidth_gbps: float = Field(NcclBroadcast.bandwidth_gbps, gt=0,
                                  description="S/B term (trainer_cost.NcclBroadcast)")
    per_doubling_gbps: float = Field(NcclBroadcast.per_doubling_gbps, gt=0, description="S·log2(n)/C term")
    rollout_gpus: int = Field(1, ge=1, description="GPUs the broadcast reaches")


class SimTrainerSettings(BaseModel):
    """`roles.trainer.sim`: what the simulated trainer costs, and how its versions travel."""
    model_config = ConfigDict(extra="forbid")
    model: str = Field(description="model shape: 7B, 32B or 72B (laminar/sim/hardware.py)")
    gpus: int = Field(ge=1, description="training GPUs (for colocated sync: every GPU of the cluster)")
    gpu: str = Field("H800", description="GPU kind (hardware.GPUS)")
    mfu: float = Field(TRAIN_MFU, gt=0, le=1,
                       description="model FLOPs utilization of training (trainer_cost.TRAIN_MFU)")
    recompute: bool = Field(True, description="full activation recomputation: one more forward pass (× 4/3)")
    extra_forward_passes: int = Field(0, ge=0, description="recomputed old logprobs, KL reference: 2·P·T each "
                                      "(the role's old_logprobs: recompute adds one)")
    fsdp: int = Field(0, ge=0, description="FSDP group size: parameter traffic per optimizer step (0: none)")
    sp: int = Field(1, ge=1, description="sequence-parallel group: GPUs per data-parallel rank")
    optimizer_steps: int = Field(16, ge=1, description="mini-batches per iteration")
    collective_gbps: float = Field(160.0, gt=0, description="per-GPU collective bandwidth, GB/s")
    balance: bool = Field(True, description="charge the slowest data-parallel rank of each step")
    controller_s_per_trajectory: float = Field(0.0, ge=0, description="single controller: s per trajectory")
    controller_fixed_s: float = Field(0.0, ge=0, description="single controller: s per iteration")
    reward_s_by_tokens: list[tuple[float, float]] | None = Field(
        None, description="single controller: [[response tokens, seconds to score one]], summed over the batch's "
                          "responses one after another (laminar/sim/reward_cost.py; None: scoring not charged here)")
    switch_s: float = Field(0.0, ge=0, description="colocated phase switches per iteration, s")
    attention: bool = Field(False, description="charge causal self-attention's FLOPs, quadratic in each "
                            "sequence's length (trainer_cost.TrainerCost.sequence_flops)")
    colocated: bool = Field(False, description="colocated generation and training: the weights are resharded in "
                            "place (charged in switch_s), no relay stall, every host has a version at once")
    nccl: NcclSettings | None = Field(None, description="blocking NCCL broadcast instead of the relay stall: "
                                      "versions reach every host when it begins, trainer and rollouts wait it")
    speedup: float = Field(1.0, gt=0, description="simulated seconds per real second (compressed time)")
    relay: RelaySettings = Field(default_factory=RelaySettings)
    weight_bytes: int = Field(4096, ge=8, description="bytes of the published stand-in version")
    deliver: list[DeliverTarget] | None = Field(None, description="modeled delivery without relays: host folders "
                                                "in chain order (None: publish through the real relay tier)")
