"""Settings of a rollout replica (`roles.rollout` in the run config)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class RolloutConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    engine: str = Field("vllm", description="generation engine: vllm (real) or sim (simulator)")
    model_dir: str = Field("models/tiny", description="local Hugging Face model directory")
    max_concurrency: int = Field(64, ge=1, description="trajectories taken per batch (engine max_num_seqs)")
    max_model_len: int = Field(1024, ge=16, description="prompt + response tokens the engine admits")
    kv_cache_gib: float = Field(1.0, gt=0, description="KV cache of the vLLM CPU engine (VLLM_CPU_KVCACHE_SPACE)")
    dtype: str = Field("float32", description="engine dtype")
    temperature: float = Field(1.0, ge=0, description="sampling temperature (0 = greedy)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling")
    seed: int | None = Field(None, description="base sampling seed; per trajectory seed = hash(seed, id)")
    reward: str = Field("laminar.tasks.rewards:exact_answer", description="reward function 'module:fn'")
    delta_interval_s: float = Field(0.25, gt=0, description="how often token deltas go to the partial pool")
    report_interval_s: float = Field(1.0, gt=0, description="period of the rollout.stats event")
    relay_id: str | None = Field(None, description="relay on this host to pull weights from (None: keep initial weights)")
    weights_dir: str | None = Field(None, description="shared-memory folder of that relay (default: the relay's shm_dir setting)")
    prompt_pool: str = Field("0", description="id of the prompt pool role")
    partial_pool: str = Field("0", description="id of the partial pool role")
    experience_buffer: str = Field("0", description="id of the experience buffer role")
    rpc_timeout_s: float = Field(5.0, gt=0, description="deadline of each pool call")
    idle_wait_s: float = Field(0.5, gt=0, description="wait before asking an empty prompt pool again")
    sim: dict = Field(default_factory=dict, description="engine: sim settings, passed to SimEngine.from_workload "
                      "(model, tp, lengths, gpu, curve_path, ...) plus `speedup` (compressed time, default 1)")
    refill: bool | None = Field(None, description="take new groups as trajectories finish, not at batch end (default: on in stream mode only)")
    stop_when_exhausted: bool = Field(True, description="finish (exit 0) when the prompt pool has no more epochs")
