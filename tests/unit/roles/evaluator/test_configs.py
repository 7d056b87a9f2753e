"""The shipped configs load through the config validator: the demo (word problems with an
evaluator), the uppercase smoke run, and SmolLM2-135M on the word problems. The evaluator's
settings are checked like any role's, its held-out file is never the prompt pool's, and it scores
with the rollouts' reward."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from laminar.roles.evaluator.role import EvaluatorConfig

from laminar.config import ConfigError, load_config, parse_config
from tests.support import ROOT


@pytest.mark.parametrize("name", ["local.yaml", "smollm2-math.yaml"])
def test_reasoning_configs_evaluate_a_held_out_split(name):
    cfg = load_config(ROOT / "configs" / name)
    ev = EvaluatorConfig.model_validate(cfg.role_settings("evaluator"))
    assert cfg.find("evaluator") and ev.eval_every >= 1 and ev.samples >= 1
    assert Path(ev.dataset).name == "heldout.jsonl"
    assert ev.dataset != cfg.role_settings("prompt_pool")["dataset"]
    assert ev.reward == cfg.role_settings("rollout")["reward"]
    assert ev.reward.startswith("laminar.tasks.math:")
    assert cfg.role_settings("evaluator")["relay_id"] == cfg.role_settings("rollout")["relay_id"]


def test_smollm2_config_uses_the_warm_started_instruct_model_and_its_tokenizer():
    """models/smollm2-math: SmolLM2-135M-Instruct after `make smollm2`'s short SFT (the Makefile
    target of that name builds it from models/smollm2)."""
    cfg = load_config(ROOT / "configs" / "smollm2-math.yaml")
    for role in ("rollout", "trainer", "evaluator"):
        assert cfg.role_settings(role)["model_dir"] == "models/smollm2-math"
    assert cfg.role_settings("prompt_pool")["tokenizer_dir"] == "models/smollm2-math"
    assert cfg.role_settings("evaluator")["tokenizer_dir"] == "models/smollm2-math"
    assert "models/smollm2-math/config.json:" in (ROOT / "Makefile").read_text()
    assert cfg.role_settings("rollout")["reward"] == "laminar.tasks.math:smollm2_math_reward"


def test_smoke_config_is_the_uppercase_task_without_evaluator():
    cfg = load_config(ROOT / "configs" / "smoke-upper.yaml")
    assert cfg.role_settings("rollout")["reward"] == "laminar.tasks.rewards:upper_fraction"
    assert not cfg.find("evaluator")
    assert cfg.run.workdir != load_config(ROOT / "configs" / "local.yaml").run.workdir


def test_an_unknown_evaluator_setting_is_refused():
    data = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    data["roles"]["evaluator"]["eval_evry"] = 3
    with pytest.raises(ConfigError, match="eval_evry"):
        parse_config(data, "local.yaml")
    data["roles"]["evaluator"].pop("eval_evry")
    data["roles"]["evaluator"]["eval_every"] = 0
    with pytest.raises(ConfigError, match="eval_every"):
        parse_config(data, "local.yaml")
