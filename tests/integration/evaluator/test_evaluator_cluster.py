"""Held-out evaluation in a real cluster (`laminar-node up`, vLLM CPU engines): the evaluator
answers the held-out split with version 0 (before training), then with the newest weights every
`eval_every` versions and the last one, taking them from the relay like a rollout; its results
reach the live line and summary.json (accuracy before and after), `up` waits for its last
evaluation, and no held-out problem is trained on."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("vllm")
pytest.importorskip("torch")

from laminar.models.tiny import build_tiny_model  # noqa: E402
from laminar.tasks.word_problems import write  # noqa: E402
from laminar.testing.local_cluster import write_local_cluster  # noqa: E402
from laminar.testing.procs import log_events  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(420)]  # ~140 s on 2 cores


def test_evaluations_reach_the_summary(tmp_path):
    model = build_tiny_model(tmp_path / "tiny", seed=3)
    data = write(tmp_path / "data", seed=0, sizes={"heldout": 8, "prompts": 64, "sft": 0})
    path = write_local_cluster(tmp_path, model, iterations=4, prompts=data["prompts"], roles={
        "prompt_pool": {"id_field": "id", "max_tokens": 48},
        "rollout": {"reward": "laminar.tasks.math:math_reward"}})
    cfg = yaml.safe_load(path.read_text())
    cfg["cluster"]["hosts"]["h0"]["roles"].append({"role": "evaluator", "cores": [0]})
    cfg["roles"]["evaluator"] = {"dataset": str(data["heldout"]), "eval_every": 2, "samples": 2, "max_tokens": 48,
                                 "model_dir": str(model), "max_model_len": 256, "max_concurrency": 32,
                                 "kv_cache_tokens": 2048, "relay_id": "r0",
                                 "reward": "laminar.tasks.math:math_reward"}
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    out = tmp_path / "up.out"
    proc = subprocess.run([sys.executable, "-m", "laminar.cli", "up", str(path), "--plain"], stdout=out.open("w"),
                          stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=400)
    text = out.read_text()
    assert proc.returncode == 0, text[-4000:]
    run = tmp_path / "run"

    evals = [json.loads(x) for x in (run / "evaluator" / "metrics.jsonl").read_text().splitlines()]
    versions = [int(e["version"]) for e in evals]
    log = (run / "logs" / "evaluator.0.log").read_text()[-3000:]
    done = log_events(run / "logs" / "evaluator.0.log", "evaluations_done")
    assert done and done[-1]["versions"] == versions, log           # it finished; `up` waited for it
    assert versions[0] == 0 and len(versions) >= 2, versions        # before training first
    assert versions == sorted(set(versions)) and versions[-1] <= 4
    if versions[-1] != 4:  # the trainer reported version 4, the relay never held it: its newest instead
        assert done[-1]["why"] == "the last version did not reach the relay", log
        assert done[-1]["trainer_version"] == 4 and done[-1]["relay_version"] == versions[-1], log
    for e in evals:
        assert e["eval/problems"] == 8 and 0 <= e["eval/accuracy"] <= 1 and 0 <= e["eval/accuracy_sampled"] <= 1

    s = json.loads((run / "summary.json").read_text())
    assert s["eval_versions"] == versions
    assert s["eval_accuracy_first"] == evals[0]["eval/accuracy"]
    assert s["eval_accuracy_last"] == evals[-1]["eval/accuracy"]
    assert s["eval_accuracy_sampled_last"] == evals[-1]["eval/accuracy_sampled"]
    assert "eval version 0: held-out accuracy" in text
    assert f"eval version {versions[-1]}: held-out accuracy" in text

    held = {json.loads(x)["id"] for x in Path(data["heldout"]).read_text().splitlines()}
    trained = [g for r in (run / "trainer" / "metrics.jsonl").read_text().splitlines()
               for g in json.loads(r)["group_ids"]]
    assert trained and not any(h in g for g in trained for h in held)
