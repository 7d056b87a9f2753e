"""A relay cannot make the trainer fail by saying so: a refusal for a newer lineage must prove it.

Before: the master answered an OFFER with WANT REFUSED and a payload naming any lineage; the
trainer's publisher believed it, the trainer recorded that lineage beside its checkpoints and
failed, and each restart (on a lineage above the claimed one) met the same answer: a crash loop
driven by whoever runs the master relay, with the lineage inflated for good.

Now the refusal carries the held version's manifest and seals, and a publisher holding the
trainer's key checks that the trainer did seal that newer lineage of this run; a claim without
such proof is logged (`refusal_unproven`) and counted, never reported to the trainer. A real
relay that does hold a newer lineage still stops the trainer, as before.
"""
from __future__ import annotations

import shutil
import threading
import uuid

import msgpack
import pytest

torch = pytest.importorskip("torch")

from laminar.weights import handshake, seal, wire  # noqa: E402
from laminar.weights.node import RelayNode  # noqa: E402
from laminar.weights.publisher import WeightPublisher  # noqa: E402
from laminar.weights.transport import LinkError, get_transport  # noqa: E402

pytestmark = pytest.mark.timeout(60)
KEY = wire.derive_key(b"q" * 32)
SIGNER = seal.Signer(bytes(range(11, 43)))


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(5_000, generator=g)}


class HostileMaster:
    """Holds the cluster secret, accepts the trainer's link, answers every OFFER with REFUSED."""

    def __init__(self, payload: bytes):
        self.listener = get_transport("tcp").listen("127.0.0.1", 0)
        self.payload, self.refusals = payload, 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn = None
        while conn is None:
            conn = self.listener.accept(timeout=0.5)
        _, ch = handshake.server_handshake(conn, KEY, 5.0)
        try:
            while True:
                h = ch.recv()
                if h.type == wire.OFFER:
                    ch.send(wire.WANT, h.version, a=wire.REFUSED, b=h.b, payload=self.payload)
                    self.refusals += 1
        except LinkError:
            ch.close()

    def close(self) -> None:
        self.listener.close()


def test_refusal_a_forged_newer_lineage_does_not_reach_the_trainer():
    forged = msgpack.packb({"run_id": "run", "lineage": 10 ** 9, "version": 1})
    evil = HostileMaster(forged)
    told: list[str] = []
    pub = WeightPublisher(chunk_bytes=4096, key=KEY, signer=SIGNER, on_refused=told.append)
    pub.run_id, pub.lineage = "run", 2
    try:
        pub.set_target(evil.listener.address, "master")
        pub.publish(state(1), 1)
        assert not pub.wait_delivered(1, 3.0)
        assert evil.refusals >= 1
        assert told == [] and pub.refused == "", told  # the trainer is not made to fail, nothing is recorded
        assert pub._sender is not None and pub._sender.stats["refused_unproven"] >= 1
    finally:
        pub.close()
        evil.close()


def test_refusal_a_relay_that_really_holds_a_newer_lineage_still_stops_the_trainer():
    node = RelayNode("m", f"/dev/shm/laminar-test-proof-{uuid.uuid4().hex[:8]}", get_transport("tcp"), KEY,
                     verifier=SIGNER.public)
    node.start()
    try:
        newer = WeightPublisher(chunk_bytes=4096, key=KEY, signer=SIGNER)
        newer.run_id, newer.lineage = "run", 5
        newer.set_target(node.address, node.id)
        newer.publish(state(2), 3)
        assert newer.wait_delivered(3, 20)
        newer.close()
        told: list[str] = []
        older = WeightPublisher(chunk_bytes=4096, key=KEY, signer=SIGNER, on_refused=told.append)
        older.run_id, older.lineage = "run", 4
        try:
            older.set_target(node.address, node.id)
            older.publish(state(3), 9)
            assert not older.wait_delivered(9, 3.0)
            assert len(told) == 1 and "lineage 5" in told[0] and "lineage 4" in told[0], told
        finally:
            older.close()
    finally:
        node.stop()
        shutil.rmtree(node.store.dir, ignore_errors=True)
