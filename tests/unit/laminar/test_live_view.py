"""The live view of `up`/`start` (laminar/live.py): it fits an 80x24 terminal whatever the node runs,
the newest training line (version N/max, ETA) always shows, a role that is down shows why, and
it reads the node's one event collector (laminar/health.py) instead of keeping its own copy."""
from __future__ import annotations

import io
from types import SimpleNamespace

from rich.console import Console

from laminar.health import HealthCollector
from laminar.live import LiveView
from laminar.protocol import Heartbeat, Metrics, RolloutStats

DEMO = ["broker.0", "manager.0", "prompt_pool.0", "partial_pool.0", "experience_buffer.0", "relay.r0",
        "rollout.0", "rollout.1", "trainer.0", "evaluator.0"]


class Clock:
    t = 1000.0

    def __call__(self):
        return self.t


def node(keys, clock=None):
    health = HealthCollector("smoke", "h0", dict.fromkeys(keys, "h0"), dead_after_s=5.0, clock=clock or Clock())
    return health


def child(key, state="ready", pid=4242, restarts=0, last_error=None):
    role, _, id = key.partition(".")
    return SimpleNamespace(role=role, id=id, key=key, state=state, pid=pid, restarts=restarts, started_at=0.0,
                           last_exit=None, last_error=last_error)


def trainer(version, ts, **extra):
    return Metrics(role="trainer", id="0", ts=ts, values={"version": float(version), "reward_mean": 0.41,
                                                          "staleness_mean": 0.9, "staleness_max": 2.0,
                                                          "batch_tokens": 5000.0, **extra})


def feed_demo(health, view, versions=12):
    for k in DEMO:
        c = child(k, last_error="DatasetError: runs/x/data/prompts.jsonl: dataset file not found" *
                  (k == "prompt_pool.0"), state="backoff" if k == "prompt_pool.0" else "ready")
        view.child_changed(c)
        role, _, id = k.partition(".")
        health.observe(Heartbeat(role=role, id=id, host="h0", pid=4242, seq=9, state="ready", uptime_s=80.0,
                                 status={"state": "generating", "repacks": 4} if role != "broker" else {}))
    for i in range(2):
        health.observe(RolloutStats(rollout_id=str(i), host="h0", version=versions, kv_usage=0.41, running=8,
                                    waiting=0, active=8, tokens_per_s=900.0, state="generating"))
    for v in range(1, versions + 1):
        view.clock.t += 2.0
        health.observe(trainer(v, ts=100.0 + 2 * v, mismatch_mean_abs=3e-6))
    health.observe(Metrics(role="evaluator", id="0", ts=5.0, values={"version": 10.0, "eval/accuracy": 0.703}))


def render(view, width=80, height=24) -> list[str]:
    out = io.StringIO()
    console = Console(file=out, width=width, height=height, force_terminal=False, color_system=None)
    console.print(view.render(width, height))
    return out.getvalue().rstrip("\n").splitlines()


def test_the_demo_node_fits_80x24_with_the_training_line_first():
    """Before: at 80 columns every frame was cut, it needed 65 rows, and no version N/max or ETA."""
    clock = Clock()
    health = node(DEMO, clock)
    view = LiveView("laminar smoke on h0", health, max_versions=60, plain=False, clock=clock)
    feed_demo(health, view)
    lines = render(view)
    assert len(lines) <= 24 and all(len(ln) <= 80 for ln in lines), "\n".join(lines)
    head = "\n".join(lines[:3])
    assert "version 12/60" in head and "ETA 1m36s" in head and "reward 0.410" in head, head   # 48 versions x 2 s
    assert "eval 0.703 (v10)" in head and "mismatch 3.0e-06" in head, head
    text = "\n".join(lines)
    for k in DEMO:
        assert k in text, text
    assert "prompt_pool.0: DatasetError: runs/x/data/prompts.jsonl: dataset file not found" in text, text


def test_a_large_node_is_grouped_by_role_kind_and_still_fits():
    keys = ["broker.0", "manager.0", "prompt_pool.0", "partial_pool.0", "experience_buffer.0", "relay.r0",
            *[f"rollout.{i}" for i in range(32)], *[f"trainer.{i}" for i in range(8)]]
    clock = Clock()
    health = node(keys, clock)
    view = LiveView("laminar big on h0", health, max_versions=None, plain=False, clock=clock)
    for k in keys:
        view.child_changed(child(k))
    health.observe(trainer(3, ts=10.0))
    lines = render(view)
    assert len(lines) <= 24 and all(len(ln) <= 80 for ln in lines), "\n".join(lines)
    assert "version 3" in lines[1] and "rollout x32" in "\n".join(lines), "\n".join(lines)


def test_the_view_reads_the_collector_and_prints_plain_lines_that_fit(capsys):
    health = node(["trainer.0", "evaluator.0"])
    view = LiveView("t", health, max_versions=20, plain=True)
    health.observe(trainer(1, ts=10.0))
    health.observe(trainer(2, ts=12.0, mismatch_mean_abs=3e-6))
    assert health.every_role()["trainer.0"].values["throughput"] == 2500.0
    ev = Metrics(role="evaluator", id="0", ts=5.0, values={"version": 0.0, "eval/accuracy": 0.125,
                                                           "eval/accuracy_sampled": 0.0625, "eval/problems": 8.0})
    health.observe(ev)
    health.observe(ev)   # the same evaluation twice on the bus: one line
    out = capsys.readouterr().out.splitlines()
    training = [ln for ln in out if "eval version" not in ln]
    assert sum("version 2/20" in ln for ln in out) == 1 and all(len(ln) <= 80 for ln in training), out
    assert sum("eval version 0: held-out accuracy 0.125 greedy, 0.062 sampled" in ln for ln in out) == 1, out
    assert "2500 tok/s" in view.training_line() and "mismatch 3.0e-06" in view.training_line()


def test_a_start_node_shows_the_trainer_of_another_host():
    """`start` on a rollout host: the trainer is not placed here, the training line still shows it."""
    health = HealthCollector("r", "h1", {"rollout.1": "h1"}, dead_after_s=5.0)
    view = LiveView("t", health, max_versions=None, plain=False)
    health.observe(trainer(7, ts=3.0))
    assert "version 7" in view.training_line()
    assert "trainer" not in health.exposition()
