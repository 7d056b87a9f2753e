"""Facts one role needs of another's settings (global batch, group size, each rollout's concurrency,
a relay's settings and folder) come from the cluster config (laminar/config.py), per instance:
section defaults + that instance's options. The manager sizes its moves by each rollout's own
max_concurrency, and its fleet runs by the manager's settings under their own names and defaults."""
from __future__ import annotations

import asyncio

import pytest
from laminar.roles.manager.config import ManagerConfig
from laminar.roles.manager.fleet import FleetSettings

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
            s = mgr.fleet.settings
            assert (s.max_concurrency_of("0"), s.max_concurrency_of("1")) == (64, 8)
        finally:
            await cl.close()
    asyncio.run(go())


# -- one name per concept: the relay's settings, the fleet's settings ---------------------------------
def test_a_relays_settings_and_folder_are_read_through_one_accessor(tmp_path):
    cfg = parse_config({
        "run": {"name": "acc", "workdir": str(tmp_path)},
        "cluster": {"keys_dir": None, "broker": {"host": "h0"},
                    "hosts": {"h0": {"address": "127.0.0.1", "roles": [
                        {"role": "relay", "id": "a", "port": 6631},
                        {"role": "relay", "id": "b", "port": 6632,
                         "options": {"shm_dir": "/dev/shm/laminar-acc-own", "data_port": 6640}}]}}},
        "roles": {"relay": {"transport": "tcp", "retain_versions": 2}}})
    a, b = cfg.relay_settings("a"), cfg.relay_settings("b")
    assert (a.data_port, a.retain_versions, b.data_port, b.retain_versions) == (0, 2, 6640, 2)
    assert cfg.relay_shm_dir("a") == "/dev/shm/laminar-acc-relay-a"       # the run's default
    assert cfg.relay_shm_dir("b") == "/dev/shm/laminar-acc-own"
    assert cfg.relay_settings("nowhere").retain_versions == 2              # not placed: the section alone


def test_a_fleet_built_from_the_default_manager_config_is_the_default_fleet():
    """FleetSettings takes each shared setting's default from ManagerConfig: nothing to drift."""
    assert FleetSettings.from_config(ManagerConfig()) == FleetSettings()


def test_the_fleet_takes_every_manager_setting_and_resolves_the_rest_for_the_cluster(tmp_path):
    m = ManagerConfig(repack_interval_s=7, c_max=0.5, repack_trend="previous", batch_bound=16, rpc_timeout_s=2,
                      orphan_wait_s=9, orphan_policy="wait", settle_interval_s=3, dead_after_s=4)
    s = FleetSettings.from_config(m)
    assert (s.repack_interval_s, s.c_max, s.repack_trend, s.batch_bound, s.rpc_timeout_s, s.orphan_wait_s,
            s.orphan_policy, s.settle_interval_s) == (7, 0.5, "previous", 16, 2, 9, "wait", 3)
    assert s.rollout_dead_after_s == 4 and s.repack and s.log_path is None     # alone: laminar mode, no workdir
    cfg = _cluster(tmp_path, {"max_concurrency": 64}, [{"id": "0", "port": 6623}])
    cfg.run.mode = "stream"
    cfg.cluster.dead_after_s = 6
    s = FleetSettings.from_config(ManagerConfig(), cfg, batch_bound=40)
    assert (s.repack, s.batch_bound, s.rollout_dead_after_s, s.concurrency) == (False, 40, 6, {"0": 64})
    assert s.log_path == tmp_path / "manager" / "repacks.jsonl"
    assert FleetSettings.from_config(ManagerConfig(repack=True, rollout_dead_after_s=1.5), cfg).repack
    assert FleetSettings.from_config(ManagerConfig(rollout_dead_after_s=1.5), cfg).rollout_dead_after_s == 1.5
