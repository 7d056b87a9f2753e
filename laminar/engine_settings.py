"""EngineSettings: how a vLLM engine is set up, one model for every role that runs one.

The rollout (`roles.rollout`), the evaluator (`roles.evaluator`) and the reward role's judge
(`roles.reward.judge`) each inherit these fields (flat in their sections, as before), so a setting
has one name, one meaning and one set of bounds wherever it appears, and `VllmEngine.from_settings`
(roles/rollout/engine.py) is the one place they become an engine's arguments. How each role samples
(temperature, how many answers) stays its own. It lives in the core package, beside the model
shapes it checks against, so that three roles share it without importing each other.

The checks that depend on the model run when the config is read, not when the engine starts
minutes later: tensor parallelism must split the model's heads (its config.json, or the shape file
shipped under configs/models/: laminar/models/shape.py) and match the placement (`check_placement`:
as many GPUs as ranks; on the CPU build, cores that split evenly between the ranks), and
`max_model_len` must lie within the model's positions. A settings model with an `engine` field
other than vllm (the rollout's sim engine) skips them; it must declare that field before these
(see RolloutConfig's bases).
"""
from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from laminar.models.shape import model_shape


def _shape(info: ValidationInfo):
    """The model's shape for a vLLM engine's field validators (None: another engine, or no shape)."""
    if info.data.get("engine", "vllm") != "vllm" or "model_dir" not in info.data:
        return None
    return model_shape(info.data["model_dir"])


class LoraServing(BaseModel):
    """The engine serves LoRA adapters on model_dir's frozen weights: each version is an adapter (the
    trainer's roles.trainer.lora; roles/rollout/adapters.py)."""
    model_config = ConfigDict(extra="forbid")
    max_lora_rank: int = Field(ge=1, description="largest adapter rank the engine takes: at least the trainer's "
                               "lora.rank")
    max_loras: int = Field(ge=1, description="adapters one batch may mix: at least 2 on a rollout, so a "
                           "version's last trajectories run on while the next version's start")


class EngineSettings(BaseModel):
    """The vLLM engine's settings, shared by the rollout, the evaluator and the reward judge."""
    model_config = ConfigDict(extra="forbid")
    model_dir: str = Field("models/tiny", description="local Hugging Face model directory (the weights of "
                           "version 0; a LoRA engine's frozen base)")
    max_model_len: int = Field(1024, ge=16, description="prompt + response tokens the engine admits (32K and "
                               "beyond as far as the model's positions go: max_position_embeddings, times a "
                               "rope_scaling factor in its config.json)")
    dtype: str = Field("float32", description="engine dtype")
    max_num_seqs: int | None = Field(None, ge=1, description="sequences the engine runs at once (vLLM's "
                                     "max_num_seqs); None: the role's own (rollout and evaluator: "
                                     "max_concurrency; judge: 64). On a rollout, below max_concurrency the rest "
                                     "of a batch waits in the engine's queue: KV capacity / the tokens a sequence "
                                     "holds on average avoids most preemptions of long-tailed lengths (docs/sim.md)")
    tensor_parallel_size: int = Field(1, ge=1, description="ranks one engine is split over (tensor parallelism). "
                                      "With CUDA, the GPUs of the role's placement (`gpus:`, one host), as many "
                                      "as ranks; on the CPU build, processes that each take an equal share of the "
                                      "placement's `cores`. Must divide the model's attention heads")
    enforce_eager: bool | None = Field(None, description="run without CUDA graphs and compilation; None: off "
                                       "with CUDA (graphs remove the per-step launch overhead that dominates decode "
                                       "at small batch), on for the CPU build (its compilation costs minutes)")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="with CUDA: share of each GPU's memory the "
                                          "engine takes for weights, activations and KV cache (the KV cache gets "
                                          "what the other two leave); the CPU build sizes it by kv_cache_gib")
    enable_prefix_caching: bool = Field(True, description="keep the KV blocks of prompts and reuse them for a later "
                                        "request with the same prefix (a GRPO group's responses share their "
                                        "prompt: it is prefilled once, not group_size times)")
    kv_cache_gib: float = Field(1.0, gt=0, description="KV cache of the vLLM CPU engine (VLLM_CPU_KVCACHE_SPACE)")
    kv_cache_tokens: int | None = Field(None, ge=16, description="size the KV cache in tokens instead (whole blocks "
                                        "of 32, vLLM's num_gpu_blocks_override), at least max_model_len. A tiny "
                                        "model's 1 GiB cache holds about a million tokens and reads ~0% used "
                                        "whatever runs; sized to the workload, KV usage (the repack's input, "
                                        "docs/architecture.md §7) rises and falls as it does on a GPU")
    lora: LoraServing | None = Field(None, description="versions are LoRA adapters on model_dir's frozen weights "
                                     "(docs/lora.md); None: full-weights versions")

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
        if why and "moe" in cls.model_fields and shape.is_moe and shape.tp_problem(tp, expert_parallel=True) is None:
            why = None  # expert parallel splits it (the rollout's moe.expert_parallel, checked once that is read)
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
        if getattr(self, "engine", "vllm") != "vllm":
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


def engine_seqs(settings) -> int:
    """Sequences the engine runs at once: `max_num_seqs`, never more than the trajectories the
    rollout takes (`max_concurrency`, also the default)."""
    n = getattr(settings, "max_num_seqs", None)
    return min(n, settings.max_concurrency) if n else settings.max_concurrency
