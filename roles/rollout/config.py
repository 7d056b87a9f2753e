"""Settings of a rollout replica (`roles.rollout` in the run config).

Its engine's settings are EngineSettings (roles/rollout/engine_settings.py), the one model the
evaluator and the reward judge use too; their checks against the model and the placement run when
the config is read. `sim` (engine: sim) is SimRolloutSettings (roles/rollout/sim_settings.py).
"""
from __future__ import annotations

from typing import ClassVar, Literal

from laminar.roles.env.config import EnvRoleConfig
from laminar.roles.rollout.agent_config import RolloutAgentConfig
from laminar.roles.rollout.rewards import RewardTerm
from laminar.roles.rollout.sim_settings import SimRolloutSettings
from pydantic import BaseModel, ConfigDict, Field, model_validator

from laminar.engine_settings import EngineSettings
from laminar.models.shape import model_shape


class RolloutEnvConfig(BaseModel):
    """Multi-turn rollouts (`roles.rollout.env`): every trajectory is an episode of an environment,
    reached over the bus (`role_id`) or run inside the rollout process (`local`). See multiturn.py."""
    model_config = ConfigDict(extra="forbid")
    role_id: str | None = Field(None, description="id of the env role that serves the episodes")
    local: EnvRoleConfig | None = Field(None, description="or: run the environment inside this rollout, with "
                                        "the env role's settings (tests, light environments; a migrated "
                                        "trajectory replays its episode on its new rollout)")
    stop: list[str] = Field(default_factory=lambda: ["</tool>"],
                            description="text markers that end a model turn (matched as token sequences)")
    max_turn_tokens: int | None = Field(None, ge=1, description="a model turn also ends after this many tokens")
    tokenizer_dir: str | None = Field(None, description="model folder whose tokenizer encodes `stop` and "
                                      "knows EOS (default: the byte tokenizer); the env's must be the same")
    on_failure: Literal["retry", "fail"] = Field("retry", description="environment lost mid-episode: replay the "
                                                 "episode on a fresh session (retry), or store the trajectory "
                                                 "with finish_reason env_failed, reward 0 and no loss (fail)")
    retries: int = Field(3, ge=0, description="replays of one episode before it fails (on_failure: retry)")
    retry_backoff_s: float = Field(1.0, gt=0, description="first wait before a replay (doubles, at most 10 s)")
    rpc_timeout_s: float = Field(90.0, gt=0, description="deadline of one env call (above the env's step_timeout_s)")

    @model_validator(mode="after")
    def _one_place(self):
        if (self.role_id is None) == (self.local is None):
            raise ValueError("roles.rollout.env: give exactly one of role_id (an env role) or local (in-process)")
        if not self.stop and self.max_turn_tokens is None:
            raise ValueError("roles.rollout.env: a turn must end somewhere: give stop markers or max_turn_tokens")
        return self


class RolloutMoe(BaseModel):
    """`roles.rollout.moe`: mixture-of-experts policies (docs/moe.md)."""
    model_config = ConfigDict(extra="forbid")
    routing: bool = Field(False, description="record the experts the engine routes every token to and carry them "
                          "with each trajectory (partial pool, migration, buffer) for the trainer's routing replay "
                          "(roles.trainer.moe.routing_replay). On the CPU build the worker captures them at each MoE "
                          "router and prefix caching is off; with CUDA, vLLM's enable_return_routed_experts")
    expert_parallel: bool = Field(False, description="vLLM's enable_expert_parallel: the tensor-parallel ranks "
                                  "hold whole experts (each rank a share of them) instead of a slice of every "
                                  "expert; attention stays tensor parallel")


class EngineChoice(BaseModel):
    """Which engine a rollout generates with. A base of its own so that, listed after
    EngineSettings in RolloutConfig's bases, its field comes first (pydantic orders fields from the
    last base to the first) and the engine settings' model checks can skip a sim engine."""
    model_config = ConfigDict(extra="forbid")
    engine: str = Field("vllm", description="generation engine: vllm (real) or sim (simulator)")


