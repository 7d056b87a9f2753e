"""What the rollout role calls on its generation engine, as a typed protocol, and the one place
an engine is built from the role's settings.

Two engines implement `RolloutEngineAPI`: `VllmEngine` (roles/rollout/engine.py, vLLM's AsyncLLM)
and `SimEngine` (roles/rollout/sim_engine.py, the scale simulator's model of vLLM's scheduler;
docs/sim.md). The protocol is structural (`typing.Protocol`, runtime-checkable): an engine need
not inherit from anything to qualify, and tests/unit/roles/test_engine_api.py checks that both engines
define every method with the protocol's signature.

    engine = build_rollout_engine(settings, cores)   # settings: the role's RolloutConfig
    await engine.start()
    async for tokens, logprobs, finish in engine.generate(request_id, prompt, max_tokens, seed): ...
    version = await engine.load_relay(shm_dir, min_version)      # -1: nothing newer; one version on every
                                                                 # rank, or WeightsLoadError / WeightsLost
    engine.stats.kv_usage, engine.stats.running, engine.stats.waiting
    rows = await engine.routing([(request_id, start, end)], drop=[request_id])  # MoE routing (docs/moe.md)
    await engine.close()
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol, runtime_checkable

from laminar.roles.rollout.engine import EngineStats, Sampling

from laminar.engine_settings import engine_seqs


@runtime_checkable
class RolloutEngineAPI(Protocol):
    """A generation engine as the rollout role drives it. `stats` is refreshed by the engine
    (KV usage, running and waiting requests); cancelling the task that consumes `generate` aborts
    the request (how migration stops a trajectory mid-way)."""

    stats: EngineStats

    async def start(self) -> None:
        """Bring the engine up (spawn processes, start the scheduler); requests may follow."""
        ...

    def generate(self, request_id: str, prompt: list[int], max_tokens: int, seed: int | None,
                 sampling: Sampling | None = None) -> AsyncIterator[tuple[list[int], list[float], str | None]]:
        """Stream (new token ids, their logprobs, finish reason or None) until the request ends;
        `sampling` overrides the engine's temperature and top_p for this request (an engine that
        models no sampling, the simulator's, ignores it); with `sampling.whole` the stream may be
        one step at the end (vLLM's is; the simulator's still steps token by token)."""
        ...

    async def load_relay(self, shm_dir: str, min_version: int, exact: tuple[str, int, int] | None = None) -> int:
        """Load the relay folder's newest version if newer than `min_version` (or exactly the weights
        `exact` names, (run_id, lineage, version), newest or retained: the same number of another
        run or lineage is not loaded); the version now held, or -1 if there was none to load."""
        ...

    async def load_file(self, path: str) -> None:
        """Load weights from a file (a checkpoint's exported state)."""
        ...

    async def routing(self, asks: list[tuple[str, int, int]], drop: list[str]) -> list[tuple[int, Any] | None]:
        """Mixture-of-experts routing: for each (request id, start, end), (start, rows) of the rows of
        positions [start, end) the engine recorded (uint8/uint16 [rows, layers, top_k]; fewer when it
        has not processed them yet), or None; then forget the requests named in `drop`. An engine
        that records none answers None for each."""
        ...

    async def close(self) -> None:
        """Stop the engine and release what it holds (processes, shared memory)."""
        ...


def build_rollout_engine(settings: Any, cores: Sequence[int] | None = None) -> RolloutEngineAPI:
    """The engine `roles.rollout.engine` names, from the role's settings (`RolloutConfig`):
    "vllm" (its OpenMP threads bound to `cores`, the rollout's placement, an equal share per
    tensor-parallel rank: RolloutConfig.omp_bind) or "sim" (`settings.sim`:
    the simulator's model, time compressed by its `speedup`)."""
    if settings.engine == "vllm":
        from laminar.roles.rollout.engine import VllmEngine  # late: the engine module pulls vLLM's helpers
        return VllmEngine.from_settings(settings, max_num_seqs=engine_seqs(settings), temperature=settings.temperature,
                                        top_p=settings.top_p, seeded=settings.seed is not None,
                                        omp_threads_bind=settings.omp_bind(cores), routing=settings.moe.routing,
                                        expert_parallel=settings.moe.expert_parallel)
    if settings.engine == "sim":
        from laminar.roles.rollout.sim_engine import SimEngine  # late: only for engine: sim
        if settings.sim is None:
            raise ValueError("roles.rollout.sim: engine sim needs the simulated engine's settings (model, tp, lengths)")
        return SimEngine.from_settings(settings.sim, max_num_seqs=engine_seqs(settings),
                                       max_model_len=settings.max_model_len)
    raise ValueError(f"roles.rollout.engine: unknown engine {settings.engine!r} (vllm or sim)")
