"""Dynamic sampling end to end in the trainer (a real TrainerRole and ExperienceBufferRole in one
process, the tiny model): a version is a batch of informative groups; flat groups are dropped and
counted in the version's metrics, and past `max_dropped` the version trains on what comes next."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from laminar.roles.trainer.metrics import read_jsonl  # noqa: E402

from laminar.config import parse_config  # noqa: E402
from laminar.protocol import PutTrajectory  # noqa: E402
from laminar.summary import summarize  # noqa: E402
from laminar.testing.inproc_cluster import InprocCluster  # noqa: E402
from laminar.testing.trainer_task import random_groups  # noqa: E402
from tests.support import wandb_records  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def groups_with(rewards: list[list[float]], tag: str) -> list:
    gs = random_groups(len(rewards), len(rewards[0]), tag, seed=len(tag))
    return [[replace(t, reward=r) for t, r in zip(g, rs, strict=True)] for g, rs in zip(gs, rewards, strict=True)]


async def until(pred, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise TimeoutError(what)
        await asyncio.sleep(0.01)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny) -> Path:
    """A run of three versions (its workdir), the scenario below."""
    tmp_path = tmp_path_factory.mktemp("ds")
    cfg = parse_config({
        "run": {"workdir": str(tmp_path / "run"), "seed": 0},
        "cluster": {"keys_dir": None, "heartbeat_s": 0.5, "broker": {"host": "h0"},
                    "hosts": {"h0": {"address": "127.0.0.1", "roles": [
                        {"role": "experience_buffer", "port": 7131}, {"role": "trainer"}]}}},
        "roles": {"trainer": {"model_dir": str(tiny), "optimizer": {"lr": 1e-3}, "groups_per_batch": 2,
                              "publishing": {"enabled": False}, "checkpoint": {"every": 100},
                              "performance": {"sample_wait_s": 0.02},
                              "logging": {"samples_every": 2, "samples": 3},
                              "loss": {"filter_groups": {"metric": "reward", "max_dropped": 2}}}}})

    async def go():
        cl = InprocCluster(cfg)
        try:
            await cl.start("experience_buffer")
            trainer = await cl.start("trainer")
            buf = cl.client("experience_buffer")

            async def put(groups):
                for g in groups:
                    for t in g:
                        assert (await buf.call(PutTrajectory(t))).status == "stored"
            # version 1: a flat group and an informative one -> the trainer waits for a second one
            await put(groups_with([[0.0] * 4, [1.0, 0.0, 0.0, 1.0]], "a"))
            await asyncio.sleep(0.3)
            assert trainer.version == 0  # one informative group is not a batch
            await put(groups_with([[0.0, 1.0, 0.0, 0.0]], "b"))
            await until(lambda: trainer.version == 1, 60, "version 1")
            # version 2: the cap (2 drops) is spent on two flat groups; the third flat one is trained on
            await put(groups_with([[0.0] * 4, [1.0] * 4, [0.0] * 4, [1.0, 1.0, 0.0, 1.0]], "c"))
            await until(lambda: trainer.version == 2, 60, "version 2")
            # version 3: flat groups only, the cap reached at once: a version without a step
            await put(groups_with([[0.0] * 4, [1.0] * 4, [0.0] * 4, [1.0] * 4], "d"))
            await until(lambda: trainer.version == 3, 60, "version 3")
        finally:
            await cl.close()
    asyncio.run(go())
    return tmp_path / "run"


def test_filter_groups_trainer_waits_for_informative_groups_and_counts_them(trained: Path):
    recs = read_jsonl(trained / "trainer" / "metrics.jsonl")
    got = [(r["groups_generated"], r["groups_kept"], r["groups_dropped_nosignal"], r["filter_cap_reached"],
            r["no_signal_steps"]) for r in recs]
    assert got == [(3.0, 2.0, 1.0, 0.0, 0.0), (4.0, 1.0, 2.0, 1.0, 0.0), (4.0, 0.0, 2.0, 1.0, 1.0)]
    assert recs[0]["nosignal_tokens"] == 4 * 8
    s = summarize(trained)
    assert (s["groups_generated"], s["groups_kept"], s["versions_without_step"]) == (11, 3, 1)
    assert s["groups_dropped_nosignal"] == 5 and s["filter_cap_versions"] == 2
    # samples: version 2's batch (every 2 versions; made by version 0, trained by 1), groups in turn
    rows = [json.loads(x) for x in (trained / "samples.jsonl").read_text().splitlines()]
    assert [(r["source"], r["version"], r["staleness"]) for r in rows] == [("trainer", 2, 1)] * 3
    assert [r["prompt_id"] for r in rows] == [rows[0]["prompt_id"], rows[1]["prompt_id"], rows[0]["prompt_id"]]
    assert all(isinstance(r["prompt"], str) and isinstance(r["response"], str) for r in rows)


@pytest.mark.slow  # wandb's and mlflow's imports and W&B's core process: ~15 s more on 2 cores
def test_tracking_wandb_offline_and_mlflow_file_store_read_back(trained: Path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from laminar.summary import write
    from laminar.tracking import send
    from laminar.tracking_spec import TrackingSpec
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    s = write(trained)
    uri = f"file:{trained / 'mlruns'}"
    got = send(trained, TrackingSpec.model_validate({"wandb": {"project": "t"}, "mlflow": {"tracking_uri": uri}}),
               "ds", {"roles": {"trainer": {"optimizer": {"lr": 1e-3}}}})
    assert got[0].startswith("wandb: ") and got[1].startswith(f"mlflow: {uri}")
    # W&B: one history row per version, the summary's numbers, the samples table
    (run_file,) = (trained / "wandb").glob("offline-run-*/run-*.wandb")
    recs = wandb_records(run_file)
    by_step: dict = {}
    for r in recs:
        if r.HasField("history"):
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            step = r.history.step.num if r.history.HasField("step") else row.get("_step")
            by_step.setdefault(step, {}).update(row)
    assert [by_step[v]["trainer/groups_generated"] for v in (1, 2, 3)] == [3, 4, 4]
    assert by_step[3]["samples/_type"] == "table-file" and by_step[3]["samples/nrows"] == 3
    summary = {i.key: json.loads(i.value_json) for r in recs if r.HasField("summary") for i in r.summary.update}
    assert summary["groups_kept"] == s["groups_kept"] == 3 and summary["versions_without_step"] == 1
    # MLflow: the metric history by version, the summary, the table artifact
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("ds").experiment_id])
    hist = client.get_metric_history(run.info.run_id, "trainer/groups_kept")
    assert sorted((m.step, m.value) for m in hist) == [(1, 2.0), (2, 1.0), (3, 0.0)]
    assert run.data.metrics["summary/groups_generated"] == 11
    assert run.data.params["roles.trainer.optimizer.lr"] == "0.001"
    table = json.loads(Path(client.download_artifacts(run.info.run_id, "samples.json", str(trained))).read_text())
    assert table["columns"][:3] == ["source", "version", "prompt"] and len(table["data"]) == 3
