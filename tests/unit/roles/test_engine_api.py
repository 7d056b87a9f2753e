"""The engine interfaces the roles call are typed protocols (roles/rollout/engine_api.py,
roles/trainer/engine_api.py), and both the real and the simulated engines implement them: every
protocol method exists with the protocol's parameters (names, kinds, defaults) and its async-ness,
and a built engine passes the runtime-checkable isinstance check (its attributes included). The
roles build their engines through one factory each; the sim trainer's sets nothing on the role."""
from __future__ import annotations

import asyncio
import inspect
import uuid
from pathlib import Path

import pytest
from laminar.roles.rollout.config import RolloutConfig
from laminar.roles.rollout.engine import VllmEngine
from laminar.roles.rollout.engine_api import RolloutEngineAPI, build_rollout_engine
from laminar.roles.rollout.sim_engine import SimEngine
from laminar.roles.trainer.config import TrainerConfig
from laminar.roles.trainer.engine_api import TrainEngineAPI
from laminar.roles.trainer.sim_engine import SimTrainEngine

from laminar.sim import load_workload
from laminar.sim.scenario import build_config
from laminar.sim.setup import load_setup
from tests.support import ROOT


def protocol_methods(proto) -> dict:
    return {n: f for n, f in vars(proto).items() if inspect.isfunction(f) and not n.startswith("_")}


