"""`laminar-node dashboard` (laminar/dashboard.py): every query of the Grafana dashboard names only
series some role's node exports, and only series the exporter really writes when every kind of
role reports; every panel has a unit; the scrape config names the config's metrics ports. With
Debian's `promtool` on the path, Prometheus itself parses the scrape config and every query."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import yaml

from laminar.dashboard import PANELS, dashboard, metrics_in
from laminar.health import HealthCollector
from laminar.health_facts import metric_names
from laminar.protocol import Metrics, RelayProgress, RolloutStats
from laminar.testing.procs import free_port
from tests.unit.laminar.test_health import child, hb, parse

CLI = [sys.executable, "-m", "laminar.cli"]
EVERY_ROLE = ("broker.0", "manager.0", "prompt_pool.0", "partial_pool.0", "experience_buffer.0", "relay.r0",
              "rollout.0", "trainer.0", "evaluator.0", "reward.0", "env.0", "gateway.0")


def every_series_written() -> set[str]:
    """The series names of one node where every kind of role reported every fact it reports."""
    c = HealthCollector("demo", "h0", {k: "h0" for k in EVERY_ROLE}, dead_after_s=5.0, clock=lambda: 100.0)
    for key in EVERY_ROLE:
        role, _, id = key.partition(".")
        c.child_changed(child(role, id, "ready"))
    from laminar.health_facts import HB_FACTS as _HB_FACTS
    for key in EVERY_ROLE:
        role, _, id = key.partition(".")
        status = {k: 1 for k in _HB_FACTS.get(role, {})}
        if role == "manager":
            status["weights_stalled"] = 1                 # raises the alarm
        c.observe(hb(role, id, {**status, "state": "x"}))
    c.observe(RolloutStats(rollout_id="0", host="h0", version=6, kv_usage=0.5, running=1, waiting=0, active=1,
                           tokens_per_s=2.0, state="generating", generated_tokens=9))
    c.observe(RelayProgress(relay_id="r0", version=7, chunks_have=4, chunks_total=9, complete_version=6,
                            corrupt_chunks=1, upstream="", downstream=""))
    from laminar.health_facts import TRAINER_FACTS as _TRAINER_FACTS
    for ts, v in ((1.0, 1.0), (2.0, 2.0)):
        c.observe(Metrics(role="trainer", id="0", ts=ts, values={**{k: 1.0 for k in _TRAINER_FACTS},
                                                                 "version": v, "batch_tokens": 10.0}))
    c.observe(Metrics(role="evaluator", id="0", ts=1.0, values={"version": 2.0, "eval/accuracy": 0.5,
                                                                "eval/accuracy_sampled": 0.4, "eval/h/greedy": 0.5}))
    return {name for name, _ in parse(c.exposition())}


def test_dashboard_names_only_series_the_exporter_writes():
    """metric_names() is exactly what the exporter writes once every kind of role reported: so a
    query naming one of them reads a series some role's node exports."""
    assert every_series_written() == metric_names()


def test_dashboard_every_query_names_an_exported_metric_and_every_panel_has_a_unit(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({
        "run": {"name": "demo", "workdir": str(tmp_path / "run")},
        "cluster": {"keys_dir": None, "broker": {"host": "h0", "pub_port": free_port(), "sub_port": free_port()},
                    "hosts": {"h0": {"address": "127.0.0.1", "metrics_port": 5599, "roles": [{"role": "broker"}]}}}}))
    out = subprocess.run([*CLI, "dashboard", str(cfg), "--out", str(tmp_path / "d")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    board = json.loads((tmp_path / "d" / "laminar-demo.json").read_text())
    exported = metric_names()
    assert board["panels"] and len({p["id"] for p in board["panels"]}) == len(board["panels"])
    for p in board["panels"]:
        assert p["fieldConfig"]["defaults"].get("unit"), f"panel {p['title']!r} has no unit"
        assert p["targets"], p["title"]
        for t in p["targets"]:
            named = metrics_in(t["expr"])
            assert named, (p["title"], t["expr"])
            assert named <= exported, f"{p['title']}: {sorted(named - exported)} is exported by no role"
            assert 'host=~"$host"' in t["expr"], t["expr"]
    assert [v["name"] for v in board["templating"]["list"]] == ["datasource", "run", "host"]


@pytest.mark.parametrize("topic", ["throughput", "reward", "staleness", "mismatch", "kv", "relay progress",
                                   "relay lag", "pools", "alarms", "reward role: queue", "agent episodes"])
def test_dashboard_has_a_panel_for(topic):
    assert any(topic in title.lower() for title, _, _ in PANELS), topic


def test_dashboard_scrape_config_names_every_metrics_port(tmp_path):
    from laminar.config import parse_config
    from laminar.dashboard import scrape_config
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    cfg = parse_config({"run": {"name": "big"}, "cluster": {
        "keys_dir": None, "broker": {"host": "h0"},
        "hosts": {"h0": {"address": "10.0.0.1", "metrics_port": 5599, "metrics_token_file": str(token),
                         "roles": [{"role": "broker"}]},
                  "h1": {"address": "10.0.0.2", "bind": "10.0.0.2", "metrics_port": 5600, "roles": []},
                  "h2": {"address": "10.0.0.3", "roles": []}}}})
    prom, skipped = scrape_config(cfg)
    assert skipped == ["h2"]
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    assert jobs["laminar-big-h0"]["static_configs"][0]["targets"] == ["10.0.0.1:5599"]
    assert jobs["laminar-big-h0"]["authorization"] == {"type": "Bearer", "credentials_file": str(token)}
    assert jobs["laminar-big-h1"]["static_configs"][0]["targets"] == ["10.0.0.2:5600"]
    assert "authorization" not in jobs["laminar-big-h1"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian's prometheus package) not installed")
def test_dashboard_prometheus_parses_the_config_and_every_query(tmp_path):
    from laminar.config import parse_config
    from laminar.dashboard import scrape_config
    cfg = parse_config({"run": {"name": "p"}, "cluster": {"keys_dir": None, "broker": {"host": "h0"}, "hosts": {
        "h0": {"address": "127.0.0.1", "metrics_port": 5599, "roles": [{"role": "broker"}]}}}})
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(scrape_config(cfg)[0]))
    out = subprocess.run(["promtool", "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    exprs = [t["expr"].replace("$host", ".*") for p in dashboard("p")["panels"] for t in p["targets"]]
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"laminar:q{i}", "expr": e}
                                                        for i, e in enumerate(exprs)]}]}
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    out = subprocess.run(["promtool", "check", "rules", str(tmp_path / "rules.yml")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
