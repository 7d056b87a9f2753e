"""A lineage that goes down is refused loudly, and a trainer's lineage only goes up.

A trainer restored from an older copy of its checkpoint folder used to start a *lower* lineage
than the relays held: every relay answered "have it", the publisher counted each version
delivered, the buffer dropped everything the rollouts made (their weights were of the higher,
discarded lineage) and training went on, silently learning nothing. Now the relay refuses the
older lineage and says so, naming both; the publisher does not count it delivered and reports
the refusal; and the epoch is also kept outside the checkpoint folder, so restoring the folder
cannot take it back. Real relay nodes on loopback TCP.
"""
from __future__ import annotations

import shutil
import uuid

import pytest

torch = pytest.importorskip("torch")

from laminar.weights import wire  # noqa: E402
from laminar.weights.lineage import advance_lineage, read_lineage  # noqa: E402
from laminar.weights.node import RelayNode  # noqa: E402
from laminar.weights.publisher import WeightPublisher  # noqa: E402
from laminar.weights.transport import get_transport  # noqa: E402

pytestmark = pytest.mark.timeout(60)
KEY = wire.derive_key(b"d" * 32)


@pytest.fixture
def node():
    n = RelayNode("r", f"/dev/shm/laminar-test-down-{uuid.uuid4().hex[:8]}", get_transport("tcp"), KEY)
    n.start()
    yield n
    n.stop()
    shutil.rmtree(n.store.dir, ignore_errors=True)


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(20_000, generator=g), "b": torch.randn(7, generator=g)}


def publisher(node: RelayNode, lineage: int) -> WeightPublisher:
    pub = WeightPublisher(chunk_bytes=16 << 10, key=KEY)
    pub.run_id, pub.lineage = "run", lineage
    pub.set_target(node.address, node.id)
    return pub


def test_an_older_lineage_is_refused_by_name_and_never_counted_delivered(node):
    newer = publisher(node, lineage=5)
    try:
        newer.publish(state(0), 3)
        assert newer.wait_delivered(3, 20)
    finally:
        newer.close()
    older = publisher(node, lineage=4)  # a trainer restored from an older checkpoint folder
    try:
        older.publish(state(1), 7)
        assert not older.wait_delivered(7, 3.0), "a lower lineage was counted delivered"
        why = older.refused
        assert "lineage 4" in why and "lineage 5" in why, why
        with node.store.cond:
            assert node.store.current.manifest.lineage == 5 and node.store.current.version == 3
        assert node.status()["lineage_refused"] >= 1
    finally:
        older.close()


def test_restoring_an_older_checkpoint_folder_does_not_take_the_lineage_back(tmp_path):
    ckpt = tmp_path / "checkpoints"
    run, e1 = advance_lineage(ckpt, 0)
    backup = tmp_path / "backup"
    shutil.copytree(ckpt, backup)              # an operator keeps a copy of the folder at epoch 1
    _, e2 = advance_lineage(ckpt, 4)
    _, e3 = advance_lineage(ckpt, 8)
    shutil.rmtree(ckpt)
    shutil.copytree(backup, ckpt)              # ... and restores it later
    run4, e4 = advance_lineage(ckpt, 4)
    assert (e1, e2, e3) == (1, 2, 3) and run4 == run
    assert e4 == 4, f"the lineage went down to {e4} after a restore"
    forks = read_lineage(ckpt)["forks"]
    assert forks == {"1": 0, "2": 4, "3": 8, "4": 4}


def test_a_refused_trainer_fails_loudly_and_restarts_above_the_relays_lineage(tmp_path, node):
    """The trainer's side of a refusal (roles/trainer/publishing.py): the relay's lineage is
    recorded with the checkpoints, the trainer fails with both lineages named, and its next start
    takes an epoch above the relay's."""
    import asyncio
    import types

    from laminar.roles.trainer.publishing import PublishLink
    ckpt = tmp_path / "checkpoints"
    run, epoch = advance_lineage(ckpt, 0)
    newer = publisher(node, lineage=epoch + 5)
    newer.run_id = run
    try:
        newer.publish(state(0), 1)
        assert newer.wait_delivered(1, 20)
    finally:
        newer.close()
    events = []
    role = types.SimpleNamespace(ckpt_root=ckpt, event=lambda name, **kw: events.append(name))
    link = PublishLink(role, types.SimpleNamespace())

    async def go():
        link._refusal = asyncio.get_running_loop().create_future()
        link.publisher = WeightPublisher(chunk_bytes=16 << 10, key=KEY,
                                         on_refused=lambda why: loop.call_soon_threadsafe(link._refused, why))
        link.publisher.run_id, link.publisher.lineage = run, epoch
        loop = asyncio.get_running_loop()
        link.publisher.set_target(node.address, node.id)
        link.publisher.publish(state(1), 2)
        try:
            with pytest.raises(RuntimeError, match=f"lineage {epoch + 5}") as err:
                await asyncio.wait_for(link._fail_on_refusal(), 20)
        finally:
            link.publisher.close()
        return str(err.value)
    why = asyncio.run(go())
    assert f"lineage {epoch}" in why and events == ["weights_lineage_refused"]
    assert advance_lineage(ckpt, 1)[1] == epoch + 6  # the restart is above the relay's lineage
