"""Mixture-of-experts shapes in the memory plan (laminar/models/shape.py, laminar/memory_plan.py):
the tiny Qwen3-MoE's parameter count equals the model transformers builds, the shipped
Qwen3-30B-A3B shape gives the published total and active counts, tensor versus expert parallel
splits, and the Qwen3-30B-A3B recipe fits 80 GiB GPUs (`laminar-node check --gpu-memory-gib 80`
exits 0) but not 48 GiB ones, naming the GiB."""
from __future__ import annotations

import json

import pytest
import yaml

from laminar.check import run_checks
from laminar.config import load_config, parse_config
from laminar.memory_plan import check_memory, plan_memory
from laminar.models.shape import model_shape, shape_from_config
from tests.support import ROOT

RECIPE = ROOT / "configs" / "gpu-qwen3-30b-a3b.yaml"


def test_moe_shape_of_the_tiny_model_matches_transformers(tmp_path):
    pytest.importorskip("torch")
    from laminar.models.loading import count_parameters, load_causal_lm
    from laminar.models.tiny import build_tiny_moe_model
    d = build_tiny_moe_model(tmp_path / "m")
    s = model_shape(d)
    assert s.is_moe and (s.experts, s.experts_per_token, s.moe_layers) == (8, 2, 2)
    assert s.params == count_parameters(load_causal_lm(d))
    # one expert: 3 x 128 x 128; each layer runs 2 of its 8
    assert s.params - s.active_params == 2 * 6 * 3 * 128 * 128


def test_moe_shape_of_qwen3_30b_a3b_is_the_published_one():
    s = model_shape(ROOT / "configs" / "models" / "Qwen3-30B-A3B")
    assert s.params / 1e9 == pytest.approx(30.5, abs=0.1)          # "30.5B in total"
    assert s.active_params / 1e9 == pytest.approx(3.3, abs=0.1)    # "3.3B activated"
    assert s.expert_params == 48 * 128 * 3 * 2048 * 768
    assert s.tp_problem(8) is None and s.tp_problem(8, expert_parallel=True) is None


def test_moe_tensor_or_expert_parallel_split():
    c = json.loads((ROOT / "configs" / "models" / "Qwen3-30B-A3B" / "config.json").read_text())
    odd = shape_from_config({**c, "moe_intermediate_size": 770})
    assert "expert MLP width 770" in odd.tp_problem(4)
    assert odd.tp_problem(4, expert_parallel=True) is None        # whole experts: 128 / 4
    assert shape_from_config({**c, "num_experts": 100}).tp_problem(8, expert_parallel=True) == \
        "8 does not divide the model's 100 experts (expert parallel)"


def test_moe_recipe_fits_80_gib_and_not_48(tmp_path):
    assert check_memory(load_config(RECIPE), 80.0) == []
    _, problems = run_checks(str(RECIPE), gpu_memory_gib=80.0)
    assert problems == []
    small = check_memory(load_config(RECIPE), 48.0)
    assert small and "GiB" in small[0]
    trainer = next(p for p in plan_memory(load_config(RECIPE), 80.0) if p.kind == "trainer")
    assert any("active per token" in n for n in trainer.notes)
    assert any("replayed routing" in k for k in trainer.items)


def test_moe_recipe_expert_parallel_setting_is_checked(tmp_path):
    data = yaml.safe_load(RECIPE.read_text())
    c = json.loads((ROOT / "configs" / "models" / "Qwen3-30B-A3B" / "config.json").read_text())
    shape_dir = tmp_path / "Odd-MoE"
    shape_dir.mkdir()
    (shape_dir / "config.json").write_text(json.dumps({**c, "moe_intermediate_size": 769}))  # odd: not / TP 2
    data["roles"]["rollout"]["model_dir"] = str(shape_dir)
    data["roles"]["rollout"]["moe"]["expert_parallel"] = False
    with pytest.raises(Exception, match="expert MLP width 769.*moe.expert_parallel on"):
        parse_config(data, "odd.yaml")
    data["roles"]["rollout"]["moe"]["expert_parallel"] = True
    parse_config(data, "odd.yaml")


def test_moe_rollout_settings_reach_its_engine_and_only_a_rollout_splits_by_experts(tmp_path):
    """The rollout's `moe` section through the shared engine settings (build_rollout_engine ->
    VllmEngine.from_settings): routing asks vLLM for the routed experts with CUDA and turns prefix
    caching off on the CPU build (a cached prompt is never routed); expert_parallel reaches vLLM.
    An evaluator, which cannot turn expert parallelism on, is refused a split only it allows."""
    from laminar.roles.evaluator.role import EvaluatorConfig
    from laminar.roles.rollout.config import RolloutConfig
    from laminar.roles.rollout.engine_api import build_rollout_engine
    from pydantic import ValidationError
    c = json.loads((ROOT / "configs" / "models" / "Qwen3-30B-A3B" / "config.json").read_text())
    odd = tmp_path / "Odd-MoE"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({**c, "moe_intermediate_size": 769}))  # whole experts only
    r = RolloutConfig(model_dir=str(odd), tensor_parallel_size=2, moe={"routing": True, "expert_parallel": True})
    eng = build_rollout_engine(r, cores=[0, 1])
    gpu, cpu = eng.engine_args(cpu=False), eng.engine_args(cpu=True)
    assert gpu["enable_return_routed_experts"] and gpu["enable_expert_parallel"] and gpu["enable_prefix_caching"]
    assert "enable_return_routed_experts" not in cpu and cpu["enable_prefix_caching"] is False
    plain = build_rollout_engine(RolloutConfig(model_dir=str(odd), tensor_parallel_size=2,
                                               moe={"expert_parallel": True}), cores=[0, 1]).engine_args(cpu=False)
    assert "enable_return_routed_experts" not in plain and plain["enable_prefix_caching"]
    with pytest.raises(ValidationError, match="expert MLP width 769"):
        EvaluatorConfig(model_dir=str(odd), tensor_parallel_size=2)