class RolloutConfig(EngineSettings, EngineChoice):
    """Settings of one rollout replica (`roles.rollout`, per-instance `options` on top): its vLLM
    engine's (EngineSettings, shared with the evaluator and the reward judge), then how it samples,
    scores and talks to the pools."""
    model_config = ConfigDict(extra="forbid")
    MOVED: ClassVar[dict[str, str]] = {"weights_dir": "shm_dir"}  # older keys (laminar/config.py names them)
    max_concurrency: int = Field(64, ge=1, description="trajectories taken per batch (the engine's max_num_seqs "
                                 "unless that is set); a rollout that refills in a laminar mode takes only "
                                 "max_num_seqs")
    temperature: float = Field(1.0, ge=0, description="sampling temperature (0 = greedy)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling")
    seed: int | None = Field(None, description="base sampling seed; per trajectory seed = hash(seed, id)")
    reward: str = Field("laminar.tasks.rewards:exact_answer", description="reward function 'module:fn'")
    rewards: list[RewardTerm] | None = Field(None, description="composed reward: terms {fn: module:fn, weight} and "
                                             "{role: <scorer>, weight} (a `reward` role's model); replaces `reward`. "
                                             "With a scorer, finished trajectories await it in the partial pool "
                                             "(docs/rewards.md)")
    delta_interval_s: float = Field(0.25, gt=0, description="how often token deltas go to the partial pool")
    report_interval_s: float = Field(1.0, gt=0, description="period of the rollout.stats event")
    relay_id: str | None = Field(
        None, description="relay on this host to pull weights from (None: keep initial weights)"
    )
    shm_dir: str | None = Field(
        None, description="shared-memory folder of that relay (default: the relay's own shm_dir)"
    )
    prompt_pool: str = Field("0", description="id of the prompt pool role")
    partial_pool: str = Field("0", description="id of the partial pool role")
    experience_buffer: str = Field("0", description="id of the experience buffer role")
    rpc_timeout_s: float = Field(5.0, gt=0, description="deadline of each pool call")
    pull_retry_s: float = Field(5.0, gt=0, description="after a failed weight load, try that same version again only "
                                "after this long (a newer version is tried at once); the rollout keeps its weights")
    put_retry_s: float = Field(0.2, gt=0, description="first wait before offering a refused trajectory (buffer full) "
                               "again; doubles up to put_retry_max_s. It stays in the partial pool meanwhile")
    put_retry_max_s: float = Field(5.0, gt=0, description="longest wait between offers of a refused trajectory")
    idle_wait_s: float = Field(0.5, gt=0, description="wait before asking an empty prompt pool again")
    gated_wait_s: float = Field(5.0, gt=0, description="... when its gate was shut for this version (a barrier "
                                "mode's step, flow control): a newer version or the pool's data.gate_open wakes the "
                                "rollout at once (a lost version event is seen by the relay's pointer moving, looked "
                                "at every idle_wait_s); this bounds the wait if the gate_open event is lost")
    sim: SimRolloutSettings | None = Field(None, description="engine: sim: the simulated engine's model, GPUs, "
                                           "lengths and `speedup` (roles/rollout/sim_settings.py); needed then")
    refill: bool | None = Field(
        None, description="take new groups as trajectories finish, not at batch end (default: on in stream mode only); "
        "in the laminar modes until this host's relay holds a newer version and max_concurrency were taken on "
        "this one, then drain and load it"
    )
    stop_when_exhausted: bool = Field(True, description="finish (exit 0) when the prompt pool has no more epochs")
    env: RolloutEnvConfig | None = Field(None, description="multi-turn: the environment of every trajectory "
                                         "(None: single-turn, scored by `reward`)")
    agent: RolloutAgentConfig | None = Field(None, description="agent mode: every trajectory is an episode an "
                                             "outside agent drives through the gateway role (roles/rollout/agent.py)")
    moe: RolloutMoe = Field(default_factory=RolloutMoe, description="mixture-of-experts policies: routing capture, "
                            "expert parallelism (docs/moe.md)")

    @model_validator(mode="after")
    def _one_driver(self):
        if self.env is not None and self.agent is not None:
            raise ValueError("env and agent: a trajectory is driven by an environment or by an agent, not both")
        return self

    @model_validator(mode="after")
    def _experts_split(self):
        """A MoE model's experts split over the tensor-parallel ranks as `moe.expert_parallel` says."""
        if self.engine != "vllm" or self.tensor_parallel_size == 1:
            return self
        shape = model_shape(self.model_dir)
        if shape is None or not shape.is_moe:
            return self
        why = shape.tp_problem(self.tensor_parallel_size, expert_parallel=self.moe.expert_parallel)
        if why:
            other = "on" if not self.moe.expert_parallel else "off"
            raise ValueError(f"tensor_parallel_size: {why} ({shape.source}); try moe.expert_parallel {other}")
        return self

