"""The trainer writes its final version as a Hugging Face folder when `export_dir` is set: at
max_iterations, the folder holds exactly the trainer's final weights (transformers loads it),
laminar_version.json names that version, and an `exported` event is logged; a run that has not
reached max_iterations writes nothing."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from laminar.config import parse_config  # noqa: E402
from laminar.protocol import PutTrajectory  # noqa: E402
from laminar.testing.inproc_cluster import InprocCluster  # noqa: E402
from laminar.testing.procs import free_port  # noqa: E402
from laminar.testing.trainer_task import random_groups  # noqa: E402

pytestmark = pytest.mark.timeout(180)


async def run_trainer(tmp, tiny, iterations_fed: int, max_iterations: int):
    cfg = parse_config({
        "run": {"workdir": str(tmp / "run"), "seed": 0},
        "cluster": {"keys_dir": None, "heartbeat_s": 0.5, "broker": {"host": "h0"},
                    "hosts": {"h0": {"address": "127.0.0.1", "roles": [
                        {"role": "experience_buffer", "port": free_port()}, {"role": "trainer"}]}}},
        "roles": {"trainer": {"model_dir": str(tiny), "optimizer": {"lr": 1e-3}, "groups_per_batch": 2,
                              "publishing": {"enabled": False},
                              "checkpoint": {"every": 100, "export_dir": str(tmp / "export")},
                              "max_iterations": max_iterations}}})
    cluster = InprocCluster(cfg)
    try:
        await cluster.start("experience_buffer")
        trainer = await cluster.start("trainer")
        buf = cluster.client("experience_buffer")
        for it in range(iterations_fed):
            for g in random_groups(2, 4, f"it{it}", seed=it):
                for t in g:
                    assert (await buf.call(PutTrajectory(t))).status == "stored"
        end = time.monotonic() + 60
        target = "exported" if iterations_fed >= max_iterations else "iteration"
        while not any(name == target and f["version"] == iterations_fed for name, f in trainer.events):
            assert time.monotonic() < end, trainer.events[-5:]
            await asyncio.sleep(0.02)
        return trainer, {k: v.detach().clone() for k, v in trainer.engine.models.model.state_dict().items()}
    finally:
        await cluster.close()


def test_final_version_is_exported_as_a_hugging_face_folder(tmp_path, tiny):
    import transformers
    trainer, final = asyncio.run(run_trainer(tmp_path, tiny, iterations_fed=2, max_iterations=2))
    out = tmp_path / "export"
    (event,) = [f for name, f in trainer.events if name == "exported"]
    assert event == {"version": 2, "path": str(out)}
    assert json.loads((out / "laminar_version.json").read_text())["version"] == 2
    model = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    got = model.state_dict()
    assert got.keys() == final.keys()
    assert all(torch.equal(got[k], final[k]) for k in final)  # the folder is the trainer's final weights
    start = transformers.AutoModelForCausalLM.from_pretrained(tiny, local_files_only=True).state_dict()
    assert any(not torch.equal(start[k], final[k]) for k in final)  # ... which training changed


def test_nothing_is_exported_before_max_iterations(tmp_path, tiny):
    trainer, _ = asyncio.run(run_trainer(tmp_path, tiny, iterations_fed=1, max_iterations=3))
    assert not (tmp_path / "export").exists()
    assert not [f for name, f in trainer.events if name == "exported"]
