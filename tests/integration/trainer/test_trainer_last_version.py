"""A trainer that reaches max_iterations leaves only once its last version reached the master relay
(bounded by final_delivery_s): the publisher's sender runs in the background, and a trainer that
exited right after its last step dropped that version, so rollouts and the evaluator never got
the final weights (an evaluator waited for them in a real cluster). Here the relay comes up only
after the last step: the trainer, whose pinned master relay (relay_address, no manager) refused
its first connection, tries it again (it used to wait for a set_target nothing would send),
delivers the last version, and exits 0."""
from __future__ import annotations

import asyncio
import shutil
import time
import uuid

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from laminar.bus.auth import load_keys  # noqa: E402

from laminar.models.tiny import build_tiny_model  # noqa: E402
from laminar.testing.procs import free_port  # noqa: E402
from laminar.testing.trainer_task import random_groups  # noqa: E402
from laminar.weights.node import RelayNode  # noqa: E402
from laminar.weights.transport.tcp import TcpTransport  # noqa: E402
from laminar.weights.wire import derive_key  # noqa: E402
from tests.integration.trainer.test_trainer import feed, proc_cluster, start_buffer_and_trainer, wait_events  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def test_the_last_version_reaches_the_relay_before_the_trainer_exits(tmp_path):
    model = build_tiny_model(tmp_path / "tiny", seed=0)
    port = free_port()
    path = proc_cluster(tmp_path, model, max_iterations=2,
                        publishing={"enabled": True, "relay_address": f"127.0.0.1:{port}", "relay_id": "r0"})
    shm = f"/dev/shm/laminar-test-{uuid.uuid4().hex[:8]}-last"
    procs, node = [], None
    try:
        trainer = start_buffer_and_trainer(path, tmp_path, procs)
        asyncio.run(feed(path, tmp_path / "keys", random_groups(4, 4, "s", seed=5)))
        wait_events(trainer, "iteration", lambda evs: any(e.get("version") == 2 for e in evs), 120)
        time.sleep(1.0)  # the last step is done and the relay is still down
        node = RelayNode("r0", shm, TcpTransport(), derive_key(load_keys(tmp_path / "keys").secret), port=port)
        node.start()
        end = time.monotonic() + 60
        while trainer.alive() and time.monotonic() < end:
            time.sleep(0.1)
        assert not trainer.alive(), trainer.tail()
        assert trainer.proc.returncode == 0, trainer.tail()
        assert node.store.current is not None and node.store.current.version == 2, trainer.tail()
        done = trainer.events("final_version_delivered")
        assert done and done[-1]["version"] == 2, trainer.tail()
    finally:
        for p in reversed(procs):
            p.stop()
        if node is not None:
            node.stop()
        shutil.rmtree(shm, ignore_errors=True)
