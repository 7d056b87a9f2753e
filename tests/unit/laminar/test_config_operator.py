"""What an operator types at the config: every mistake reported at once with a suggestion for a
misspelled key, and `--set key.path=value` overrides validated like the file."""
from __future__ import annotations

import pytest

from laminar.config import ConfigError, apply_overrides, load_config

BASE = """
cluster:
  keys_dir: null
  broker: {host: h0}
  hosts:
    h0:
      address: 127.0.0.1
      roles:
        - {role: broker}
        - {role: echo, id: 0, port: 5600}
roles:
  echo: {interval_s: 0.5}
"""


def write(tmp_path, text: str):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_every_role_setting_error_is_reported_with_a_suggestion(tmp_path):
    """Three typos in a role's settings: three lines, each with "did you mean" (before: the first only)."""
    text = BASE.replace("echo: {interval_s: 0.5}", "echo: {intervl_s: 0.5, max_inflite: 3, colour: red}")
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    lines = e.value.problems
    assert len(lines) == 3, lines
    assert any("roles.echo.intervl_s" in ln and "did you mean 'interval_s'" in ln for ln in lines), lines
    assert any("roles.echo.max_inflite" in ln and "did you mean 'max_inflight'" in ln for ln in lines), lines
    assert any("roles.echo.colour" in ln and "did you mean" not in ln for ln in lines), lines


def test_schema_errors_suggest_the_field_and_unknown_role_kinds(tmp_path):
    text = (BASE.replace("      address:", "      adress:").replace("role: echo", "role: ecko")
            + "  trainr: {}\n")
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    msg = str(e.value)
    assert "cluster.hosts.h0.adress" in msg and "did you mean 'address'" in msg, msg


def test_unknown_role_kinds_are_all_named_with_a_suggestion(tmp_path):
    text = BASE.replace("role: echo", "role: ecko") + "  trainr: {}\n"
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    lines = e.value.problems
    assert any("unknown role 'ecko'" in ln and "did you mean 'echo'" in ln for ln in lines), lines
    assert any("roles.trainr" in ln and "did you mean 'trainer'" in ln for ln in lines), lines


def test_overrides_set_nested_values_and_are_validated_like_the_file(tmp_path):
    path = write(tmp_path, BASE)
    cfg = load_config(path, ["roles.echo.interval_s=0.25", "run.name=other", "cluster.hosts.h0.roles.1.port=5601",
                             "cluster.shutdown_s=3"])
    assert cfg.roles["echo"]["interval_s"] == 0.25 and cfg.run.name == "other"
    assert cfg.cluster.hosts["h0"].roles[1].port == 5601 and cfg.cluster.shutdown_s == 3
    with pytest.raises(ConfigError, match=r"roles\.echo\.interval_s: Input should be greater than 0"):
        load_config(path, ["roles.echo.interval_s=-1"])
    with pytest.raises(ConfigError, match=r"roles\.echo\.intervall_s.*did you mean 'interval_s'"):
        load_config(path, ["roles.echo.intervall_s=1"])


@pytest.mark.parametrize("bad", ["noequals", "=1", "a..b=1", "cluster.hosts.h0.roles.9.port=1",
                                 "cluster.hosts.h0.address.x=1"])
def test_malformed_overrides_name_the_override(bad):
    data = {"cluster": {"hosts": {"h0": {"address": "a", "roles": [{"role": "broker"}]}}}}
    with pytest.raises(ConfigError, match=r"--set"):
        apply_overrides(data, [bad])


def test_override_values_are_yaml():
    data = apply_overrides({}, ["a.b=[1, 2]", "a.c=true", "a.d=null", "a.e=text with spaces", "a.f=3"])
    assert data == {"a": {"b": [1, 2], "c": True, "d": None, "e": "text with spaces", "f": 3}}
