"""`laminar/sim` is a leaf library: importing any of it loads no role, no test harness and no
benchmark program, and in `roles/` only the sim engines and their settings models import it (the
production manager reads its step curve from the neutral `laminar.stepcurve`). Before, `laminar.sim.cluster` imported
`laminar.roles.trainer.metrics` and `laminar.testing.inproc_cluster`, `laminar.sim.components`
the rollout's sim engine, and the manager `laminar.sim.latency`. Also: configs/sim/paper.yaml is
validated (a misspelt or mistyped setting is an error naming the file and the field)."""
from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import pytest

import laminar.sim
from laminar.sim.setup import SetupError, SimSetup, load_setup
from tests.support import ROOT


def test_importing_the_simulator_loads_no_role_test_harness_or_bench_code():
    mods = sorted(f"laminar.sim.{m.name}" for m in pkgutil.iter_modules(laminar.sim.__path__))
    assert {"laminar.sim.scenario", "laminar.sim.setup", "laminar.sim.reward_cost"} <= set(mods)
    code = ("import importlib, json, sys\n"
            f"for m in {mods!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(sys.modules)))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                       check=True, timeout=120).stdout)
    tangled = [m for m in loaded if m.startswith(("laminar.roles", "laminar.testing", "bench"))]
    assert tangled == [], tangled


def test_only_the_sim_engines_of_roles_import_the_simulator():
    users = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "roles").rglob("*.py") if "laminar.sim" in p.read_text())
    assert users and all(u.endswith(("/sim_engine.py", "/sim_settings.py")) for u in users), users


def test_paper_yaml_validates(tmp_path):
    setup = load_setup(ROOT / "configs" / "sim" / "paper.yaml")
    assert isinstance(setup, SimSetup) and setup.models["72B"].tp == 8 and setup.run_shape.group_size == 16
    text = (ROOT / "configs" / "sim" / "paper.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("  mfu: 0.35", "  mfuu: 0.35"))
    with pytest.raises(SetupError, match=r"bad\.yaml: trainer\.mfuu: Extra inputs"):
        load_setup(bad)
    bad.write_text(text.replace("  group_size: 16", "  group_size: sixteen"))
    with pytest.raises(SetupError, match=r"bad\.yaml: run_shape\.group_size"):
        load_setup(bad)
    bad.write_text(text.replace("one_step: nccl", "one_stepp: nccl"))
    with pytest.raises(SetupError, match="unknown modes"):
        load_setup(bad)
    with pytest.raises(SetupError, match="cannot read"):
        load_setup(tmp_path / "missing.yaml")
    with pytest.raises(KeyError, match="known"):
        setup.model_setup("13B")
