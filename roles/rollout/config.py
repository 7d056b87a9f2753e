"""Settings of a rollout replica (`roles.rollout` in the run config).

The engine settings that depend on the model and the placement are checked when the config is
read, not when the engine starts minutes later: tensor parallelism must split the model's heads
(its config.json, or the shape file shipped under configs/models/: laminar/models/shape.py) and
match the placement (`check_placement`: as many GPUs as ranks; on the CPU build, cores that split
evenly between the ranks), and `max_model_len` must lie within the model's positions.
"""
from __future__ import annotations

import os
from typing import Literal

from laminar.roles.env.config import EnvRoleConfig
from laminar.roles.rollout.agent_config import RolloutAgentConfig
from laminar.roles.rollout.rewards import RewardTerm
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from laminar.models.shape import model_shape


def _shape(info: ValidationInfo):
    """The model's shape for a vLLM rollout's field validators (None: another engine, or no shape)."""
    if info.data.get("engine", "vllm") != "vllm" or "model_dir" not in info.data:
        return None
    return model_shape(info.data["model_dir"])


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


class RolloutConfig(BaseModel):
    """Settings of one rollout replica (`roles.rollout`, per-instance `options` on top)."""
    model_config = ConfigDict(extra="forbid")
    engine: str = Field("vllm", description="generation engine: vllm (real) or sim (simulator)")
    model_dir: str = Field("models/tiny", description="local Hugging Face model directory")
    max_concurrency: int = Field(64, ge=1, description="trajectories taken per batch (engine max_num_seqs)")
    max_num_seqs: int | None = Field(None, ge=1, description="sequences the engine runs at once (vLLM's "
                                     "max_num_seqs); None: max_concurrency. Below it, the rest of a batch waits in "
                                     "the engine's queue: KV capacity ÷ the tokens a sequence holds on average "
                                     "avoids most preemptions of long-tailed lengths (docs/sim.md). A rollout "
                                     "that refills in a laminar mode takes only this many")
    max_model_len: int = Field(1024, ge=16, description="prompt + response tokens the engine admits (32K and beyond "
                               "as far as the model's positions go: max_position_embeddings, times a rope_scaling "
                               "factor in its config.json)")
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM: ranks one engine is split over (tensor "
                                      "parallelism). With CUDA, the GPUs of the rollout's placement (`gpus:`, one "
                                      "host), as many as ranks; on the CPU build, processes that each take an equal "
                                      "share of the placement's `cores`. Must divide the model's attention heads")
    enforce_eager: bool | None = Field(None, description="vLLM: run without CUDA graphs and compilation; None: off "
                                       "with CUDA (graphs remove the per-step launch overhead that dominates decode "
                                       "at small batch), on for the CPU build (its compilation costs minutes)")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="vLLM with CUDA: share of each GPU's memory "
                                          "the engine takes for weights, activations and KV cache (the KV cache "
                                          "gets what the other two leave); the CPU build sizes it by kv_cache_gib")
    enable_prefix_caching: bool = Field(True, description="vLLM: keep the KV blocks of prompts and reuse them for a "
                                        "later request with the same prefix (a GRPO group's responses share their "
                                        "prompt: it is prefilled once, not group_size times)")
    kv_cache_gib: float = Field(1.0, gt=0, description="KV cache of the vLLM CPU engine (VLLM_CPU_KVCACHE_SPACE)")
    lora: dict | None = Field(None, description="versions are LoRA adapters on model_dir's frozen weights (the "
                              "trainer's roles.trainer.lora; roles/rollout/adapters.py): {max_lora_rank: at least "
                              "the adapter's rank, max_loras: adapters in one batch, at least 2 so a version's "
                              "trajectories run on while the next one's start}; None: full-weights versions")
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
    rewards: list[RewardTerm] | None = Field(None, description="composed reward: terms {fn: module:fn, weight} and "
                                             "{role: <scorer>, weight} (a `reward` role's model); replaces `reward`. "
                                             "With a scorer, finished trajectories await it in the partial pool "
                                             "(docs/rewards.md)")
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

    @model_validator(mode="after")
    def _kv_holds_a_sequence(self):
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.max_model_len:
            raise ValueError(f"kv_cache_tokens ({self.kv_cache_tokens}) must hold one whole sequence "
                             f"(max_model_len {self.max_model_len})")
        return self

    @field_validator("tensor_parallel_size")
    @classmethod
    def _tp_splits_the_model(cls, tp: int, info: ValidationInfo) -> int:
        """Against the model's shape (skipped when neither the model folder nor a shipped shape
        file has a config.json: vLLM then checks at start)."""
        shape = _shape(info)
        why = shape and shape.tp_problem(tp)
        if why and shape.is_moe and shape.tp_problem(tp, expert_parallel=True) is None:
            why = None  # expert parallel splits it (moe.expert_parallel, checked once the section is read)
        if why:
            raise ValueError(f"{why} ({shape.source})")
        return tp

    @field_validator("max_model_len")
    @classmethod
    def _within_the_positions(cls, n: int, info: ValidationInfo) -> int:
        shape = _shape(info)
        if shape is not None and shape.max_positions is not None and n > shape.max_positions:
            raise ValueError(f"{n} is beyond the model's {shape.max_positions} positions ({shape.source}: "
                             f"max_position_embeddings, times a rope_scaling factor)")
        return n

    def check_placement(self, spec) -> None:
        """ValueError when the placement `spec` (a RoleSpec) cannot host this engine: with `gpus:`,
        one GPU per tensor-parallel rank; on the CPU, `cores:` that split evenly between the ranks
        (one OpenMP CPU list per rank)."""
        tp = self.tensor_parallel_size
        if self.engine != "vllm":
            return
        if spec.gpus:
            if len(spec.gpus) != tp:
                raise ValueError(f"tensor_parallel_size {tp} must equal the number of GPUs of the placement "
                                 f"(gpus: {spec.gpus}, {len(spec.gpus)} GPUs): one GPU per rank")
        elif spec.cores and len(spec.cores) % tp:
            raise ValueError(f"tensor_parallel_size {tp}: the placement's cores {spec.cores} do not split evenly "
                             f"between {tp} ranks (each rank's OpenMP threads get an equal share)")

    def omp_bind(self, cores) -> str | None:
        """VLLM_CPU_OMP_THREADS_BIND for `cores` (the placement's, or this process's affinity when
        None and the engine has several ranks): one comma-separated list per rank, `|` between
        ranks. None: leave vLLM's own binding (one rank, no cores given)."""
        tp = self.tensor_parallel_size
        if not cores:
            if tp == 1:
                return None
            mine = sorted(os.sched_getaffinity(0))
            cores = mine[: len(mine) - len(mine) % tp] or mine  # an equal share each (too few: refused below)
        cores = list(cores)
        if len(cores) < tp or len(cores) % tp:
            raise ValueError(f"tensor_parallel_size {tp}: cores {cores} do not split evenly between {tp} ranks")
        n = len(cores) // tp
        return "|".join(",".join(str(c) for c in cores[r * n:(r + 1) * n]) for r in range(tp))
