"""The settings of the scale simulator's rollout engine (`roles.rollout.sim`, with `engine: sim`).

`SimEngine.from_settings` passes the ones given to `SimEngine.from_workload` (and, for the
engine's own knobs, to its constructor), so a setting left out keeps the engine's default: the
defaults live in roles/rollout/sim_engine.py alone, and a None here means "the engine's". Kept
apart from the engine so that reading a config does not import the simulator's engine.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class SimRolloutSettings(BaseModel):
    """`roles.rollout.sim`: the simulated engine's model, GPUs, lengths and time compression."""
    model_config = ConfigDict(extra="forbid")
    model: str = Field(description="model shape: 7B, 32B or 72B (laminar/sim/hardware.py)")
    tp: int = Field(ge=1, description="GPUs of one engine (tensor parallelism)")
    lengths: str = Field(description="the workload's response-length statistics, e.g. 32B_math")
    speedup: float = Field(1.0, gt=0, description="simulated seconds per real second (its CompressedClock)")
    gpu: str | None = Field(None, description="GPU kind (hardware.GPUS); None: the engine's (H800)")
    mem_fraction: float | None = Field(None, gt=0, le=1, description="vLLM gpu_memory_utilization of the modeled "
                                       "KV cache; None: the engine's (0.9)")
    curve_path: str | None = Field(None, description="a measured step curve (bench/step_curve.py's JSON) instead of "
                                   "the paper's or the fitted roofline's")
    workload_path: str | None = Field(None, description="the workload file (None: the shipped paper workload)")
    max_output_tokens: int | None = Field(None, ge=1, description="clip the lengths to this (None: the workload's "
                                          "run_shape)")
    load_gbps: float | None = Field(None, gt=0, description="weight load bandwidth per GPU, GB/s (load_s when not "
                                    "given); None: the engine's (25)")
    host_ms_per_layer: float | None = Field(None, ge=0, description="host time per decoder layer and step (0: off); "
                                            "None: latency.HOST_MS_PER_LAYER")
    context_dependence: bool | None = Field(None, description="correct each step for the KV its sequences read; "
                                            "None: the engine's (on)")
    reward_s_by_tokens: list[tuple[float, float]] | None = Field(
        None, description="[[response tokens, seconds to score one]]: each rollout scores its own trajectories "
                          "inline (laminar/sim/reward_cost.py; None: scoring is free)")
    load_s: float | None = Field(None, ge=0, description="seconds to load a version (None: from load_gbps)")
    emit_every: int | None = Field(None, ge=1, description="steps between token emissions (None: the engine's, 32)")
    stream_batch: int | None = Field(None, ge=0, description="batch boundary of stream mode (None: the engine's, 0)")
    group_correlation: float | None = Field(None, ge=0, le=1, description="how alike a group's lengths are "
                                            "(None: the engine's, 0)")
    host_ms_per_seq: float | None = Field(None, ge=0, description="host work per running sequence after each step "
                                          "(None: the engine's, 0)")
    token_id: int | None = Field(None, ge=0, description="the token every response is made of (None: the "
                                 "engine's, 0)")
    block_size: int | None = Field(None, ge=1, description="KV block size in tokens (None: the engine's, 16)")
    max_batched_tokens: int | None = Field(None, ge=1, description="prefill budget of a step (None: the engine's, "
                                           "8192)")
    prefix_caching: bool | None = Field(None, description="a group's shared prompt is prefilled once (None: the "
                                        "engine's, on)")
    seed: int | None = Field(None, description="seed of the lengths drawn without a request seed (None: 0)")

    def engine_kwargs(self) -> dict:
        """The settings given, as SimEngine.from_workload's keyword arguments (speedup apart)."""
        return self.model_dump(exclude_none=True, exclude={"speedup"})
