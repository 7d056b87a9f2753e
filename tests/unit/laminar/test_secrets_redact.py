"""Secrets never sit in the run config, so they never reach a log, a tracker or a generated file.

The HTTP scorer's headers (its only way to authenticate) used to be a literal dict: the token went
whole into every role's `config_resolved` start line, into W&B's config and MLflow's params, and
into the Slurm script (written 0755, the config embedded) and its job folder. Now a secret-like
header must name where the secret is (`{env: NAME}` or `{file: PATH}`, a 0600 file) and is read by
the role when it starts scoring; a literal one is refused naming the field; whatever else looks
secret is redacted in the start line and in what trackers get; `laminar-node slurm` refuses a
literal secret and writes its script 0700 and its job folder 0700 with 0600 files.
"""
from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
import yaml

from laminar.config import ConfigError, parse_config

TOKEN = "sk-live-0123456789abcdef"


def conf(tmp_path, headers: dict, env_options: dict | None = None) -> dict:
    roles = [{"role": "partial_pool", "port": 6801},
             {"role": "reward", "id": "rm1", "port": 6802, "options": {"scorer": "svc"}}]
    return {"run": {"name": "sec", "workdir": str(tmp_path / "run")},
            "cluster": {"keys_dir": None, "broker": {"host": "h0"},
                        "hosts": {"h0": {"address": "127.0.0.1", "roles": roles}}},
            "roles": {"reward": {"backend": "http", "http": {"url": "http://127.0.0.1:9/s", "headers": headers}},
                      "env": {"options": env_options or {}}}}


def test_secret_redact_a_literal_authorization_header_is_refused_naming_the_field(tmp_path):
    with pytest.raises(ConfigError) as err:
        parse_config(conf(tmp_path, {"Authorization": f"Bearer {TOKEN}"}))
    assert "roles.reward.http.headers" in str(err.value) and "Authorization" in str(err.value)
    assert TOKEN not in str(err.value)
    parse_config(conf(tmp_path, {"Accept": "application/json"}))   # not a secret: a literal is fine


def test_secret_redact_headers_come_from_the_environment_or_a_private_file(tmp_path, monkeypatch):
    from laminar.roles.reward.http import request_headers
    monkeypatch.setenv("SCORER_TOKEN", f"Bearer {TOKEN}")
    cfg = parse_config(conf(tmp_path, {"Authorization": {"env": "SCORER_TOKEN"}, "Accept": "application/json"}))
    s = cfg.settings_of("reward", "rm1").http
    assert request_headers(s) == {"Authorization": f"Bearer {TOKEN}", "Accept": "application/json"}
    f = tmp_path / "token"
    f.write_text(f"Bearer {TOKEN}\n")
    f.chmod(0o600)
    s = parse_config(conf(tmp_path, {"Authorization": {"file": str(f)}})).settings_of("reward", "rm1").http
    assert request_headers(s) == {"Authorization": f"Bearer {TOKEN}"}
    f.chmod(0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        request_headers(s)
    monkeypatch.delenv("SCORER_TOKEN")
    s = cfg.settings_of("reward", "rm1").http
    with pytest.raises(KeyError, match="SCORER_TOKEN"):
        request_headers(s)


def test_secret_redact_start_line_and_trackers_hold_no_secret(tmp_path, monkeypatch):
    from laminar.shell import resolved_config_fields  # what `config_resolved` logs
    from laminar.tracking import tracked_config  # what W&B and MLflow get
    monkeypatch.setenv("SCORER_TOKEN", TOKEN)
    cfg = parse_config(conf(tmp_path, {"Authorization": {"env": "SCORER_TOKEN"}},
                            env_options={"api_key": TOKEN, "retries": 3}))
    logged = resolved_config_fields(cfg, "reward", "rm1", "c.yaml", [])
    tracked = tracked_config(cfg)
    for text in (repr(logged), repr(tracked)):
        assert TOKEN not in text
    assert tracked["roles"]["env"]["options"] == {"api_key": "***", "retries": 3}
    assert logged["settings"]["http"]["headers"] == {"Authorization": {"env": "SCORER_TOKEN"}}


def test_secret_redact_slurm_files_are_private_and_hold_no_literal_secret(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(conf(tmp_path, {"Authorization": {"env": "SCORER_TOKEN"}})))
    out = tmp_path / "job.sbatch"
    r = subprocess.run([sys.executable, "-m", "laminar.cli", "slurm", str(path), "--out", str(out)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    text = out.read_text()
    assert 'umask 077' in text and 'mkdir -p -m 700 "$JOB_DIR"' in text
    leaky = tmp_path / "leaky.yaml"
    leaky.write_text(yaml.safe_dump(conf(tmp_path, {"Authorization": {"env": "X"}}, env_options={"api_key": TOKEN})))
    r = subprocess.run([sys.executable, "-m", "laminar.cli", "slurm", str(leaky), "--out", str(tmp_path / "l.sbatch")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "roles.env.options.api_key" in r.stderr and TOKEN not in r.stderr + r.stdout
    assert not (tmp_path / "l.sbatch").exists()
    assert os.access(out, os.X_OK)
