"""The rollout's engine settings for GPUs, checked when the config is read: tensor parallelism
against the model's heads (its config.json, or a shipped shape file) and against the placement
(one GPU per rank; on the CPU, cores split evenly), max_model_len against the model's positions;
how a placement's cores become vLLM's per-rank OpenMP binding; which engine arguments each
setting gives on the CPU build and with CUDA."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from laminar.roles.rollout.config import RolloutConfig
from laminar.roles.rollout.engine import VllmEngine

from laminar.config import ConfigError, load_config, parse_config
from tests.support import ROOT, shape_only_model


@pytest.fixture
def model(tmp_path) -> Path:
    return shape_only_model(tmp_path / "m")


def config(model, rollout: dict | None = None, **placement):
    spec = {"role": "rollout", "port": 5580, **placement}
    return parse_config({
        "cluster": {"keys_dir": None, "broker": {"host": "h0"},
                    "hosts": {"h0": {"address": "127.0.0.1", "roles": [spec]}}},
        "roles": {"rollout": {"model_dir": str(model), **(rollout or {})}}}, "c.yaml")


def test_tensor_parallel_size_must_divide_the_heads(model):
    config(model, {"tensor_parallel_size": 2}, gpus=[0, 1])
    with pytest.raises(ConfigError, match=r"c\.yaml: roles\.rollout\.tensor_parallel_size: .*3 does not divide "
                                          r"the model's 4 attention heads .*m/config\.json"):
        config(model, {"tensor_parallel_size": 3}, gpus=[0, 1, 2])
    with pytest.raises(ConfigError, match="8 does not divide the model's 4 attention heads"):
        config(model, {"tensor_parallel_size": 8})


def test_tensor_parallel_size_must_equal_the_placements_gpus(model):
    with pytest.raises(ConfigError, match=r"c\.yaml: roles\.rollout on cluster\.hosts\.h0 \(rollout\.0\): "
                                          r"tensor_parallel_size 2 must equal the number of GPUs of the placement "
                                          r"\(gpus: \[4\], 1 GPUs\)"):
        config(model, {"tensor_parallel_size": 2}, gpus=[4])
    with pytest.raises(ConfigError, match=r"tensor_parallel_size 1 must equal .*\(gpus: \[4, 5\], 2 GPUs\)"):
        config(model, {}, gpus=[4, 5])
    with pytest.raises(ConfigError, match=r"\(\+ options of rollout\.0\) on cluster\.hosts\.h0 .*gpus: \[4, 5\]"):
        config(model, {}, gpus=[4, 5], options={"max_concurrency": 8})


def test_tensor_parallel_on_the_cpu_splits_the_cores_evenly(model):
    cfg = config(model, {"tensor_parallel_size": 2}, cores=[0, 1])
    settings = cfg.settings_of("rollout", "0")
    assert settings.omp_bind([0, 1]) == "0|1"
    assert settings.omp_bind([4, 5, 6, 7]) == "4,5|6,7"
    with pytest.raises(ConfigError, match=r"tensor_parallel_size 2: the placement's cores \[0, 1, 2\] do not split "
                                          r"evenly between 2 ranks"):
        config(model, {"tensor_parallel_size": 2}, cores=[0, 1, 2])
    one = RolloutConfig(model_dir=str(model))
    assert one.omp_bind([3]) == "3" and one.omp_bind(None) is None  # one rank, no cores: vLLM's own binding
    assert settings.omp_bind(None).count("|") == 1  # no cores given: this process's, shared between the ranks


def test_max_model_len_within_the_models_positions(model):
    config(model, {"max_model_len": 2048})
    with pytest.raises(ConfigError, match=r"roles\.rollout\.max_model_len: .*4096 is beyond the model's 2048 "
                                          r"positions"):
        config(model, {"max_model_len": 4096})
    cfg = json.loads((model / "config.json").read_text())  # a rope_scaling factor extends them
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
    (model / "config.json").write_text(json.dumps(cfg))
    config(model, {"max_model_len": 8192})


def test_no_model_shape_no_check(tmp_path):
    config(tmp_path / "absent", {"tensor_parallel_size": 3, "max_model_len": 100_000}, gpus=[0, 1, 2])


def test_the_shipped_shape_stands_in_for_an_absent_model_folder():
    cfg = load_config(ROOT / "configs" / "gpu-72b.yaml")
    assert {cfg.settings_of("rollout", s.id).tensor_parallel_size for _, s in cfg.find("rollout")} == {8}
    data = yaml.safe_load((ROOT / "configs" / "gpu-7b.yaml").read_text())
    data["roles"]["rollout"]["tensor_parallel_size"] = 3
    with pytest.raises(ConfigError, match=r"3 does not divide the model's 28 attention heads "
                                          r"\(.*configs/models/Qwen2\.5-7B-Instruct/config\.json\)"):
        parse_config(data, "gpu-7b.yaml")


def test_engine_arguments_on_the_cpu_and_with_cuda(model):
    eng = VllmEngine(str(model), max_model_len=512, max_num_seqs=8, kv_cache_gib=1, temperature=1, top_p=1,
                     tensor_parallel_size=2, gpu_memory_utilization=0.8, enable_prefix_caching=False)
    cpu, gpu = eng.engine_args(cpu=True), eng.engine_args(cpu=False)
    assert cpu["enforce_eager"] is True and gpu["enforce_eager"] is False  # CUDA graphs on a GPU
    for kw in (cpu, gpu):
        assert (kw["tensor_parallel_size"], kw["gpu_memory_utilization"], kw["enable_prefix_caching"],
                kw["max_model_len"], kw["max_num_seqs"]) == (2, 0.8, False, 512, 8)
        assert kw["worker_extension_cls"] == "laminar.roles.rollout.worker_ext.LaminarWorkerExtension"
    eng.enforce_eager = True
    assert eng.engine_args(cpu=False)["enforce_eager"] is True  # an explicit setting wins
