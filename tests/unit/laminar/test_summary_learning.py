"""The summary's learning keys, from the files a run writes: task (the rollouts' reward, or the
run's task when it names one), reward first/last, max staleness, train-inference mismatch (mean
over the versions that measured it, max over all), skipped non-finite steps, eval accuracy first
and last (null when the run has no evaluation)."""
from __future__ import annotations

import json

import pytest

from laminar import summary


def write_run(run, records, rollout_settings=None, run_settings=None):
    (run / "trainer").mkdir(parents=True)
    with open(run / "trainer" / "metrics.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    if rollout_settings is not None:
        (run / "logs").mkdir()
        line = {"event": "config_resolved", "role": "rollout", "id": "0", "level": "info",
                "settings": rollout_settings, "run": run_settings or {"name": "x"}}
        (run / "logs" / "rollout.0.log").write_text('{"event": "starting"}\nnot json\n' + json.dumps(line) + "\n")


def rec(v, **kw):
    return {"version": float(v), "ts": 100.0 + v, "reward_mean": 0.1 * v, "batch_tokens": 100.0,
            "staleness/0": 3.0, "staleness/1": 5.0 if v == 2 else 0.0, **kw}


def test_learning_keys(tmp_path):
    write_run(tmp_path, [
        rec(1, mismatch_tokens=40.0, mismatch_mean_abs=2e-6, mismatch_max_abs=1e-5, mismatch_k3=1e-11,
            skipped_nonfinite_steps=0.0),
        rec(2, mismatch_tokens=0.0, skipped_nonfinite_steps=1.0),   # nothing measured this version
        rec(3, mismatch_tokens=10.0, mismatch_mean_abs=4e-6, mismatch_max_abs=3e-5, mismatch_k3=3e-11,
            skipped_nonfinite_steps=2.0),
        rec(4, mismatch_tokens=10.0, mismatch_mean_abs=6e-6, mismatch_max_abs=2e-5, mismatch_k3=2e-11),
    ], rollout_settings={"reward": "laminar.tasks.math:math_reward", "model_dir": "m"})
    s = summary.write(tmp_path)
    assert s["task"] == "laminar.tasks.math:math_reward"
    assert s["reward_first"] == pytest.approx(0.15) and s["reward_last"] == pytest.approx(0.35)
    assert s["max_staleness"] == 1
    assert s["mismatch_mean_abs"] == pytest.approx(4e-6)     # mean over the 3 versions that measured
    assert s["mismatch_max_abs"] == pytest.approx(3e-5)
    assert s["mismatch_k3_mean"] == pytest.approx(2e-11)
    assert s["mismatch_versions"] == 3
    assert s["skipped_nonfinite_steps"] == 3
    assert s["eval_accuracy_first"] is None and s["eval_accuracy_last"] is None
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    for key in ("task", "eval_accuracy_first", "eval_accuracy_last", "reward_first", "reward_last", "max_staleness",
                "mismatch_mean_abs", "mismatch_max_abs", "skipped_nonfinite_steps"):
        assert key in on_disk, key
    text = summary.table(s)
    assert "mismatch_mean_abs" in text and "skipped_nonfinite_steps" in text and "task" in text


def test_run_task_and_eval_accuracy_when_present(tmp_path):
    write_run(tmp_path, [rec(1, **{"eval/accuracy": 0.25}), rec(2), rec(3, **{"eval/accuracy": 0.5}), rec(4)],
              rollout_settings={"reward": "laminar.tasks.rewards:upper_fraction"},
              run_settings={"name": "x", "task": "arithmetic"})
    s = summary.summarize(tmp_path)
    assert s["task"] == "arithmetic"
    assert s["eval_accuracy_first"] == 0.25 and s["eval_accuracy_last"] == 0.5
    # runs from before these metrics: the keys are there, empty
    assert s["mismatch_mean_abs"] is None and s["mismatch_max_abs"] is None and s["skipped_nonfinite_steps"] == 0


def test_no_logs_no_task(tmp_path):
    write_run(tmp_path, [rec(1), rec(2)])
    assert summary.summarize(tmp_path)["task"] is None


CLUSTER = {"keys_dir": None, "broker": {"host": "h0", "pub_port": 5550, "sub_port": 5551},
           "hosts": {"h0": {"address": "127.0.0.1", "roles": [{"role": "rollout", "id": "0"}]}}}


def test_a_config_may_name_its_task_and_up_records_it_where_log_rotation_cannot_remove_it(tmp_path):
    """`run.task` is a config field (it was read by the summary but refused by the config), and
    `laminar-node up` writes the run's record (<workdir>/run.json: task, mode, config) when it
    starts; the summary takes the task from it, since the rollout log line that named it rotates
    away in a long run."""
    from laminar.config import LaminarConfig
    from laminar.node import write_run_record
    cfg = LaminarConfig.model_validate({"run": {"name": "x", "workdir": str(tmp_path), "task": "word-problems"},
                                        "cluster": CLUSTER})
    assert cfg.run.task == "word-problems"
    write_run_record(cfg, "configs/local.yaml")
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["task"] == "word-problems" and record["mode"] == "laminar"
    assert record["config"] == "configs/local.yaml"
    write_run(tmp_path, [rec(1), rec(2)])     # no rollout logs at all (rotated away)
    assert summary.summarize(tmp_path)["task"] == "word-problems"


def test_without_run_task_the_record_names_the_rollouts_reward(tmp_path):
    from laminar.config import LaminarConfig
    from laminar.node import write_run_record
    cfg = LaminarConfig.model_validate({"run": {"name": "x", "workdir": str(tmp_path)}, "cluster": CLUSTER,
                                        "roles": {"rollout": {"reward": "laminar.tasks.math:math_reward"}}})
    write_run_record(cfg, "c.yaml")
    assert json.loads((tmp_path / "run.json").read_text())["task"] == "laminar.tasks.math:math_reward"
