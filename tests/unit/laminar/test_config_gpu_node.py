"""configs/gpu-node.yaml (one host, 8 GPUs) validates, and each role's process gets the GPUs its
placement names: `gpus: [...]` -> CUDA_VISIBLE_DEVICES in the environment laminar-node up/start
gives the child (checked in a real child process) and in the role's systemd unit."""
from __future__ import annotations

import asyncio
import os
import sys

import pytest

from laminar.config import ConfigError, load_config, parse_config
from laminar.supervisor import Child, Supervisor, children_for_host
from tests.support import ROOT

GPU_NODE = ROOT / "configs" / "gpu-node.yaml"


def test_gpu_node_config_validates_and_gives_each_role_its_gpus():
    cfg = load_config(GPU_NODE)
    (host,) = cfg.cluster.hosts
    env = {c.key: c.env.get("CUDA_VISIBLE_DEVICES") for c in children_for_host(cfg, str(GPU_NODE), host)}
    assert {k: v for k, v in env.items() if v is not None} == {
        "trainer.0": "0", "trainer.1": "1", "trainer.2": "2", "trainer.3": "3",
        "rollout.0": "4", "rollout.1": "5", "rollout.2": "6", "rollout.3": "7"}
    cpu_only = {"broker.0", "manager.0", "prompt_pool.0", "partial_pool.0", "experience_buffer.0", "relay.r0"}
    assert {k for k, v in env.items() if v is None} == cpu_only
    trainer = cfg.settings_of("trainer", "0")
    assert trainer.distributed.world_size == len(cfg.find("trainer")) == 4
    assert trainer.performance.dtype == "bfloat16" and trainer.performance.packing is True
    assert trainer.checkpoint.export_dir
    assert {cfg.settings_of("rollout", str(i)).dtype for i in range(4)} == {"bfloat16"}


def test_systemd_units_carry_the_gpus():
    from laminar.systemd import render_units
    cfg = load_config(GPU_NODE)
    (host,) = cfg.cluster.hosts
    units = render_units(cfg, str(GPU_NODE), host, python="/usr/bin/python3", workdir="/srv/laminar",
                         systemd_version=255)
    trainer2 = next(text for name, text in units.items() if "trainer-2" in name or "trainer.2" in name)
    assert "\nEnvironment=CUDA_VISIBLE_DEVICES=2\n" in trainer2
    relay = next(text for name, text in units.items() if "relay" in name)
    assert "CUDA_VISIBLE_DEVICES" not in relay


def _cfg(gpus):
    return {"run": {"workdir": "/tmp/x"},
            "cluster": {"keys_dir": None, "broker": {"host": "h0"},
                        "hosts": {"h0": {"address": "127.0.0.1", "roles": [{"role": "echo", "gpus": gpus}]}}}}


def test_gpus_must_be_distinct_indices():
    assert parse_config(_cfg([])).find("echo")[0][1].env() == {"CUDA_VISIBLE_DEVICES": ""}  # no GPU at all
    for bad in ([-1], [1, 1]):
        with pytest.raises(ConfigError, match="gpus"):
            parse_config(_cfg(bad))


def test_supervised_child_sees_only_its_gpus(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")  # what the supervisor itself sees
    script = ("import os, sys; open(sys.argv[1], 'w').write(os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>'));"
              "os.write(int(sys.argv[-1]), b'READY\\n')")
    cfg = parse_config(_cfg([5, 6]))
    (spec,) = cfg.cluster.hosts["h0"].roles
    placed = Child("echo", "0", [sys.executable, "-c", script, str(tmp_path / "placed")], env=spec.env())
    plain = Child("echo", "1", [sys.executable, "-c", script, str(tmp_path / "plain")])

    async def go():
        sup = Supervisor([placed, plain], shutdown_s=5)
        await sup.start()
        try:
            for c in (placed, plain):
                while c.state not in ("finished", "backoff", "failed"):
                    c.changed.clear()
                    await asyncio.wait_for(c.changed.wait(), 30)
        finally:
            await sup.stop()

    asyncio.run(go())
    assert (tmp_path / "placed").read_text() == "5,6"
    assert (tmp_path / "plain").read_text() == "0,1,2,3,4,5,6,7"  # no gpus: inherited as it was
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"  # the supervisor's own is untouched
