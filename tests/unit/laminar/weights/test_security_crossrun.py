"""A run is an identity, not a label: weights sealed for another run of the same model roll nothing
back. The weights signing key is made once per key folder, so every run of a cluster seals with
the same key, and a relay folder recorded from an earlier run is a pile of genuinely sealed
versions. Before, `supersedes()` took another run's version at once: any host with the cluster
secret (or a relay upstream in the chain) replayed such a version into a non-master relay, which
verified its seal and made it visible; seal-checking rollouts loaded it, and the buffer trained on
what they generated (it labels samples by lineage and version only).

Now relays and rollouts are pinned: to the run the trainer announces (its heartbeat names it), and
before any announcement to the run they hold. An offer of another run waits a moment for the
trainer to announce it (a real new run is announced within a heartbeat) and is refused otherwise;
trajectories carry their run, and the buffer drops another run's samples like off-lineage ones.
Real relay nodes on loopback TCP and real shared-memory folders.
"""
from __future__ import annotations

import asyncio
import shutil
import threading
import time
import uuid

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import structlog  # noqa: E402
from laminar.roles.experience_buffer.state import BufferBook  # noqa: E402
from laminar.roles.rollout.weights import WeightFollower  # noqa: E402
from laminar.roles.rollout.work import Work  # noqa: E402

from laminar.protocol import Trajectory, TrajectorySpec  # noqa: E402
from laminar.weights import seal, wire  # noqa: E402
from laminar.weights.node import RelayNode  # noqa: E402
from laminar.weights.publisher import WeightPublisher  # noqa: E402
from laminar.weights.pull import LocalWeights  # noqa: E402
from laminar.weights.transport import get_transport  # noqa: E402

pytestmark = pytest.mark.timeout(90)
KEY = wire.derive_key(b"x" * 32)         # the cluster secret's data-plane key: every host has it
SIGNER = seal.Signer(bytes(range(7, 39)))  # one weights key per key folder: every run seals with it
CHUNK = 8 << 10


def weights(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(20_000, generator=g), "b": torch.randn(9, generator=g)}


@pytest.fixture
def nodes():
    made: list[RelayNode] = []

    def make(name: str, checked: bool = True, **kw) -> RelayNode:
        events: list[tuple[str, dict]] = []
        n = RelayNode(name, f"/dev/shm/laminar-test-xrun-{uuid.uuid4().hex[:8]}", get_transport("tcp"), KEY,
                      verifier=SIGNER.public if checked else None,
                      on_event=lambda kind, **info: events.append((kind, info)), **kw)
        n.events = events
        n.start()
        made.append(n)
        return n
    yield make
    for n in made:
        n.stop()
        shutil.rmtree(n.store.dir, ignore_errors=True)


def trainer_publish(node: RelayNode, run: str, lineage: int, version: int, sd: dict) -> None:
    """The trainer of `run` publishes `sd` as `version` to `node` (its master)."""
    pub = WeightPublisher(chunk_bytes=CHUNK, key=KEY, signer=SIGNER)
    pub.run_id, pub.lineage = run, lineage
    try:
        pub.set_target(node.address, node.id)
        pub.publish(sd, version)
        assert pub.wait_delivered(version, 20), node.status()
    finally:
        pub.close()


def ident(node: RelayNode):
    with node.store.cond:
        cur = node.store.current
        return None if cur is None else (cur.manifest.run_id, cur.manifest.lineage, cur.version)


