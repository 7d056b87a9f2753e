"""Live tracking under a real `laminar-node up` (one vLLM CPU rollout, the torch trainer, relay,
pools, manager): the MLflow file store and the W&B offline run file hold versions while the run is
still going; `up --resume` with a larger version budget continues the same MLflow run and the same
W&B run id; and a run whose MLflow server hangs trains to its last version all the same, its
dropped updates counted in the output."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("vllm")
pytest.importorskip("wandb")
pytest.importorskip("mlflow")

from laminar.models.tiny import build_tiny_model  # noqa: E402
from laminar.testing.local_cluster import write_local_cluster  # noqa: E402
from tests.support import until  # noqa: E402
from tests.unit.laminar.test_live_tracking import Hang, mlflow_history, wandb_rows  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]
CLI = [sys.executable, "-m", "laminar.cli"]


def up(path: Path, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([*CLI, "up", str(path), "--plain", *extra], stdout=out.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_SILENT": "true"})


def test_live_tracking_under_up_mid_run_resume_and_a_hanging_tracker(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")   # this process reads the store too
    model = build_tiny_model(tmp_path / "tiny", seed=3)
    path = write_local_cluster(tmp_path, model, iterations=4, rollouts=1,
                               roles={"trainer": {"checkpoint": {"every": 1}}})
    cfg = yaml.safe_load(path.read_text())
    run = tmp_path / "run"
    uri = f"file:{run / 'mlruns'}"
    cfg["tracking"] = {"wandb": {"project": "t", "mode": "offline"}, "mlflow": {"tracking_uri": uri,
                                                                                 "experiment": "live"}}
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))

    # 1. versions reach both trackers while `up` still runs
    proc = up(path, tmp_path / "up1.out")
    seen_mid_run = None
    while proc.poll() is None:
        try:
            _, hist = mlflow_history(uri, "trainer/reward_mean") if (run / "mlruns").exists() else ([], [])
        except ValueError:   # read while the node writes: a metric file it has just made is still empty
            hist = []
        ids, rows = wandb_rows(run)
        if hist and rows and proc.poll() is None:
            seen_mid_run = ([s for s, _ in hist], sorted(rows))
            break
        time.sleep(0.5)
    assert proc.wait(600) == 0, (tmp_path / "up1.out").read_text()[-4000:]
    assert seen_mid_run, "no version reached the trackers before the run ended"
    runs, hist = mlflow_history(uri, "trainer/reward_mean")
    assert len(runs) == 1 and [s for s, _ in hist] == [1, 2, 3, 4] and runs[0].info.status == "FINISHED"
    first = json.loads((run / "tracking.json").read_text())

    # 2. `up --resume` to 6 versions: the same MLflow run, the same W&B run id
    proc = up(path, tmp_path / "up2.out", "--resume", "--set", "roles.trainer.max_iterations=6")
    assert proc.wait(600) == 0, (tmp_path / "up2.out").read_text()[-4000:]
    runs, hist = mlflow_history(uri, "trainer/reward_mean")
    assert len(runs) == 1 and runs[0].info.run_id == first["mlflow"]["run_id"], runs
    assert {5, 6} <= {s for s, _ in hist}
    ids, rows = until(lambda: (got := wandb_rows(run)) and {1, 2, 3, 4, 5, 6} <= set(got[1]) and got, 30,
                      "both W&B run files written")
    assert ids == {first["wandb"]["id"]}
    assert len(list(run.glob("wandb/offline-run-*"))) == 2

    # 3. a fresh run whose MLflow server hangs: training ends on time, the drops are said
    hang = Hang()
    try:
        cfg["tracking"]["mlflow"]["tracking_uri"] = f"http://127.0.0.1:{hang.port}"
        cfg["tracking"].update(queue_size=2, close_timeout_s=2)
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        proc = up(path, tmp_path / "up3.out", "--fresh")
        assert proc.wait(600) == 0, (tmp_path / "up3.out").read_text()[-4000:]
        text = (tmp_path / "up3.out").read_text()
        trained = [json.loads(x)["version"] for x in (run / "trainer" / "metrics.jsonl").read_text().splitlines()]
        assert trained[-1] == 4, trained
        assert hang.accepted.is_set()
        line = next(ln for ln in text.splitlines() if ln.startswith("tracking: mlflow:"))
        assert "dropped" in line and "left behind (the tracker hangs)" in line, line
        assert any(ln.startswith("tracking: wandb:") and "dropped" not in ln for ln in text.splitlines()), text[-2000:]
    finally:
        hang.close()
