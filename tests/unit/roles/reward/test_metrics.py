"""Reward metrics: a replica's scoring latency, queue depth and parse failures and the partial
pool's awaiting count and age reach Prometheus (laminar/health.py, from their heartbeats), and the
run summary's `reward` section (laminar/summary_rewards.py) reads what the replicas and the pool
logged: latency, queue depth, time awaiting, and each model's agreement with the rule."""
from __future__ import annotations

import json
import sqlite3

import pytest

from laminar.health import HealthCollector
from laminar.protocol import Heartbeat
from laminar.summary import summarize, table
from tests.unit.laminar.test_health import get, parse

RULE = "fn:laminar.tasks.rewards:upper_fraction"


def hb(role: str, id: str, status: dict) -> Heartbeat:
    return Heartbeat(role=role, id=id, host="h1", pid=1000, seq=1, uptime_s=3.0, state="ready", status=status)


def test_reward_role_metrics_reach_prometheus_per_replica_and_for_the_pool():
    c = HealthCollector("demo", "h1", {"reward.rm0": "h1", "reward.rm1": "h1", "partial_pool.0": "h1"},
                        dead_after_s=5.0)
    c.observe(hb("reward", "rm0", {"scorer": "rm", "scored": 96, "scores_refused": 2, "failed_batches": 1,
                                   "queue_depth": 17, "parse_failures": 3, "latency_p50_s": 0.05,
                                   "latency_max_s": 0.25, "batches": 6, "scoring_s_total": 0.6}))
    c.observe(hb("reward", "rm1", {"scorer": "rm", "scored": 0, "queue_depth": 0, "batches": 0}))
    c.observe(hb("partial_pool", "0", {"awaiting_reward": 40, "awaiting_oldest_s": 12.5, "reward_parse_failed": 3,
                                       "reward_lease_expired": 4, "reward_late_scores": 2, "reward_gave_up": 1}))
    s = parse(c.exposition())
    assert get(s, "laminar_reward_queue_depth", id="rm0") == 17 and get(s, "laminar_reward_queue_depth", id="rm1") == 0
    assert get(s, "laminar_reward_latency_p50_seconds", id="rm0") == 0.05
    assert get(s, "laminar_reward_latency_max_seconds", id="rm0") == 0.25
    assert get(s, "laminar_reward_scoring_seconds_total", id="rm0") / get(s, "laminar_reward_batches_total",
                                                                           id="rm0") == pytest.approx(0.1)
    assert get(s, "laminar_reward_parse_failures_total", id="rm0") == 3
    assert get(s, "laminar_reward_scored_total", id="rm0") == 96
    assert get(s, "laminar_partial_pool_awaiting_reward", id="0") == 40
    assert get(s, "laminar_partial_pool_awaiting_oldest_seconds", id="0") == 12.5
    assert get(s, "laminar_partial_pool_reward_lease_expired_total", id="0") == 4
    assert get(s, "laminar_partial_pool_reward_gave_up_total", id="0") == 1


def line(event: str, at: str, **kw) -> str:
    return json.dumps({"event": event, "timestamp": at, **kw}) + "\n"


def test_reward_role_summary_has_a_reward_section_from_the_logs(tmp_path):
    run = tmp_path / "run"
    for d in ("logs", "trainer", "pools"):
        (run / d).mkdir(parents=True)
    (run / "trainer" / "metrics.jsonl").write_text(json.dumps({"version": 1, "ts": 1.0, "reward_mean": 0.5}) + "\n")
    (run / "logs" / "reward.rm0.log").write_text(
        line("rewards_scored", "2026-11-27T10:00:01Z", scorer="rm", trajectories=4, seconds=0.2, waiting=8,
             parse_failed=1)
        + line("rewards_scored", "2026-11-27T10:00:02Z", scorer="rm", trajectories=4, seconds=0.6, waiting=2,
               parse_failed=0)
        + line("reward_batch_failed", "2026-11-27T10:00:03Z", scorer="rm"))
    rule = [0.9, 0.8, 0.1, 0.2]
    model = [0.7, 0.6, 0.4, 0.6]                          # on the same side of 0.5 as the rule 3 times in 4
    (run / "logs" / "rollout.1a.log").write_text("".join(
        line("trajectory_awaiting_reward", "2026-11-27T10:00:00Z", trajectory=f"g/{i}") for i in range(4)))
    (run / "logs" / "partial_pool.0.log").write_text("".join(
        line("trajectory_stored", f"2026-11-27T10:00:0{2 + i}Z", trajectory=f"g/{i}", status="stored",
             via="partial_pool", components={RULE: r, "rm": m}, version=i // 2)
        for i, (r, m) in enumerate(zip(rule, model, strict=True))))
    with sqlite3.connect(run / "pools" / "partial_pool-0.sqlite") as con:
        con.executescript("CREATE TABLE awaiting (tid TEXT); INSERT INTO awaiting VALUES ('h/0'), ('h/1');")
    s = summarize(run)["reward"]
    rep = s["replicas"]["rm0"]
    assert rep["batches"] == 2 and rep["trajectories"] == 8 and rep["failed_batches"] == 1
    assert rep["parse_failures"] == 1 and rep["queue_depth_max"] == 8 and rep["latency_max_s"] == 0.6
    assert rep["seconds_per_trajectory"] == pytest.approx(0.1)
    assert s["scored"] == 4 and s["awaiting_at_end"] == 2 and s["await_s_max"] == 5.0 and s["gave_up"] == 0
    vs = s["scorers"]["rm"]["vs"][RULE]
    assert vs["n"] == 4 and vs["agree"] == 0.75 and vs["pearson"] == pytest.approx(0.7787, abs=1e-3)
    assert s["by_version"] == {"0": {RULE: pytest.approx(0.85), "rm": pytest.approx(0.65), "n": 2},
                               "1": {RULE: pytest.approx(0.15), "rm": pytest.approx(0.5), "n": 2}}
    assert "reward[rm]" in table(summarize(run))


def test_reward_role_summary_of_a_run_without_scorers_is_none(tmp_path):
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "metrics.jsonl").write_text(json.dumps({"version": 1, "ts": 1.0, "reward_mean": 0.5}))
    assert summarize(tmp_path)["reward"] is None