def wait_ident(node: RelayNode, want, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while ident(node) != want and time.monotonic() < deadline:
        time.sleep(0.02)  # polling a relay's state from outside its threads
    assert ident(node) == want, node.status()


def wait_event(node: RelayNode, kinds: set[str], timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for kind, _ in list(node.events):
            if kind in kinds:
                return kind
        time.sleep(0.02)
    raise AssertionError(f"{node.id}: none of {kinds} within {timeout}s: {node.events}")


def test_crossrun_a_recorded_version_of_an_earlier_run_replayed_through_a_link_is_refused(nodes):
    # An earlier run of the same model: a host kept a relay folder of it (its own relay, which checks nothing).
    recorder = nodes("recorder", checked=False)
    old = weights(40)
    trainer_publish(recorder, "run-old", 3, 40, old)
    # The run going on now: master -> victim, both checking seals.
    master, victim = nodes("master"), nodes("victim")
    victim.gate.run_wait_s = 0.5  # how long an offer of another run waits for the trainer to announce it
    master.set_downstream(victim.address, victim.id)
    new = weights(2)
    trainer_publish(master, "run-new", 1, 2, new)
    wait_ident(victim, ("run-new", 1, 2))
    # The replay: the recorder links into the victim (any cluster-secret host could, before links
    # were bound to the manager's chain; an upstream in the chain still can) and offers run-old:3:40,
    # sealed by the very key the victim checks.
    recorder.set_downstream(victim.address, victim.id)
    outcome = wait_event(recorder, {"delivered", "refused_downstream"})
    assert outcome == "refused_downstream", "the victim took another run's version"
    assert ident(victim) == ("run-new", 1, 2)
    assert victim.status()["runs_refused"] >= 1
    with LocalWeights(victim.store.dir, verify_key=SIGNER.public.raw).latest() as pulled:
        assert torch.equal(pulled.state_dict()["w"], new["w"])  # a rollout loads the run's own weights


def test_crossrun_a_new_run_is_taken_once_the_trainer_announces_it(nodes):
    """The legitimate switch: a new run's version reaches a relay behind the master before that
    relay heard the new trainer; it waits for the announcement instead of refusing at once."""
    master, victim = nodes("master"), nodes("victim")
    victim.gate.run_wait_s = 20.0
    master.set_downstream(victim.address, victim.id)
    trainer_publish(master, "run-a", 1, 5, weights(5))
    wait_ident(victim, ("run-a", 1, 5))
    announcer = threading.Timer(0.5, lambda: victim.announce_run("run-b"))
    announcer.start()
    try:
        trainer_publish(master, "run-b", 1, 0, weights(0))   # the master takes it from the trainer itself
        wait_ident(victim, ("run-b", 1, 0))
    finally:
        announcer.cancel()
    assert victim.status()["run"] == "run-b"  # from now on run-a is the stranger


class Engine:
    """load_relay as the worker extension answers it: the relay's newest version, if newer than min."""

    def __init__(self):
        self.loads: list[int] = []

    async def load_relay(self, shm_dir: str, min_version: int, exact=None) -> int:
        self.loads.append(min_version)
        m = LocalWeights(shm_dir).manifest()
        return m.version if m is not None and m.version > min_version else -1


def test_crossrun_a_rollout_never_loads_another_runs_version(nodes):
    relay = nodes("relay", checked=False)
    trainer_publish(relay, "run-old", 3, 40, weights(40))
    follower = WeightFollower(Engine(), str(relay.store.dir), "h0", Work(), structlog.get_logger("test"), 60.0)
    follower.version, follower.lineage, follower.run_id = 2, 1, "run-new"  # what it loaded from this run
    asyncio.run(follower.update())
    assert follower.engine.loads == [] and follower.run_id == "run-new", "another run's version was loaded"
    follower.announce_run("run-newer")                 # the trainer announces a run: only that one loads
    asyncio.run(follower.update())
    assert follower.engine.loads == []
    trainer_publish(relay, "run-newer", 1, 0, weights(0))
    asyncio.run(follower.update())
    assert (follower.run_id, follower.lineage, follower.version) == ("run-newer", 1, 0)


def traj(gid: str, i: int, run: str, version: int = 3) -> Trajectory:
    spec = TrajectorySpec(trajectory_id=f"{gid}/{i}", prompt_id=gid, group_id=gid, sample_index=i,
                          group_size=2, prompt_tokens=np.array([1], np.int32))
    return Trajectory(spec=spec, response_tokens=np.array([5], np.int32), logprobs=np.array([-1.0], np.float32),
                      version=version, rollout_id="r", reward=1.0, lineage=1, run_id=run)


def test_crossrun_the_buffer_never_hands_out_another_runs_samples():
    book = BufferBook(100)
    for i in range(2):
        assert book.put(traj("replayed", i, "run-old"))[0] == "stored"
        assert book.put(traj("honest", i, "run-new"))[0] == "stored"
    groups, _, ch = book.sample(10, 4, lineage=1, forks={"1": 0}, run_id="run-new")
    assert [g[0].spec.group_id for g in groups] == ["honest"]
    assert ("replayed", "off_lineage") in ch.removed_groups and ch.requeue == ["replayed"]
    assert book.stats()["run_dropped"] == 1
