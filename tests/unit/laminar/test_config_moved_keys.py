"""Keys of a flat settings layout that moved into sections: a config file or `--set` that still uses
one is refused with the key's new path, one line per key, next to the config's other problems."""
from __future__ import annotations

import pytest
import yaml
from laminar.roles.evaluator.role import EvaluatorConfig
from laminar.roles.rollout.config import RolloutConfig
from laminar.roles.trainer.config import TrainerConfig

from laminar.check import run_checks
from laminar.config import ConfigError, apply_overrides, parse_config


def cluster(trainer: dict | None = None, options: dict | None = None, **roles) -> dict:
    """A one-host config placing a trainer (and whatever `roles` name) with the given settings."""
    placed = [{"role": "broker"}, {"role": "trainer", **({"options": options} if options else {})}]
    placed += [{"role": kind, "port": 7000 + i} for i, kind in enumerate(roles)]
    return {"cluster": {"keys_dir": None, "broker": {"host": "h0"},
                        "hosts": {"h0": {"address": "127.0.0.1", "roles": placed}}},
            "roles": {"trainer": {"model_dir": "m", **(trainer or {})}, **roles}}


def problems(data: dict) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        parse_config(data, "c.yaml")
    return exc.value.problems


def default(path: str):
    """The default value of the setting at `path` within TrainerConfig (a valid value to set there)."""
    section, leaf = path.split(".")
    return TrainerConfig.model_fields[section].annotation.model_fields[leaf].get_default(call_default_factory=True)


@pytest.mark.parametrize("old", sorted(TrainerConfig.MOVED))
def test_every_flat_trainer_key_is_refused_with_its_new_path_and_the_new_path_is_valid(old):
    new = TrainerConfig.MOVED[old]
    assert problems(cluster({old: default(new)})) == [f"c.yaml: roles.trainer.{old}: moved to roles.trainer.{new}"]
    section, leaf = new.split(".")
    parse_config(cluster({section: {leaf: default(new)}}), "c.yaml")


def test_a_moved_key_in_a_set_override_names_its_new_path(tmp_path):
    data = apply_overrides(cluster(), ["roles.trainer.lr=0.001", "roles.trainer.checkpoint_every=5"])
    assert sorted(problems(data)) == ["c.yaml: roles.trainer.checkpoint_every: moved to roles.trainer.checkpoint.every",
                                      "c.yaml: roles.trainer.lr: moved to roles.trainer.optimizer.lr"]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cluster()))
    _, found = run_checks(path, ["roles.trainer.publish=false"], host="h0")
    moved = f"{path}: roles.trainer.publish: moved to roles.trainer.publishing.enabled"
    assert moved in found and not [p for p in found if p != moved and "model_dir: m: no such folder" not in p]
    cfg, found = run_checks(path, ["roles.trainer.publishing.enabled=false"], host="h0")
    assert not [p for p in found if "model_dir: m: no such folder" not in p]
    assert cfg.settings_of("trainer").publishing.enabled is False


def test_moved_keys_are_reported_with_the_other_problems_and_in_an_instances_options():
    found = problems(cluster({"dtype": "bfloat16", "optimizer": {"lr": -1}}, options={"world_size": 2}))
    assert "c.yaml: roles.trainer (+ options of trainer.0).dtype: moved to roles.trainer.performance.dtype" in found
    assert ("c.yaml: roles.trainer (+ options of trainer.0).world_size: moved to roles.trainer.distributed.world_size"
            in found)
    assert any("optimizer.lr: Input should be greater than 0" in p for p in found)
    assert len(found) == 3


def test_an_unknown_key_inside_a_section_gets_the_nearest_known_one():
    assert problems(cluster({"optimizer": {"lrr": 0.1}})) == [
        "c.yaml: roles.trainer.optimizer.lrr: Extra inputs are not permitted (did you mean 'lr'?)"]


@pytest.mark.parametrize("kind", ["rollout", "evaluator"])
def test_the_relay_folder_key_is_shm_dir_along_the_whole_path(kind):
    assert problems(cluster(**{kind: {"weights_dir": "/dev/shm/x"}})) == [
        f"c.yaml: roles.{kind}.weights_dir: moved to roles.{kind}.shm_dir"]
    cfg = parse_config(cluster(**{kind: {"shm_dir": "/dev/shm/x"}}), "c.yaml")
    assert cfg.settings_of(kind).shm_dir == "/dev/shm/x"
    assert {"rollout": RolloutConfig, "evaluator": EvaluatorConfig}[kind].MOVED["weights_dir"] == "shm_dir"


def test_the_trainer_settings_are_sections_of_at_most_twenty_direct_fields():
    assert len(TrainerConfig.model_fields) <= 20
    for new in TrainerConfig.MOVED.values():
        assert new.split(".")[0] in TrainerConfig.model_fields, new
        default(new)  # the leaf exists
    assert not set(TrainerConfig.MOVED) & set(TrainerConfig.model_fields)
