"""The best version is kept as a resumable checkpoint (keep_best_checkpoint): the trainer follows
the evaluator's results and copies the checkpoint of the best-scoring version to best/, where
rotation of checkpoints/ never reaches it, and a trainer resumes from it (model, optimizer, cursor)."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from laminar.roles.trainer import checkpoint  # noqa: E402
from laminar.roles.trainer.best import BestCheckpoint  # noqa: E402

from laminar.config import parse_config  # noqa: E402
from laminar.protocol import Metrics, PutTrajectory  # noqa: E402
from laminar.testing.inproc_cluster import InprocCluster  # noqa: E402
from laminar.testing.procs import free_port  # noqa: E402
from laminar.testing.trainer_task import random_groups  # noqa: E402

pytestmark = pytest.mark.timeout(180)
METRIC = "heldout/greedy"


def save(root, version: int, keep: int = 1):
    parts = {"model": {"w": torch.full((2,), float(version))}, "optimizer": {"state": {}, "param_groups": []}}
    return checkpoint.save(root, version, parts, {"cursor": 10 * version}, keep=keep)


def test_best_checkpoint_keeps_the_best_evaluated_version_out_of_rotation(tmp_path):
    root = tmp_path / "checkpoints"
    keeper = BestCheckpoint(tmp_path, root, METRIC, checkpoint_every=1)
    save(root, 1)
    assert keeper.heard({"version": 1.0, f"eval/{METRIC}": 0.3}) == "kept"
    save(root, 2)   # keep=1: v1 rotated away
    assert keeper.heard({"version": 2.0, f"eval/{METRIC}": 0.2}) == "not_better"
    assert keeper.heard({"version": 3.0, f"eval/{METRIC}": 0.9}) == "pending"   # evaluated before its checkpoint
    save(root, 3)
    assert keeper.saved(3) == "kept"
    save(root, 4)
    assert [p.name for p in checkpoint.complete(root)] == ["v00000004"]
    best = tmp_path / "best"
    assert json.loads((best / "best.json").read_text())["version"] == 3
    assert [p.name for p in checkpoint.complete(best)] == ["v00000003"]  # the superseded v1 is gone
    parts, state = checkpoint.load(checkpoint.latest(best))  # resumable: a trainer's latest() finds it
    assert state["version"] == 3 and state["cursor"] == 30 and set(parts) == {"model", "optimizer"}
    assert torch.equal(parts["model"]["w"], torch.full((2,), 3.0))
    again = BestCheckpoint(tmp_path, root, METRIC, checkpoint_every=1)   # a restarted trainer remembers
    assert again.heard({"version": 4.0, f"eval/{METRIC}": 0.5}) == "not_better"


def test_best_checkpoint_skips_a_best_version_without_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    keeper = BestCheckpoint(tmp_path, root, METRIC, checkpoint_every=2)
    save(root, 2)
    assert keeper.heard({"version": 3.0, f"eval/{METRIC}": 0.7}) == "no_checkpoint"
    assert keeper.heard({"version": 2.0, f"eval/{METRIC}": 0.5}) == "kept"
    assert keeper.heard({"version": 2.0}) == "no_metric"


def test_best_checkpoint_trainer_follows_the_evaluator(tmp_path, tiny):
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text('{"prompt": "1+1?", "answer": "2"}\n')
    cfg = parse_config({
        "run": {"workdir": str(tmp_path / "run"), "seed": 0},
        "cluster": {"keys_dir": None, "heartbeat_s": 0.5, "broker": {"host": "h0"},
                    "hosts": {"h0": {"address": "127.0.0.1", "roles": [
                        {"role": "experience_buffer", "port": free_port()}, {"role": "trainer"},
                        {"role": "evaluator"}]}}},
        "roles": {"trainer": {"model_dir": str(tiny), "optimizer": {"lr": 1e-3}, "groups_per_batch": 2,
                              "publishing": {"enabled": False},
                              "checkpoint": {"every": 1, "keep": 1, "keep_best": True}},
                  "evaluator": {"dataset": str(heldout), "best_metric": METRIC}}})

    async def go():
        cluster = InprocCluster(cfg)
        try:
            await cluster.start("experience_buffer")
            trainer = await cluster.start("trainer")
            buf, pub = cluster.client("experience_buffer"), cluster.hub.transport().publisher()

            async def until(name, version):
                end = time.monotonic() + 60
                while not any(n == name and f.get("version") == version for n, f in trainer.events):
                    assert time.monotonic() < end, trainer.events[-5:]
                    await asyncio.sleep(0.02)

            for it, score in enumerate([0.4, 0.1, 0.2]):
                for g in random_groups(2, 4, f"it{it}", seed=it):
                    for t in g:
                        assert (await buf.call(PutTrajectory(t))).status == "stored"
                await until("checkpoint_saved", it + 1)
                pub.publish("metrics.evaluator", Metrics(role="evaluator", id="0", ts=time.time(),
                                                         values={"version": float(it + 1), f"eval/{METRIC}": score}))
                if it == 0:
                    await until("best_checkpoint_kept", 1)
            return trainer
        finally:
            await cluster.close()
    asyncio.run(go())
    best = tmp_path / "run" / "trainer" / "best"
    assert json.loads((best / "best.json").read_text())["version"] == 1
    _, state = checkpoint.load(checkpoint.latest(best))
    assert state["version"] == 1
    assert [p.name for p in checkpoint.complete(tmp_path / "run" / "trainer" / "checkpoints")] == ["v00000003"]