def params(fn) -> list[tuple[str, inspect._ParameterKind, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def check_implements(cls, proto) -> None:
    methods = protocol_methods(proto)
    assert methods, proto
    for name, want in methods.items():
        got = getattr(cls, name, None)
        assert callable(got), f"{cls.__name__} lacks {name}"
        assert params(got) == params(want), \
            f"{cls.__name__}.{name}{inspect.signature(got)} vs {inspect.signature(want)}"
        if inspect.iscoroutinefunction(want):
            assert inspect.iscoroutinefunction(got), f"{cls.__name__}.{name} must be async"
        else:  # a plain method, or one returning an async iterator (an async generator qualifies)
            assert not inspect.iscoroutinefunction(got), f"{cls.__name__}.{name} must not be a coroutine function"


@pytest.mark.parametrize("cls,proto", [(VllmEngine, RolloutEngineAPI), (SimEngine, RolloutEngineAPI),
                                       (SimTrainEngine, TrainEngineAPI)])
def test_each_engine_defines_every_protocol_method_with_its_signature(cls, proto):
    check_implements(cls, proto)


def test_the_real_train_engine_defines_every_protocol_method_with_its_signature():
    pytest.importorskip("torch")
    from laminar.roles.trainer.engine import TrainEngine
    check_implements(TrainEngine, TrainEngineAPI)


def test_the_check_catches_a_mismatch():
    class Wrong:
        async def start(self) -> None: ...
        def generate(self, request_id, prompt, max_tokens): ...  # no seed
        async def load_relay(self, shm_dir, min_version, exact=None): ...
        def load_file(self, path): ...                           # not async
        async def close(self): ...
    with pytest.raises(AssertionError, match="generate"):
        check_implements(Wrong, RolloutEngineAPI)
    assert not isinstance(Wrong(), RolloutEngineAPI)  # no `stats`


def scenario(mode: str = "laminar", setup: dict | None = None) -> dict:
    return build_config(setup or load_setup(ROOT / "configs" / "sim" / "paper.yaml"), "32B", 128, mode,
                        workdir="/tmp/unused", speedup=5, iterations=3, workload=load_workload(),
                        weights_root=f"/dev/shm/laminar-test-{uuid.uuid4().hex[:8]}")


def test_the_rollout_factory_builds_each_engine_behind_the_protocol():
    sim = build_rollout_engine(RolloutConfig(**scenario()["roles"]["rollout"]))
    assert isinstance(sim, SimEngine) and isinstance(sim, RolloutEngineAPI)
    real = build_rollout_engine(RolloutConfig(engine="vllm", model_dir="models/tiny"), [0, 1])
    assert isinstance(real, VllmEngine) and isinstance(real, RolloutEngineAPI)  # vLLM is imported in start()
    assert real.omp_threads_bind == "0,1"
    with pytest.raises(ValueError, match="unknown engine"):
        build_rollout_engine(RolloutConfig(engine="tpu"))


def test_the_sim_trainer_is_built_by_its_factory_and_announces_version_0_on_every_host():
    cfg = scenario("one_step")
    tc = TrainerConfig(**cfg["roles"]["trainer"])
    hosts = [t.host for t in tc.sim.deliver]
    dirs = [Path(t.dir) for t in tc.sim.deliver]

    async def go():
        seen: list[tuple[str, object]] = []
        engine = SimTrainEngine.from_trainer_config(tc, lambda topic, ev: seen.append((topic, ev)), asyncio.Event())
        try:
            assert isinstance(engine, TrainEngineAPI)
            assert engine.s.extra_forward_passes == 1   # one_step recomputes the old logprobs
            assert [(t, ev.host, ev.version) for t, ev in seen] == [(f"weights.version.sim-{h}", h, 0) for h in hosts]
            assert all(d.is_dir() for d in dirs)
        finally:
            engine.delivery.close()
        return engine

    engine = asyncio.run(go())
    assert engine.describe()["delivery"] == "modeled" and engine.describe()["params"] == engine.params
    for d in dirs:
        if d.exists():
            d.rmdir()
    root = dirs[0].parent
    if root.exists():
        root.rmdir()
    assert not any(d.exists() for d in dirs)
    with pytest.raises(ValueError, match="publishing.enabled: false"):
        SimTrainEngine.from_trainer_config(tc.model_copy(update={"publishing": tc.publishing.model_copy(
            update={"enabled": True})}))


def test_the_multi_rank_methods_the_role_calls_are_declared_and_the_real_engine_has_them():
    """With world_size > 1 the role publishes, checkpoints and resumes through three more engine
    methods (publish_state, save_sharded, restore_sharded): they are a protocol of their own, the
    torch engine implements it, and the simulated engine refuses a trainer config with ranks."""
    pytest.importorskip("torch")
    from laminar.roles.trainer.engine import TrainEngine
    from laminar.roles.trainer.engine_api import ShardedTrainEngineAPI
    assert {"publish_state", "save_sharded", "restore_sharded"} <= set(protocol_methods(ShardedTrainEngineAPI))
    check_implements(TrainEngine, ShardedTrainEngineAPI)
    with pytest.raises(ValueError, match="world_size"):
        SimTrainEngine.from_trainer_config(TrainerConfig.model_validate(
            {"engine": "sim", "model_dir": "sim", "sim": {"model": "7B", "gpus": 8}, "distributed": {"world_size": 2}}))


def test_the_engine_runs_at_most_max_num_seqs_of_the_rollouts_trajectories():
    from bench.sim.runs import with_engine_seqs
    assert "max_num_seqs" in scenario()["roles"]["rollout"]  # paper.yaml's default: capped at b* (kv)
    base = scenario(setup=with_engine_seqs(load_setup(ROOT / "configs" / "sim" / "paper.yaml"), "all"))
    base = base["roles"]["rollout"]
    assert "max_num_seqs" not in base  # --engine-seqs all: the engine runs every trajectory it takes
    assert build_rollout_engine(RolloutConfig(**base)).max_num_seqs == base["max_concurrency"]
    capped = build_rollout_engine(RolloutConfig(**{**base, "max_num_seqs": 37}))
    assert capped.max_num_seqs == 37
    over = build_rollout_engine(RolloutConfig(**{**base, "max_num_seqs": 10**6}))
    assert over.max_num_seqs == base["max_concurrency"]  # never more than the rollout takes
    real = build_rollout_engine(RolloutConfig(engine="vllm", model_dir="models/tiny", max_concurrency=64,
                                              max_num_seqs=16))
    assert real.max_num_seqs == 16  # vLLM's own max_num_seqs


@pytest.mark.parametrize("mode", ["laminar", "sync"])
def test_kv_sized_engine_seqs_are_the_ceilings_batch_for_every_mode(mode):
    from bench.sim.runs import with_engine_seqs
    from laminar.sim.scenario import ideal_replica_tokens_per_s
    setup = with_engine_seqs(load_setup(ROOT / "configs" / "sim" / "paper.yaml"), "kv")
    workload = load_workload(setup.workload)
    cfg = build_config(setup, "7B", 16, mode, workdir="/tmp/x", speedup=10.0, iterations=3, workload=workload,
                       weights_root="/dev/shm/x")
    b_star = ideal_replica_tokens_per_s(setup, workload, "7B", mode)[1]
    roll = cfg["roles"]["rollout"]
    assert 1 <= b_star < roll["max_concurrency"] and roll["max_num_seqs"] == b_star
    assert build_rollout_engine(RolloutConfig(**roll)).max_num_seqs == b_star
    fixed = build_config(with_engine_seqs(setup, "100"), "7B", 16, mode, workdir="/tmp/x", speedup=10.0,
                         iterations=3, workload=workload, weights_root="/dev/shm/x")
    assert fixed["roles"]["rollout"]["max_num_seqs"] == 100


def test_refill_reaches_the_laminar_modes_only():
    """paper.yaml rollout.refill (default true; `bench/scale.py --no-refill`): the laminar modes'
    rollouts refill; the barrier modes keep their own default (stream refills, sync and one_step
    do not)."""
    from bench.sim.runs import with_refill
    setup = load_setup(ROOT / "configs" / "sim" / "paper.yaml")
    workload = load_workload(setup.workload)

    def rollout(s: dict, mode: str) -> dict:
        return build_config(s, "7B", 16, mode, workdir="/tmp/x", speedup=10.0, iterations=3, workload=workload,
                            weights_root="/dev/shm/x")["roles"]["rollout"]
    off = with_refill(load_setup(ROOT / "configs" / "sim" / "paper.yaml"), False)
    for mode in ("laminar", "laminar_norepack", "sync", "one_step", "stream"):
        assert "refill" not in rollout(off, mode)  # --no-refill: each mode's own default
    on = setup  # paper.yaml's default
    assert rollout(on, "laminar")["refill"] is True and rollout(on, "laminar_norepack")["refill"] is True
    for mode in ("sync", "one_step", "stream"):
        assert "refill" not in rollout(on, mode)
