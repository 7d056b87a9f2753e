"""Live tracking (laminar/live_tracking.py) against the real libraries: W&B in offline mode and an
MLflow file store, read back with their own code. Versions arrive while the run is still open; a
second sender on the same workdir (a resumed node) continues the same runs; a tracker that hangs
(an MLflow server that accepts and never answers) neither blocks the sender's caller nor the other
tracker, and its drops are counted; versions the bus dropped are sent from the durable records at
the end."""
from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest

from laminar.live_tracking import LiveTracking
from laminar.protocol import Metrics
from laminar.tracking_spec import TrackingSpec
from tests.support import until, wandb_records

pytest.importorskip("wandb")
pytest.importorskip("mlflow")
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(autouse=True)
def _wandb_quiet(monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")


def spec(run: Path, mlflow_uri: str | None = None, **kw) -> TrackingSpec:
    return TrackingSpec.model_validate({"wandb": {"project": "t", "mode": "offline", "dir": str(run)},
                                        "mlflow": {"tracking_uri": mlflow_uri or f"file:{run / 'mlruns'}",
                                                   "experiment": "live"}, **kw})


def trainer(v: int, reward: float) -> Metrics:
    return Metrics(role="trainer", id="0", ts=time.time(), values={"version": float(v), "reward_mean": reward,
                                                                    "staleness_mean": 0.5})


def mlflow_history(uri: str, key: str) -> tuple[list, list]:
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("live")
    runs = client.search_runs([exp.experiment_id]) if exp else []
    return runs, (sorted((m.step, m.value) for m in client.get_metric_history(runs[0].info.run_id, key))
                  if len(runs) == 1 else [])


def wandb_rows(run: Path) -> tuple[set[str], dict[int, dict]]:
    """(run ids of every offline run folder, {version: row}) read from the .wandb files."""
    ids, rows = set(), {}
    for f in sorted(run.glob("wandb/offline-run-*/run-*.wandb")):
        for r in wandb_records(f):
            if r.HasField("run"):
                ids.add(r.run.run_id)
            if r.HasField("history"):
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                if "version" in row:
                    rows.setdefault(int(row["version"]), {}).update(row)
    return ids, rows


def test_live_tracking_versions_reach_both_trackers_before_the_end(tmp_path):
    uri = f"file:{tmp_path / 'mlruns'}"
    t = LiveTracking(spec(tmp_path), tmp_path, "demo", {"roles": {"trainer": {"optimizer": {"lr": 0.001}}}})
    t.start()
    for v in (1, 2, 3):
        t.observe(trainer(v, 0.1 * v))
    t.observe(Metrics(role="evaluator", id="0", ts=time.time(), values={"version": 2.0, "eval/heldout/greedy": 0.5,
                                                                          "eval/heldout/greedy/lo": 0.3}))
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(
        {"source": "trainer", "version": 2, "prompt": f"p{i}", "response": "r", "reward": 1.0, "staleness": 0,
         "prompt_id": f"q{i}"}) + "\n" for i in range(3)))
    assert t.poll_samples() == 3
    # before the end: MLflow's store and the W&B run file already hold every version
    _, hist = until(lambda: (got := mlflow_history(uri, "trainer/reward_mean")) and len(got[1]) == 3 and got, 60,
                    "three versions in MLflow")
    assert hist == [(1, pytest.approx(0.1)), (2, pytest.approx(0.2)), (3, pytest.approx(0.3))]
    ids, rows = until(lambda: (got := wandb_rows(tmp_path)) and {1, 2, 3} <= set(got[1]) and got, 60,
                      "three versions in the W&B run file")
    assert rows[3]["trainer/reward_mean"] == pytest.approx(0.3) and rows[2]["eval/heldout/greedy"] == 0.5
    state = json.loads((tmp_path / "tracking.json").read_text())
    assert state["wandb"]["id"] in ids and state["mlflow"]["tracking_uri"] == uri
    lines = t.finish({"iterations": 3, "eval": {"heldout": {"greedy": {"last": 0.5}}}})
    assert lines[0].startswith("wandb: ") and "dropped" not in " ".join(lines) and "failed" not in " ".join(lines)
    runs, _ = mlflow_history(uri, "trainer/reward_mean")
    assert runs[0].info.status == "FINISHED" and runs[0].data.metrics["summary/eval/heldout/greedy/last"] == 0.5
    assert runs[0].data.params["roles.trainer.optimizer.lr"] == "0.001"


def test_live_tracking_a_resume_continues_the_same_runs(tmp_path):
    uri = f"file:{tmp_path / 'mlruns'}"
    for versions in ((1, 2), (3, 4)):   # a node, then the node of `up --resume` on the same workdir
        t = LiveTracking(spec(tmp_path), tmp_path, "demo", close_timeout_s=120)
        t.start()
        for v in versions:
            t.observe(trainer(v, 0.1 * v))
        lines = t.finish()
        assert all("left behind" not in ln and "failed" not in ln for ln in lines), lines
    runs, hist = mlflow_history(uri, "trainer/reward_mean")
    assert len(runs) == 1 and [s for s, _ in hist] == [1, 2, 3, 4]
    # W&B's service writes a finished run's file a moment after finish() returns
    ids, rows = until(lambda: (got := wandb_rows(tmp_path)) and set(got[1]) == {1, 2, 3, 4} and got, 30,
                      "both W&B run files written")
    assert len(list(tmp_path.glob("wandb/offline-run-*"))) == 2   # W&B offline: one folder per process...
    assert len(ids) == 1                                           # ...of one run (wandb sync merges them)


class Hang:
    """A TCP server that accepts connections and never answers (a tracker that hangs)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.accepted = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)
            self.accepted.set()

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()


def test_live_tracking_a_hanging_tracker_stalls_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "300")
    hang = Hang()
    try:
        t = LiveTracking(spec(tmp_path, f"http://127.0.0.1:{hang.port}", queue_size=4), tmp_path, "demo",
                         queue_size=4, close_timeout_s=1.0)
        t.start()
        assert hang.accepted.wait(60)                # MLflow's sender is inside a request that never returns
        wandb_sender, mlflow_sender = t.senders
        for v in range(1, 41):
            t.observe(trainer(v, 0.01 * v))          # returns at once, every time: a put without waiting
            until(lambda v=v: wandb_sender.sent >= v, 60, f"W&B to take version {v} while MLflow hangs")
        assert mlflow_sender.dropped == 40 - 4 and mlflow_sender.sent == 0   # 4 queued, the rest counted
        assert "mlflow" in t.problems() and "dropped" in t.problems()
        lines = t.close()
        assert lines[0] == "wandb: 40 sent"
        assert lines[1].startswith("mlflow: 0 sent, ") and "left behind (the tracker hangs)" in lines[1], lines
    finally:
        hang.close()


def test_live_tracking_the_end_sends_what_the_bus_dropped(tmp_path):
    """The bus brought version 2 only; metrics.jsonl holds 1..3: the end sends 1 and 3."""
    uri = f"file:{tmp_path / 'mlruns'}"
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "metrics.jsonl").write_text("".join(
        json.dumps({"version": v, "reward_mean": 0.1 * v, "ts": 1.0}) + "\n" for v in (1, 2, 3)))
    t = LiveTracking(TrackingSpec.model_validate({"mlflow": {"tracking_uri": uri, "experiment": "live"}}),
                     tmp_path, "demo")
    t.start()
    t.observe(trainer(2, 0.2))
    t.finish()
    _, hist = mlflow_history(uri, "trainer/reward_mean")
    assert [s for s, _ in hist] == [1, 2, 3]
