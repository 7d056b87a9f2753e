"""Config loading: every shipped config loads; bad files give errors naming file and field."""
from __future__ import annotations

from pathlib import Path

import pytest

from laminar.config import ConfigError, load_config
from tests.support import ROOT

BASE = """
cluster:
  keys_dir: null
  broker: {host: h0}
  hosts:
    h0:
      address: 127.0.0.1
      roles:
        - {role: broker}
        - {role: echo, id: 0, port: PORT}
"""


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert cfg.placements()


def write(tmp_path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize(
    "text, match",
    [
        (BASE.replace("PORT", "5600") + "  bad: [unclosed\n", r"c\.yaml:12:\d+: not valid YAML"),
        (BASE.replace("PORT", "5600").replace("      address", "\taddress"), r"c\.yaml:7:1: not valid YAML"),
        ("", r"c\.yaml: the top level must be a mapping"),
        ("- 1\n", r"c\.yaml: the top level must be a mapping"),
        (BASE.replace("PORT", "70000"), r"c\.yaml: cluster\.hosts\.h0\.roles\.1\.port: .*65535"),
        (BASE.replace("PORT", "nope"), r"c\.yaml: cluster\.hosts\.h0\.roles\.1\.port"),
        (BASE.replace("PORT", "5600") + "  colour: red\n", r"c\.yaml: cluster\.colour: Extra inputs"),
        (BASE.replace("PORT", "5550"), r"c\.yaml: cluster: .*port 5550 of echo\.0 already used by broker\.pub_port"),
        (
            BASE.replace("PORT", "5600") + "        - {role: echo, id: 1, port: 5600}\n",
            r"c\.yaml: cluster: .*port 5600 of echo\.1 already used by echo\.0",
        ),
        (
            BASE.replace("PORT", "5600") + "        - {role: echo, id: 0, port: 5601}\n",
            r"c\.yaml: cluster: .*echo\.0 placed twice",
        ),
        (
            BASE.replace("PORT", "5600").replace("role: echo", "role: echoo"),
            r"c\.yaml: cluster\.hosts\.h0\.roles: unknown role 'echoo'",
        ),
        (
            BASE.replace("PORT", "5600").replace("broker: {host: h0}", "broker: {host: h9}"),
            r"c\.yaml: cluster: .*broker\.host 'h9' is not one of hosts",
        ),
        (
            BASE.replace("PORT", "5600").replace("broker: {host: h0}", "broker: {}"),
            r"c\.yaml: cluster\.broker\.host: Field required",
        ),
        (
            BASE.replace("PORT", "5600").replace("  broker: {host: h0}\n", ""),
            r"c\.yaml: cluster\.broker: Field required",
        ),
        (
            BASE.replace("PORT", "5600") + "roles:\n  echo: {interval_s: -1}\n",
            r"c\.yaml: roles\.echo\.interval_s: Input should be greater than 0",
        ),
    ],
    ids=[
        "yaml-syntax",
        "yaml-tab",
        "empty",
        "not-a-map",
        "port-range",
        "port-type",
        "unknown-field",
        "dup-port-broker",
        "dup-port-roles",
        "placed-twice",
        "unknown-role",
        "broker-host-unknown",
        "broker-host-missing",
        "broker-missing",
        "role-setting-range",
    ],
)
def test_bad_config_names_file_and_field(tmp_path, text, match):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=match) as e:
        load_config(path)
    assert str(path) in str(e.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "nope.yaml")
