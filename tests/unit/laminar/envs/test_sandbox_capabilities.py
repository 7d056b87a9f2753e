"""The env unit's capabilities, for real: the sandbox run by a root process whose capability
bounding set is exactly the generated env unit's `CapabilityBoundingSet` (under `setpriv`, as
systemd would start it) still confines and runs code; the code has no capability at all; and the
cluster key, even when its folder is deliberately shown to the code (`read_only_paths`), cannot be
read: the code runs as the sandbox's own uid and the key folder is 0700, its files 0600 (the
sandbox's file view hides it anyway by default). Needs root, `unshare` and `setpriv`."""
from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from laminar.config import load_config
from laminar.envs.sandbox import Sandbox
from laminar.systemd import render_units

pytestmark = pytest.mark.skipif(Sandbox.unavailable_reason() is not None or shutil.which("setpriv") is None,
                                reason=str(Sandbox.unavailable_reason() or "util-linux setpriv not found"))

PROBE = """import asyncio, json, sys
from laminar.bus.auth import generate_keys
from laminar.envs.sandbox import Sandbox, SandboxConfig
keys = sys.argv[1]
generate_keys(keys)
code = '''import os
st = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines() if l.startswith('Cap'))
print({k: v.strip() for k, v in st.items()})
for p in %r:
    try:
        open(p).read()
        print('READ', p)
    except OSError as e:
        print('refused', e.errno)
''' % ([keys + '/cluster.key_secret', keys + '/cluster.key'],)
async def main():
    sb = Sandbox(SandboxConfig(wall_s=20, slots=1, read_only_paths=[keys]))
    await sb.check()
    r = await sb.run(code)
    bnd = open('/proc/self/status').read().split('CapBnd:')[1].split()[0]
    print(json.dumps({"stdout": r.stdout, "stderr": r.stderr, "ok": r.ok, "role_bnd": bnd}))
asyncio.run(main())
"""

CAP_BITS = {"CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_KILL": 5, "CAP_SETGID": 6, "CAP_SETUID": 7,
            "CAP_SYS_ADMIN": 21}


def env_unit_caps(tmp_path) -> list[str]:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"run": {"name": "t", "workdir": str(tmp_path / "run")}, "cluster": {
        "keys_dir": str(tmp_path / "keys"), "broker": {"host": "h0"},
        "hosts": {"h0": {"address": "127.0.0.1", "roles": [{"role": "env", "port": 45106}]}}}}))
    unit = render_units(load_config(str(path)), str(path), "h0", workdir=str(tmp_path),
                        systemd_version=254)["laminar-t-env-0.service"]
    return re.search(r"^CapabilityBoundingSet=(.*)$", unit, re.M).group(1).split()


def test_sandbox_runs_with_only_the_env_units_capabilities_and_cannot_read_the_keys(tmp_path):
    caps = env_unit_caps(tmp_path)
    assert set(caps) <= set(CAP_BITS), caps  # a new one: add its bit here
    bounding = "-all," + ",".join("+" + c.lower().removeprefix("cap_") for c in caps)
    keys = tmp_path / "keys"
    r = subprocess.run(["setpriv", f"--bounding-set={bounding}", "--inh-caps=-all", sys.executable, "-c", PROBE,
                        str(keys)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert int(out["role_bnd"], 16) == sum(1 << CAP_BITS[c] for c in caps)  # the role had only these
    assert out["ok"], out
    lines = out["stdout"].splitlines()
    seen = ast.literal_eval(lines[0])  # the dict the sandboxed probe printed
    assert int(seen["CapEff"], 16) == int(seen["CapPrm"], 16) == int(seen["CapAmb"], 16) == 0
    assert lines[1:] == ["refused 13", "refused 13"]  # EACCES: the sandbox uid, a 0700 folder
