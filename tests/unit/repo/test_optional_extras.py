"""Optional extras stay optional: `make demo` installs only the `cpu` and `tb` extras, so every
production module must import without the others, and a feature that needs one says which.

Each test runs a fresh interpreter whose import system refuses the extras' packages (a meta-path
finder raising ModuleNotFoundError), as a machine where they were never installed would.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import yaml

HIDDEN = ("peft", "wandb", "mlflow", "ucxx")   # the extras `make demo` does not install

BLOCKER = textwrap.dedent(f"""
    import importlib.abc, sys
    HIDDEN = {HIDDEN!r}
    class Hide(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in HIDDEN:
                raise ModuleNotFoundError(f"No module named {{name!r}} (hidden)", name=name)
    sys.meta_path.insert(0, Hide())
    for n in list(sys.modules):
        if n.split(".")[0] in HIDDEN:
            del sys.modules[n]
""")


def run_hidden(body: str, timeout: float = 240) -> dict:
    """Run `body` (which prints one JSON line last) with the extras hidden; its parsed output."""
    code = BLOCKER + textwrap.dedent(body)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_optional_extras_every_production_module_imports_without_them():
    """Every module of laminar, laminar.bus and laminar.roles imports with the extras hidden."""
    got = run_hidden("""
        import importlib, json, pkgutil
        import laminar
        bad, n = {}, 0
        for m in pkgutil.walk_packages(laminar.__path__, "laminar."):
            if m.name.startswith("laminar.testing"):
                continue   # test support, not production code
            n += 1
            try:
                importlib.import_module(m.name)
            except ModuleNotFoundError as exc:
                if "(hidden)" in str(exc):
                    bad[m.name] = str(exc)
        for pkg in ("laminar.bus", "laminar.roles"):
            p = importlib.import_module(pkg)
            for m in pkgutil.walk_packages(p.__path__, pkg + "."):
                n += 1
                try:
                    importlib.import_module(m.name)
                except ModuleNotFoundError as exc:
                    if "(hidden)" in str(exc):
                        bad[m.name] = str(exc)
        print(json.dumps({"bad": bad, "n": n}))
    """)
    assert got["n"] > 150, got
    assert got["bad"] == {}, f"these modules need an optional extra at import: {got['bad']}"


def test_optional_extras_lora_says_which_extra():
    """Asking for LoRA without peft: the clear error names the extra, at the feature."""
    got = run_hidden("""
        import json
        from laminar.extras import MissingExtra
        from laminar.roles.trainer import lora
        from laminar.roles.trainer.config import LoraSettings
        try:
            lora.lora_config(LoraSettings())
            print(json.dumps({"raised": None}))
        except MissingExtra as exc:
            print(json.dumps({"raised": str(exc)}))
    """)
    assert got["raised"] and "pip install -e '.[lora]'" in got["raised"], got


def test_optional_extras_check_reports_a_feature_without_its_extra(tmp_path):
    """`laminar-node check` names the missing extra when the config asks for its feature."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({
        "run": {"name": "x", "workdir": str(tmp_path / "w")},
        "cluster": {"broker": {"host": "h0", "pub_port": 45150, "sub_port": 45151},
                    "hosts": {"h0": {"address": "127.0.0.1", "roles": [{"role": "broker"}, {"role": "trainer"}]}}},
        "tracking": {"wandb": {"project": "p", "mode": "offline"}},
        "roles": {"trainer": {"model_dir": str(tmp_path), "lora": {"rank": 4}, "publishing": {"transport": "ucx"}}},
    }))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    got = run_hidden(f"""
        import json
        from laminar.check import run_checks
        cfg, problems = run_checks({str(cfg)!r})
        print(json.dumps({{"problems": problems}}))
    """)
    text = "\n".join(got["problems"])
    assert "pip install -e '.[lora]'" in text, text
    assert "pip install -e '.[tracking]'" in text, text
    assert "roles.trainer.publishing.transport: the UCX weight transport needs the ucxx package" in text, text
