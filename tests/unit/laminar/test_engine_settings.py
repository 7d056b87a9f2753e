"""One model of a vLLM engine's settings for the rollout, the evaluator and the reward judge: the
same fields, bounds and model checks in all three, one way from settings to engine arguments, and
typed `lora` and `sim` sections (a bad key or value is found when the config is read)."""
from __future__ import annotations

import pytest
from laminar.roles.evaluator.role import EvaluatorConfig
from laminar.roles.reward.config import JudgeSettings, RewardRoleConfig
from laminar.roles.rollout.config import RolloutConfig
from laminar.roles.rollout.engine import VllmEngine
from laminar.roles.rollout.engine_api import build_rollout_engine
from laminar.roles.rollout.sim_engine import SimEngine
from laminar.roles.rollout.sim_settings import SimRolloutSettings
from pydantic import ValidationError

from laminar.config import ConfigError, parse_config
from laminar.engine_settings import EngineSettings, LoraServing
from tests.support import shape_only_model

KINDS = {"rollout": RolloutConfig, "evaluator": EvaluatorConfig, "judge": JudgeSettings}


@pytest.fixture
def model(tmp_path):
    return shape_only_model(tmp_path / "m")



def test_the_three_engines_share_one_settings_model_field_for_field():
    shared = EngineSettings.model_fields
    for name, kind in KINDS.items():
        assert issubclass(kind, EngineSettings), name
        for field, info in shared.items():
            mine = kind.model_fields[field]
            assert mine.annotation == info.annotation and mine.description, (name, field)
            if (name, field) not in {("judge", "model_dir"), ("judge", "max_model_len")}:
                assert mine is info or (mine.default, mine.metadata) == (info.default, info.metadata), (name, field)
    # the judge's two deliberate differences: its model is required, its prompts are longer
    assert JudgeSettings.model_fields["model_dir"].is_required()
    assert JudgeSettings(model_dir="j").max_model_len == 2048


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_engine_checks_its_settings_against_the_model(kind, model):
    """Before, only the rollout checked: an evaluator or judge past the model's positions, or with
    a KV cache smaller than one sequence, was accepted and failed minutes later in vLLM."""
    model_cls = KINDS[kind]
    assert model_cls(model_dir=str(model), max_model_len=2048).max_model_len == 2048
    with pytest.raises(ValidationError, match="4096 is beyond the model's 2048 positions"):
        model_cls(model_dir=str(model), max_model_len=4096)
    with pytest.raises(ValidationError, match="3 does not divide the model's 4 attention heads"):
        model_cls(model_dir=str(model), tensor_parallel_size=3)
    with pytest.raises(ValidationError, match="must hold one whole sequence"):
        model_cls(model_dir=str(model), max_model_len=512, kv_cache_tokens=256)


def test_a_sim_rollout_skips_the_model_checks():
    assert RolloutConfig(engine="sim", model_dir="models/none", max_model_len=10_000).engine == "sim"
    assert list(RolloutConfig.model_fields)[0] == "engine"  # validated before the checks that read it


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_settings_become_the_same_engine_arguments_in_every_role(kind, model):
    s = KINDS[kind](model_dir=str(model), max_model_len=512, dtype="bfloat16", kv_cache_tokens=4096,
                    tensor_parallel_size=2, enforce_eager=False, lora={"max_lora_rank": 8, "max_loras": 2})
    kw = VllmEngine.from_settings(s, max_num_seqs=6, temperature=0.0, top_p=1.0, seeded=False).engine_args(cpu=False)
    assert (kw["model"], kw["max_model_len"], kw["dtype"], kw["max_num_seqs"]) == (str(model), 512, "bfloat16", 6)
    assert (kw["tensor_parallel_size"], kw["enforce_eager"], kw["enable_prefix_caching"]) == (2, False, True)
    assert (kw["enable_lora"], kw["max_lora_rank"], kw["max_loras"]) == (True, 8, 2)
    assert kw["num_gpu_blocks_override"] == 4096 // 32


