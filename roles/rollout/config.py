"""Settings of a rollout replica (`roles.rollout` in the run config)."""
from __future__ import annotations

from typing import Literal

from laminar.roles.env.config import EnvRoleConfig
from pydantic import BaseModel, ConfigDict, Field, model_validator


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


class RolloutConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    engine: str = Field("vllm", description="generation engine: vllm (real) or sim (simulator)")
    model_dir: str = Field("models/tiny", description="local Hugging Face model directory")
    max_concurrency: int = Field(64, ge=1, description="trajectories taken per batch (engine max_num_seqs)")
    max_num_seqs: int | None = Field(None, ge=1, description="sequences the engine runs at once (vLLM's "
                                     "max_num_seqs); None: max_concurrency. Below it, the rest of a batch waits in "
                                     "the engine's queue: KV capacity ÷ the tokens a sequence holds on average "
                                     "avoids most preemptions of long-tailed lengths (docs/sim.md). A rollout "
                                     "that refills in a laminar mode takes only this many")
    max_model_len: int = Field(1024, ge=16, description="prompt + response tokens the engine admits")
    kv_cache_gib: float = Field(1.0, gt=0, description="KV cache of the vLLM CPU engine (VLLM_CPU_KVCACHE_SPACE)")
    kv_cache_tokens: int | None = Field(None, ge=16, description="vLLM only: size the KV cache in tokens instead "
                                        "(whole blocks of 32, vLLM's num_gpu_blocks_override), at least "
                                        "max_model_len. A tiny model's 1 GiB cache holds about a million tokens and "
                                        "reads ~0% used whatever runs; sized to the workload, KV usage (the repack's "
                                        "input, docs/architecture.md §7) rises and falls as it does on a GPU")
    dtype: str = Field("float32", description="engine dtype")
    temperature: float = Field(1.0, ge=0, description="sampling temperature (0 = greedy)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling")
    seed: int | None = Field(None, description="base sampling seed; per trajectory seed = hash(seed, id)")
    reward: str = Field("laminar.tasks.rewards:exact_answer", description="reward function 'module:fn'")
    delta_interval_s: float = Field(0.25, gt=0, description="how often token deltas go to the partial pool")
    report_interval_s: float = Field(1.0, gt=0, description="period of the rollout.stats event")
    relay_id: str | None = Field(
        None, description="relay on this host to pull weights from (None: keep initial weights)"
    )
    weights_dir: str | None = Field(
        None, description="shared-memory folder of that relay (default: the relay's shm_dir setting)"
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
    sim: dict = Field(default_factory=dict, description="engine: sim settings, passed to SimEngine.from_workload "
                      "(model, tp, lengths, gpu, curve_path, ...) plus `speedup` (compressed time, default 1)")
    refill: bool | None = Field(
        None, description="take new groups as trajectories finish, not at batch end (default: on in stream mode only); "
        "in the laminar modes until this host's relay holds a newer version and max_concurrency were taken on "
        "this one, then drain and load it"
    )
    stop_when_exhausted: bool = Field(True, description="finish (exit 0) when the prompt pool has no more epochs")
    env: RolloutEnvConfig | None = Field(None, description="multi-turn: the environment of every trajectory "
                                         "(None: single-turn, scored by `reward`)")

    @model_validator(mode="after")
    def _kv_holds_a_sequence(self):
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.max_model_len:
            raise ValueError(f"kv_cache_tokens ({self.kv_cache_tokens}) must hold one whole sequence "
                             f"(max_model_len {self.max_model_len})")
        return self
