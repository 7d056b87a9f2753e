"""The simulator's settings (configs/sim/paper.yaml), validated like every other config.

    setup = load_setup("configs/sim/paper.yaml")      # SimSetup; SetupError naming file and field
    setup.run_shape.max_concurrency, setup.models["72B"].tp, setup.trainer.mfu, ...

The file holds the run shape, the stated and calibrated constants of the cost model (their
derivation is written in the file's comments and in docs/sim.md), the roles' periods in
simulated seconds and how compressed time is chosen. `laminar/sim/scenario.py` turns one
(model, GPU count, mode) of it into a LaminarConfig. Every section forbids unknown keys, so a
misspelt constant is an error, not a silently ignored line. Fields documented here are the
meaning; the values and why they are what they are sit in the YAML.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# laminar_unbounded: laminar without the staleness bound and flow control (`staleness`), the
# paper's setting, run beside laminar to measure what the bound costs (never by default)
MODES = ("laminar", "laminar_norepack", "sync", "one_step", "stream", "laminar_unbounded")
DEFAULT_MODES = MODES[:5]
BARRIER_MODES = ("sync", "one_step", "stream")


class SetupError(ValueError):
    """A sim setup file that does not parse or validate (the message names the file and fields)."""


class _Strict(BaseModel):
    """Base of the simulator's settings models: unknown keys are errors, assignments checked."""
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunShape(_Strict):
    """The RL run's shape (the paper's: paper.json run_shape)."""
    prompts_per_batch: int = Field(ge=1, description="prompts of a global batch")
    group_size: int = Field(ge=1, description="responses per prompt (GRPO group)")
    max_output_tokens: int = Field(ge=1, description="response cap, tokens")
    max_input_tokens: int = Field(ge=1, description="prompt cap, tokens (max_model_len = input + output)")
    prompt_tokens: int = Field(ge=2, description="tokens of each synthetic prompt")
    max_concurrency: int = Field(ge=1, description="trajectories a laminar rollout takes per batch")


class ModelSetup(_Strict):
    """One model's parallelism and workload."""
    tp: int = Field(ge=1, description="laminar's rollout tensor parallelism")
    baseline_tp: int | None = Field(None, ge=1, description="the barrier modes' rollout TP (None: tp)")
    fsdp: int = Field(0, ge=0, description="the trainer's FSDP group (0: no parameter traffic charged)")
    sp: int = Field(1, ge=1, description="the trainer's sequence-parallel group")
    lengths: str = Field(description="response-length statistics in the workload file, e.g. 72B_math")
    emit_every: int | None = Field(None, ge=1, description="sim engine decode steps per macro-step "
                                   "(None: rollout.emit_every)")
    curve_path: str | None = Field(None, description="a measured step curve (bench/step_curve.py's JSON) instead "
                                   "of the paper's or the roofline's")


class RolloutSetup(_Strict):
    """The rollouts' engines (SimEngine) and their intake."""
    max_num_seqs: Literal["kv"] | int | None = Field(description="sequences an engine runs at once: kv = the "
                                                    "ceiling's b*, a number, or None = all it takes")
    refill: bool = Field(description="laminar modes: take new groups as trajectories finish")
    mem_fraction: float = Field(gt=0, le=1, description="vLLM gpu_memory_utilization")
    mem_fraction_colocated: float = Field(gt=0, le=1, description="sync: its share beside the training state")
    context_dependence: bool = Field(True, description="a step reads the KV its sequences hold")
    host_ms_per_layer: float | None = Field(None, ge=0, description="host dispatch per layer and step "
                                            "(None: latency.HOST_MS_PER_LAYER)")
    host_ms_per_seq: float = Field(0.0, ge=0, description="host work per running sequence and step")
    load_gbps: float = Field(gt=0, description="host -> GPU weight load, GB/s")
    group_correlation: float = Field(0.0, ge=0, le=1, description="ρ of lengths within a GRPO group")
    emit_every: int = Field(ge=1, description="default decode steps per macro-step")
    stream_batch: int = Field(0, ge=0, description="stream a big batch's tokens every running/N macro-steps")

    @field_validator("max_num_seqs")
    @classmethod
    def _positive(cls, v):
        if isinstance(v, int) and v < 1:
            raise ValueError("must be kv, null or a number >= 1")
        return v