def test_the_rollout_builds_its_engine_from_the_shared_settings(model):
    r = RolloutConfig(model_dir=str(model), max_concurrency=16, max_num_seqs=4, temperature=0.7, top_p=0.9, seed=3,
                      tensor_parallel_size=2)
    eng = build_rollout_engine(r, cores=[0, 1])
    assert (eng.max_num_seqs, eng.temperature, eng.top_p, eng.seeded) == (4, 0.7, 0.9, True)
    assert eng.omp_threads_bind == "0|1" and eng.tensor_parallel_size == 2


def test_temperature_zero_is_greedy_for_generation_but_not_a_sampled_answers_temperature():
    """The rollout and the judge sample with their temperature (0 = greedy); the evaluator's is the
    temperature of its k sampled answers, greedy being a metric of its own, as every eval set's."""
    assert RolloutConfig(temperature=0.0).temperature == 0.0
    assert JudgeSettings(model_dir="j", temperature=0.0).temperature == 0.0
    with pytest.raises(ValidationError, match="temperature"):
        EvaluatorConfig(temperature=0.0)


@pytest.mark.parametrize("kind", ["rollout", "evaluator"])
def test_lora_is_typed_where_the_engine_serves_adapters(kind):
    def problems(lora) -> list[str]:
        with pytest.raises(ConfigError) as exc:
            parse_config({"cluster": {"keys_dir": None, "broker": {"host": "h0"},
                                      "hosts": {"h0": {"address": "127.0.0.1",
                                                       "roles": [{"role": kind, "port": 7000}]}}},
                          "roles": {kind: {"lora": lora}}}, "c.yaml")
        return exc.value.problems
    assert problems({"max_lora_rank": 0, "max_loras": 2}) == [
        f"c.yaml: roles.{kind}.lora.max_lora_rank: Input should be greater than or equal to 1"]
    assert (f"c.yaml: roles.{kind}.lora.max_lora: Extra inputs are not permitted (did you mean 'max_loras'?)"
            in problems({"max_lora_rank": 8, "max_lora": 2}))
    assert isinstance(KINDS[kind](lora={"max_lora_rank": 8, "max_loras": 2}).lora, LoraServing)
    assert isinstance(RewardRoleConfig(backend="judge", judge={"model_dir": "j"}).judge, JudgeSettings)


def test_the_rollouts_sim_settings_are_typed_and_keep_the_engines_defaults():
    with pytest.raises(ValidationError, match="sim.tp"):
        RolloutConfig(engine="sim", sim={"model": "7B", "lengths": "7B_math"})
    with pytest.raises(ValidationError, match="sim.speedupp"):
        RolloutConfig(engine="sim", sim={"model": "7B", "tp": 1, "lengths": "7B_math", "speedupp": 2})
    s = SimRolloutSettings(model="7B", tp=1, lengths="7B_math", speedup=4, token_id=100, max_output_tokens=256)
    assert s.engine_kwargs() == {"model": "7B", "tp": 1, "lengths": "7B_math", "token_id": 100,
                                 "max_output_tokens": 256}  # what is left out keeps the engine's default
    a = SimEngine.from_settings(s, max_num_seqs=8, max_model_len=1024)
    b = SimEngine.from_workload(model="7B", tp=1, lengths="7B_math", token_id=100, max_output_tokens=256,
                                max_num_seqs=8, max_model_len=1024)
    assert (a.num_blocks, a.prefill_s_per_token, a.load_s, a.emit_every, a.token_id, a.max_num_seqs) == \
        (b.num_blocks, b.prefill_s_per_token, b.load_s, b.emit_every, b.token_id, b.max_num_seqs)
    assert a.clock.speedup == 4
    with pytest.raises(ValueError, match="roles.rollout.sim: engine sim needs"):
        build_rollout_engine(RolloutConfig(engine="sim"))
