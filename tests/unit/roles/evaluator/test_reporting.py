"""Held-out evaluation and train-inference mismatch, reported everywhere a run is watched: the
evaluator's records reach summary.json (accuracy before = version 0, after = the last version),
the summary table and plot; its Metrics events reach the live line, `status` and Prometheus, and
so does the trainer's per-version mismatch. The evaluator's scheduling (which versions are due)
and scoring are checked on their own."""
from __future__ import annotations

import json

import pytest
from laminar.roles.evaluator.role import accuracy, due, give_up_waiting

from laminar import summary
from laminar.health import HealthCollector
from laminar.live import LiveView
from laminar.protocol import Heartbeat, Metrics
from laminar.remote import status_lines as _status_lines


def write_run(run, trainer_recs, eval_recs):
    (run / "trainer").mkdir(parents=True)
    (run / "trainer" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in trainer_recs))
    (run / "evaluator").mkdir()
    (run / "evaluator" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in eval_recs))


def trec(v):
    return {"version": float(v), "ts": 100.0 + v, "reward_mean": 0.05 * v, "batch_tokens": 100.0,
            "staleness/0": 4.0, "mismatch_tokens": 10.0, "mismatch_mean_abs": 1e-6 * v, "mismatch_max_abs": 1e-5,
            "mismatch_k3": 1e-12}


def erec(v, acc, sampled):
    return {"version": float(v), "eval/accuracy": acc, "eval/accuracy_sampled": sampled, "eval/problems": 8.0,
            "eval/seconds": 0.5, "lineage": 0, "ts": 100.0 + v + 0.5}


def test_summary_states_accuracy_before_and_after(tmp_path):
    write_run(tmp_path, [trec(v) for v in range(1, 7)],
              [erec(0, 0.125, 0.0625), erec(3, 0.25, 0.3), erec(6, 0.625, 0.5)])
    s = summary.write(tmp_path)
    assert s["eval_accuracy_first"] == 0.125 and s["eval_accuracy_last"] == 0.625
    assert s["eval_accuracy_sampled_first"] == 0.0625 and s["eval_accuracy_sampled_last"] == 0.5
    assert s["eval_versions"] == [0, 3, 6]
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["eval_accuracy_first"] == 0.125 and on_disk["eval_accuracy_last"] == 0.625
    assert "eval_accuracy_sampled_last" in summary.table(s)
    if s["plot"]:  # matplotlib installed: the plot has the eval panel (three axes, not two)
        pytest.importorskip("matplotlib")
        from PIL import Image
        assert Image.open(s["plot"]).size[1] > 600


def test_summary_without_an_evaluator_keeps_null_accuracy(tmp_path):
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "metrics.jsonl").write_text("".join(json.dumps(trec(v)) + "\n" for v in (1, 2)))
    s = summary.summarize(tmp_path)
    assert s["eval_accuracy_first"] is None and s["eval_accuracy_last"] is None and s["eval_versions"] == []


def eval_event(v, acc, sampled):
    return Metrics(role="evaluator", id="0", ts=1.0, values={"version": float(v), "eval/accuracy": acc,
                                                              "eval/accuracy_sampled": sampled, "eval/problems": 8.0,
                                                              "eval/seconds": 0.5})


def trainer_event(v):
    return Metrics(role="trainer", id="0", ts=10.0 + v, values={k: x for k, x in trec(v).items() if k != "ts"})


def test_live_line_shows_eval_accuracy_and_mismatch(capsys):
    health = HealthCollector("demo", "h0", {"trainer.0": "h0", "evaluator.0": "h0"}, dead_after_s=5.0)
    view = LiveView("t", health, plain=True)
    health.observe(eval_event(0, 0.125, 0.0625))
    health.observe(eval_event(0, 0.125, 0.0625))  # the same event again: one line
    assert capsys.readouterr().out.count("eval version 0: held-out accuracy 0.125 greedy, 0.062 sampled") == 1
    health.observe(trainer_event(3))
    line = view.training_line()
    assert "eval 0.125 (v0)" in line and "mismatch 3.0e-06" in line
    health.observe(eval_event(10, 0.5, 0.375))
    assert "eval 0.500 (v10)" in view.training_line()


def test_prometheus_and_status_show_eval_accuracy_and_mismatch():
    c = HealthCollector("demo", "h0", {"trainer.0": "h0", "evaluator.0": "h0"}, dead_after_s=5.0)
    c.observe(trainer_event(3))
    c.observe(eval_event(10, 0.5, 0.375))
    text = c.exposition()
    assert 'laminar_eval_accuracy{id="0",host="h0"} 0.5' in text
    assert 'laminar_eval_accuracy_sampled{id="0",host="h0"} 0.375' in text
    assert 'laminar_eval_version{id="0",host="h0"} 10.0' in text
    assert 'laminar_trainer_mismatch_mean_abs{id="0",host="h0"} 3e-06' in text
    assert 'laminar_trainer_mismatch_max_abs{id="0",host="h0"} 1e-05' in text
    rows = {k: {"metrics": v["metrics"]} for k, v in c.snapshot().items()}
    lines = "\n".join(_status_lines(rows))
    assert "evaluator.0: held-out accuracy 0.500 greedy, 0.375 sampled (version 10)" in lines
    assert "mismatch mean 3.00e-06 max 1.00e-05" in lines


def test_status_reads_the_evaluators_heartbeat_too():
    """`status` listens a few seconds and may hear no evaluation: the heartbeat carries the newest."""
    c = HealthCollector("demo", "", {"evaluator.0": "h0"}, dead_after_s=5.0, only_placed=False)
    c.observe(Heartbeat(role="evaluator", id="0", host="h0", pid=1, seq=1, state="ready", uptime_s=1.0,
                        status={"state": "waiting", "version": 20, "eval_version": 20, "accuracy": 0.75,
                                "accuracy_sampled": 0.5}))
    m = c.snapshot()["evaluator.0"]["metrics"]
    assert m["eval_accuracy"] == 0.75 and m["eval_accuracy_sampled"] == 0.5 and m["eval_version"] == 20


@pytest.mark.parametrize(("version", "last", "every", "final", "expect"), [
    (1, 0, 5, 100, False), (5, 0, 5, 100, True), (7, 0, 5, 100, True),   # a skipped 5: the next newest
    (9, 7, 5, 100, False), (12, 7, 5, 100, True),
    (100, 98, 5, 100, True),                                            # the last version always
    (100, 100, 5, 100, False), (3, 5, 5, None, False), (10, 5, 5, None, True)])
def test_which_versions_are_due(version, last, every, final, expect):
    assert due(version, last, every, final) is expect


def test_accuracy_counts_correct_answers():
    assert accuracy([1.0, 0.0, 1.0, 0.0]) == 0.5
    assert accuracy([0.9, 0.0]) == 0.0 and accuracy([]) == 0.0


@pytest.mark.parametrize(("trainer", "relay", "since", "now", "expect"), [
    (4, 3, 10.0, 40.0, True),      # the trainer reported its last version 30 s ago, the relay never got it
    (4, 3, 10.0, 20.0, False),     # not yet: within final_wait_s
    (4, 4, 10.0, 40.0, False),     # the relay has it: evaluate it normally
    (3, 3, None, 40.0, False),     # the trainer is not done
])
def test_the_evaluator_stops_waiting_for_a_last_version_the_relay_never_gets(trainer, relay, since, now, expect):
    assert give_up_waiting(trainer, 4, relay, since, now, 20.0) is expect
    assert give_up_waiting(trainer, None, relay, since, now, 20.0) is False  # no last version: run until stopped
