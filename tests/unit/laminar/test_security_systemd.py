"""Generated systemd units run each role as a dedicated user, confined: no new privileges, a
read-only system with only the run's paths writable, private /tmp, a private umask, bounded open
files, restart backoff, and a start timeout long enough for the role (a rollout loading a large
model). `systemd-analyze verify` must accept them; `systemd-analyze security` is printed."""
from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import yaml

from laminar.config import load_config
from laminar.systemd import render_units, write_units


def _config(tmp_path, systemd: dict | None = None):
    cluster = {"keys_dir": str(tmp_path / "keys"),
               "broker": {"host": "h0", "pub_port": 45101, "sub_port": 45102},
               "hosts": {"h0": {"address": "10.0.0.1", "bind": "10.0.0.1", "roles": [
                   {"role": "broker"}, {"role": "echo", "id": "0", "port": 45103},
                   {"role": "rollout", "id": "0", "port": 45104},
                   {"role": "rollout", "id": "1", "port": 45105, "ready_timeout_s": 3600},
                   {"role": "env", "id": "0", "port": 45106}]}}}
    if systemd is not None:
        cluster["systemd"] = systemd
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"run": {"name": "t", "workdir": str(tmp_path / "run")}, "cluster": cluster}))
    return load_config(str(path)), str(path)


def directives(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if re.match(r"^[A-Z]\w*=", line))


def test_units_are_confined_and_run_as_a_dedicated_user(tmp_path):
    cfg, path = _config(tmp_path)
    units = render_units(cfg, path, "h0", workdir=str(tmp_path), systemd_version=254)
    echo = directives(units["laminar-t-echo-0.service"])
    assert echo["User"] == "laminar" and echo["UMask"] == "0077" and echo["NoNewPrivileges"] == "yes"
    assert echo["ProtectSystem"] == "strict" and echo["PrivateTmp"] == "yes"
    assert str(tmp_path / "run") in echo["ReadWritePaths"]
    assert int(echo["LimitNOFILE"]) >= 65536
    assert echo["RestartSteps"] and echo["RestartMaxDelaySec"]
    assert echo["TimeoutStartSec"] == "300"
    rollout0 = directives(units["laminar-t-rollout-0.service"])
    rollout1 = directives(units["laminar-t-rollout-1.service"])
    assert rollout0["TimeoutStartSec"] == "1800" and rollout1["TimeoutStartSec"] == "3600"
    env = directives(units["laminar-t-env-0.service"])
    assert env["User"] == "root" and env["NoNewPrivileges"] == "yes"  # its sandbox makes namespaces


def test_user_and_limits_are_configurable_and_root_only_when_asked(tmp_path):
    cfg, path = _config(tmp_path, {"user": "root", "limit_nofile": 1 << 20, "role_users": {"env": "sandboxer"},
                                   "read_write_paths": ["/data/ckpt"]})
    units = render_units(cfg, path, "h0", workdir=str(tmp_path), systemd_version=254)
    echo = directives(units["laminar-t-echo-0.service"])
    assert echo["User"] == "root" and echo["LimitNOFILE"] == str(1 << 20)
    assert "/data/ckpt" in echo["ReadWritePaths"]
    assert directives(units["laminar-t-env-0.service"])["User"] == "sandboxer"


def test_restart_backoff_keys_only_where_systemd_knows_them(tmp_path):
    cfg, path = _config(tmp_path)
    old = render_units(cfg, path, "h0", workdir=str(tmp_path), systemd_version=252)["laminar-t-echo-0.service"]
    assert "RestartSteps=" not in old and "RestartMaxDelaySec=" not in old and "systemd >= 254" in old


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_hardened_units_verify_and_security_score(tmp_path):
    cfg, path = _config(tmp_path)
    units = write_units(render_units(cfg, path, "h0", workdir=str(tmp_path)), str(tmp_path / "units"))
    v = subprocess.run(["systemd-analyze", "verify", *map(str, units)], capture_output=True, text=True,
                       env={**os.environ, "SYSTEMD_LOG_LEVEL": "warning"})
    ours = [line for line in (v.stdout + v.stderr).splitlines() if "laminar-" in line]
    assert v.returncode == 0 and not ours, v.stdout + v.stderr
    for name in ("laminar-t-echo-0.service", "laminar-t-rollout-0.service", "laminar-t-env-0.service"):
        s = subprocess.run(["systemd-analyze", "security", "--offline=true", str(tmp_path / "units" / name)],
                           capture_output=True, text=True)
        score = re.search(r"Overall exposure level for \S+: ([0-9.]+) (\w+)", s.stdout)
        print(f"\n{name}: systemd-analyze security {score.group(1)} {score.group(2)}" if score else s.stdout[-300:])
        if score and name != "laminar-t-env-0.service":
            assert float(score.group(1)) < 6.0, s.stdout   # "MEDIUM" or better; the old units scored 9.6 UNSAFE


def test_env_unit_delegates_its_cgroup_and_bounds_root_to_the_sandbox_capabilities(tmp_path):
    """Before: the env unit ran as full root without Delegate=yes, so on cgroup v2 its sandbox had no
    cgroup it could make children in (runs went without one). Now its cgroup is delegated and its
    capabilities are only those the sandbox needs (tests/unit/laminar/envs/test_sandbox_capabilities.py runs the sandbox
    with exactly these); other roles keep their own confinement and no Delegate."""
    cfg, path = _config(tmp_path)
    units = render_units(cfg, path, "h0", workdir=str(tmp_path), systemd_version=254)
    env = directives(units["laminar-t-env-0.service"])
    assert env["Delegate"] == "yes"
    caps = env["CapabilityBoundingSet"].split()
    assert "CAP_SYS_ADMIN" in caps and "CAP_SETUID" in caps
    assert not {"CAP_SYS_MODULE", "CAP_SYS_RAWIO", "CAP_SYS_PTRACE", "CAP_NET_ADMIN", "CAP_DAC_READ_SEARCH"} & set(caps)
    echo = directives(units["laminar-t-echo-0.service"])
    assert "Delegate" not in echo and echo["ProtectControlGroups"] == "yes"
