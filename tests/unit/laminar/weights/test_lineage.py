"""Weight lineage: a version is named by (run, lineage epoch, number), and a new lineage replaces
what relays and rollouts hold at once, even under a lower version number (a trainer resumed from
an older checkpoint). Real relay nodes on loopback TCP, real shared-memory folders.
"""
from __future__ import annotations

import shutil
import uuid

import pytest

torch = pytest.importorskip("torch")

from laminar.weights import wire  # noqa: E402
from laminar.weights.node import RelayNode  # noqa: E402
from laminar.weights.publisher import WeightPublisher  # noqa: E402
from laminar.weights.pull import LocalWeights  # noqa: E402
from laminar.weights.transport import get_transport  # noqa: E402

KEY = wire.derive_key(b"l" * 32)


@pytest.fixture
def chain():
    started: list[RelayNode] = []

    def make(n: int) -> list[RelayNode]:
        for i in range(n):
            node = RelayNode(f"n{i}", f"/dev/shm/laminar-unit-{uuid.uuid4().hex[:10]}", get_transport("tcp"), KEY)
            node.start()
            started.append(node)
        for a, b in zip(started, started[1:], strict=False):
            a.set_downstream(b.address, b.id)
        return started
    yield make
    for node in started:
        node.stop()
        shutil.rmtree(node.store.dir, ignore_errors=True)


def weights(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300_000, generator=g), "b": torch.randn(7, generator=g)}


def ident(node: RelayNode):
    with node.store.cond:
        cur = node.store.current
        return None if cur is None else (cur.manifest.run_id, cur.manifest.lineage, cur.version)


def wait_for(node: RelayNode, want, timeout: float = 20.0) -> None:
    with node.store.cond:
        node.store.cond.wait_for(lambda: node.store.current is not None and
                                 (node.store.current.manifest.run_id, node.store.current.manifest.lineage,
                                  node.store.current.version) == want, timeout)
    assert ident(node) == want, f"{node.id} holds {ident(node)}, expected {want}"


def publish(nodes, lineage: int, version: int, sd: dict) -> None:
    pub = WeightPublisher(chunk_bytes=256 << 10, key=KEY)
    pub.run_id, pub.lineage = "run-a", lineage
    try:
        pub.set_target(nodes[0].address, nodes[0].id)
        pub.publish(sd, version=version)
        assert pub.wait_delivered(version, 20)
        for node in nodes:
            wait_for(node, ("run-a", lineage, version))
    finally:
        pub.close()


def test_new_lineage_replaces_a_higher_version_on_every_relay_and_pull(chain):
    nodes = chain(3)
    a5, b3 = weights(5), weights(103)
    publish(nodes, lineage=1, version=5, sd=a5)      # lineage A holds version 5
    publish(nodes, lineage=2, version=3, sd=b3)      # a resumed trainer: lineage B, version 3
    for node in nodes:
        assert ident(node) == ("run-a", 2, 3)
        with LocalWeights(node.store.dir).latest() as pulled:
            assert (pulled.manifest.lineage, pulled.version) == (2, 3) and pulled.verify() == []
            got = pulled.state_dict()
            assert all(torch.equal(got[k], b3[k]) for k in b3), node.id
            del got


def test_an_older_lineage_is_not_taken_back(chain):
    nodes = chain(2)
    publish(nodes, lineage=3, version=1, sd=weights(1))
    pub = WeightPublisher(chunk_bytes=256 << 10, key=KEY)
    pub.run_id, pub.lineage = "run-a", 2                   # a stale trainer of an older lineage
    try:
        pub.set_target(nodes[0].address, nodes[0].id)
        pub.publish(weights(9), version=9)
        assert not pub.wait_delivered(9, 3)                 # refused, never 'have it' ...
        assert "lineage 3" in pub.refused and "lineage 2" in pub.refused
    finally:
        pub.close()
    assert [ident(n) for n in nodes] == [("run-a", 3, 1)] * 2   # ... and never taken


def test_a_folder_left_by_another_run_is_not_served(chain):
    (old,) = chain(1)
    pub = WeightPublisher(chunk_bytes=256 << 10, key=KEY)
    pub.run_id, pub.lineage = "run-old", 4
    try:
        pub.set_target(old.address, old.id)
        pub.publish(weights(60), version=60)
        assert pub.wait_delivered(60, 20)
    finally:
        pub.close()
    old.stop()                                   # killed: its folder stays behind with v60
    assert LocalWeights(old.store.dir).current_version() == 60
    new = RelayNode("n-new", str(old.store.dir), get_transport("tcp"), KEY)
    new.start()
    try:
        assert LocalWeights(new.store.dir).latest() is None      # a rollout finds nothing to load
        assert new.status()["version"] == -1
        fresh = weights(0)
        pub = WeightPublisher(chunk_bytes=256 << 10, key=KEY)
        pub.run_id, pub.lineage = "run-new", 1
        try:
            pub.set_target(new.address, new.id)
            pub.publish(fresh, version=0)                        # a new run's version 0 ...
            assert pub.wait_delivered(0, 20)
        finally:
            pub.close()
        wait_for(new, ("run-new", 1, 0))                         # ... is what the relay serves
        with LocalWeights(new.store.dir).latest() as pulled:
            got = pulled.state_dict()
            assert all(torch.equal(got[k], fresh[k]) for k in fresh)
            del got
    finally:
        new.stop()


def test_a_restarted_relay_serves_its_left_version_again_once_its_lineage_is_offered(chain):
    (old,) = chain(1)
    sd = weights(7)
    publish([old], lineage=2, version=7, sd=sd)
    old.stop()
    again = RelayNode("n-again", str(old.store.dir), get_transport("tcp"), KEY)
    again.start()
    try:
        assert LocalWeights(again.store.dir).latest() is None
        publish([again], lineage=2, version=7, sd=sd)            # its predecessor offers the same version
        assert again.receiver.stats["chunks"] == 0                # answered 'have it all': nothing re-sent
        assert LocalWeights(again.store.dir).current_version() == 7
    finally:
        again.stop()


def test_epochs_advance_across_restarts_and_name_which_old_versions_stay_valid(tmp_path):
    from laminar.weights.lineage import advance_lineage, read_lineage
    from laminar.weights.manifest import off_lineage
    run, e1 = advance_lineage(tmp_path, start_version=0)      # a new run
    run2, e2 = advance_lineage(tmp_path, start_version=4)     # resumed from the v4 checkpoint
    run3, e3 = advance_lineage(tmp_path, start_version=2)     # killed again before v6; resumed from v2
    assert (e1, e2, e3) == (1, 2, 3) and run == run2 == run3
    forks = read_lineage(tmp_path)["forks"]
    assert forks == {"1": 0, "2": 4, "3": 2}
    assert not off_lineage(1, 2, 3, forks)       # v2 of lineage 1 is an ancestor of lineage 3
    assert off_lineage(1, 3, 3, forks)           # v3 of lineage 1 was discarded (lineage 3 forked at v2)
    assert off_lineage(2, 4, 3, forks)          # even the v4 lineage 2 started from: lineage 3 forked below it
    assert not off_lineage(3, 9, 3, forks) and off_lineage(4, 0, 3, forks)
