"""Facts one role needs of another's settings (global batch, group size, each rollout's concurrency)
come from the cluster config (laminar/config.py), per instance: section defaults + that instance's
options. The manager sizes its moves by each rollout's own max_concurrency."""
from __future__ import annotations

import asyncio

import pytest

from laminar.config import parse_config
from laminar.testing.inproc_cluster import InprocCluster

pytestmark = pytest.mark.timeout(30)


def _cluster(tmp_path, rollout_section: dict, rollouts: list[dict]):
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1+1", "answer": "2"}\n')
    return parse_config({
        "run": {"workdir": str(tmp_path)},
        "cluster": {"keys_dir": None, "broker": {"host": "h0"},
                    "hosts": {"h0": {"address": "127.0.0.1", "roles": [
                        {"role": "manager", "port": 6621},
                        {"role": "prompt_pool", "port": 6622, "options": {"group_size": 3}},
                        {"role": "trainer", "options": {"groups_per_batch": 5}},
                        *({"role": "rollout", **r} for r in rollouts)]}}},
        "roles": {"rollout": rollout_section, "prompt_pool": {"dataset": str(data), "group_size": 8},
                  "trainer": {"groups_per_batch": 2, "model_dir": str(tmp_path)}}})


def test_derived_facts_read_each_instance_with_its_options(tmp_path):
    cfg = _cluster(tmp_path, {"max_concurrency": 64},
                   [{"id": "0", "port": 6623}, {"id": "1", "port": 6624, "options": {"max_concurrency": 8}}])
    assert cfg.rollout_concurrency() == {"0": 64, "1": 8}
    assert cfg.global_batch_groups() == 5
    assert cfg.group_size() == 3


def test_manager_uses_each_rollouts_own_max_concurrency(tmp_path):
    cfg = _cluster(tmp_path, {"max_concurrency": 64},
                   [{"id": "0", "port": 6623}, {"id": "1", "port": 6624, "options": {"max_concurrency": 8}}])

    async def go():
        cl = InprocCluster(cfg)
        try:
            mgr = await cl.start("manager")
            s = mgr.fleet.s
            assert (s.max_concurrency_of("0"), s.max_concurrency_of("1")) == (64, 8)
        finally:
            await cl.close()
    asyncio.run(go())