class TrainerSetup(_Strict):
    """The sim trainer's cost terms (laminar/sim/trainer_cost.py)."""
    mfu: float = Field(gt=0, le=1, description="model FLOPs utilization of training")
    recompute: bool = Field(description="full activation recomputation (one more forward pass)")
    optimizer_steps: int = Field(16, ge=1, description="mini-batches (optimizer steps) per iteration")
    collective_gbps: float = Field(160.0, gt=0, description="per-GPU bandwidth of the FSDP collectives, GB/s")
    balance: bool = Field(True, description="charge each step's slowest data-parallel rank")
    attention: bool = Field(False, description="charge causal self-attention's FLOPs on each sequence's length")
    old_logprobs: dict[str, Literal["behaviour", "recompute"]] = Field(
        default_factory=dict, description="per mode: recompute the old policy's logprobs (one forward pass) or not")


class RewardSetup(_Strict):
    """Scoring one response (detokenize + verify), measured by bench/reward_cost.py."""
    source: str | None = Field(None, description="the measurement the table was copied from (a result JSON)")
    s_by_response_tokens: list[tuple[int, float]] = Field(
        description="[[response tokens, mean seconds to score it], ...], increasing tokens; interpolated "
                    "piecewise-linearly, extended along the last segment (laminar/sim/reward_cost.py)")


class ControllerSetup(_Strict):
    """The barrier baselines' single controller (verl's driver)."""
    modes: list[str] = Field(description="modes whose real counterpart scores and moves batches in the driver")
    moves: int = Field(ge=0, description="padded-batch moves driver <-> workers per iteration")
    bytes_per_position: float = Field(gt=0, description="bytes a padded position carries per move")
    gbps: float = Field(gt=0, description="the object store's rate, GB/s")


class ColocatedSetup(_Strict):
    """Colocated sync's phase switches (trainer_cost.colocated_switch_s)."""
    pcie_gbps: float = Field(gt=0, description="host <-> GPU, GB/s")
    state_bytes_per_param: float = Field(gt=0, description="training state offloaded per parameter, bytes")


class NcclSetup(_Strict):
    """The one_step/stream blocking weight broadcast (trainer_cost.NcclBroadcast)."""
    bandwidth_gbps: float = Field(gt=0, description="S/B term")
    per_doubling_gbps: float = Field(gt=0, description="S·log2(n)/C term")


class RelaySetup(_Strict):
    """One hop of laminar's relay chain (trainer_cost.RelayLink)."""
    bandwidth_gbps: float = Field(gt=0, description="a hop's bandwidth, GB/s")
    chunk_mib: float = Field(gt=0, description="chunk size, MiB")
    alpha_s: float = Field(ge=0, description="per-chunk overhead, s")


class ManagerSetup(_Strict):
    """The real manager's repack settings."""
    c_max: float = Field(gt=0, le=1, description="KV usage a plan may fill a destination to")
    trend: Literal["peak", "previous"] = Field("peak", description="what counts as a draining replica")
    roofline_tolerance: float = Field(gt=1, description="B: the largest batch within this × the batch-1 step")


class Periods(_Strict):
    """Role periods (simulated seconds in periods_sim_s, real seconds in real_floor_s)."""
    report: float = Field(gt=0, description="rollout stats (repack's inputs)")
    repack: float = Field(gt=0, description="the manager's repack interval")
    heartbeat: float = Field(gt=0, description="heartbeats and the manager's state period")
    delta: float = Field(gt=0, description="token deltas to the partial pool")
    idle_wait: float = Field(gt=0, description="an idle rollout asks the prompt pool again")
    gated_wait: float = Field(5.0, gt=0, description="... when the pool's gate is shut for its version (woken by a "
                              "new version or the pool's gate_open; this only bounds a lost event)")
    sample_wait: float = Field(gt=0, description="the trainer asks a short buffer again")
    commit_window: float = Field(0.0, ge=0, description="the pools' group-commit window (their stores gather "
                                 "writes this long before one commit; not a modeled cost: CPU saved per write)")


class Floors(_Strict):
    """Real-time floors of the periods (a shorter one would only burn CPU); 0 when absent."""
    report: float = Field(0.0, ge=0, description="rollout stats")
    repack: float = Field(0.0, ge=0, description="repack interval")
    heartbeat: float = Field(0.0, ge=0, description="heartbeats")
    delta: float = Field(0.0, ge=0, description="token deltas")
    idle_wait: float = Field(0.0, ge=0, description="idle rollout's retry")
    gated_wait: float = Field(0.0, ge=0, description="idle rollout's retry at a shut gate")
    sample_wait: float = Field(0.0, ge=0, description="trainer's retry")


class RealTimes(_Strict):
    """Real-time guards, not modeled periods."""
    dead_after: float = Field(gt=0, description="heartbeat silence that declares a role dead")
    shutdown: float = Field(gt=0, description="a role's stop deadline")
    rpc_timeout: float = Field(gt=0, description="deadline of the roles' calls")


class CompressedTime(_Strict):
    """How each run's speedup is chosen from its expected CPU load (scenario.estimate)."""
    cpu_per_trajectory_s: float = Field(ge=0, description="Python time of the roles per trajectory")
    cpu_per_token_s: float = Field(ge=0, description="... plus per response token")
    cpu_per_replica_s: float = Field(0.0, ge=0, description="per replica and simulated second")
    cpu_share: float = Field(gt=0, le=1, description="of a core one run should use on average")
    min: float = Field(gt=0, description="lowest speedup")
    max: float = Field(gt=0, description="highest speedup")


class StalenessSetup(_Strict):
    """The laminar modes' default bound on staleness (trainer version − the version a trajectory
    was generated with), by the real roles' own settings."""
    max: int | None = Field(4, ge=0, description="experience_buffer.max_staleness: a group with a member older "
                            "than this is dropped, never trained (None: no bound)")
    ahead: int | None = Field(3, ge=0, description="prompt_pool.max_batches_ahead: global batches handed out "
                              "beyond the trainer's version (flow control; None: no bound)")


class Iterations(_Strict):
    """Versions of a run: warm-up, then measured."""
    warmup: int = Field(ge=1, description="laminar modes' warm-up versions")
    warmup_barrier: int | None = Field(None, ge=1, description="barrier modes' warm-up (None: warmup)")
    measure: int = Field(ge=1, description="measured versions (laminar's rounded down to whole waves, at least one)")


class QuickSetup(_Strict):
    """`bench/scale.py --quick`: a small subset."""
    runs: list[tuple[str, int]] = Field(description="[[model, GPUs], ...]")
    modes: list[str] = Field(default_factory=lambda: list(MODES), description="modes to run")
    iterations: Iterations | None = Field(None, description="versions (None: the sweep's)")


class SimSetup(_Strict):
    """configs/sim/paper.yaml: everything a scenario is built from besides the workload file."""
    workload: str | None = Field(None, description="workload file (None: $LAMINAR_WORKLOAD, else paper.json)")
    gpu: str = Field(description="GPU kind (hardware.GPUS)")
    gpus_per_host: int = Field(ge=1, description="GPUs of a host")
    run_shape: RunShape
    models: dict[str, ModelSetup] = Field(description="per model size: 7B, 32B, 72B")
    rollout: RolloutSetup
    trainer: TrainerSetup
    reward: RewardSetup | None = Field(None, description="per-trajectory scoring cost (None: free)")
    controller: ControllerSetup | None = Field(None, description="the single controller's work (None: none)")
    colocated: ColocatedSetup | None = Field(None, description="sync's phase switches (None: none)")
    weight_sync: dict[str, Literal["relay", "colocated", "nccl"]] = Field(
        default_factory=dict, description="per mode: how a version reaches the rollouts (absent: relay)")
    nccl: NcclSetup | None = Field(None, description="the blocking broadcast's rates (needed by nccl modes)")
    relay: RelaySetup
    manager: ManagerSetup
    periods_sim_s: Periods
    real_floor_s: Floors = Field(default_factory=Floors)
    real_s: RealTimes
    compressed_time: CompressedTime
    staleness: StalenessSetup = Field(default_factory=lambda: StalenessSetup(max=None, ahead=None),
                                      description="laminar modes' staleness bound (absent: none)")
    iterations: Iterations
    quick: QuickSetup | None = Field(None, description="--quick's subset")

    @field_validator("weight_sync", "trainer")
    @classmethod
    def _known_modes(cls, v, info):
        keys = v if isinstance(v, dict) else v.old_logprobs
        if bad := sorted(set(keys) - set(MODES)):
            raise ValueError(f"unknown modes {bad}; known: {list(MODES)}")
        return v

    def model_setup(self, size: str) -> ModelSetup:
        """The model's section; KeyError naming the models the file has."""
        try:
            return self.models[size]
        except KeyError:
            raise KeyError(f"no model {size!r} in the sim setup; known: {sorted(self.models)}") from None


def load_setup(path: str | Path) -> SimSetup:
    """Read and validate a sim setup file (configs/sim/paper.yaml); SetupError naming the file
    and every bad field."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SetupError(f"{path}: cannot read the sim setup: {exc}") from None
    try:
        return SimSetup.model_validate(raw)
    except ValidationError as exc:
        lines = [f"{path}: {'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
        raise SetupError("invalid sim setup\n  " + "\n  ".join(lines)) from None
