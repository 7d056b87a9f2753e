"""WeightFollower (roles/rollout/weights.py) on its own, against a real relay folder in /dev/shm:
a version is named only when the relay's pointer did not move during the load; a relay that
commits during every load leaves the weights unnamed; nothing loads while trajectories run; a new
lineage loads from scratch; `weights.version` events wake the loop and only this host's relay
folder counts as `newest_here`; the pointer look reads the relay only when its pointer changed;
an exact (retained) load names its lineage or says why not.

The engine is a stand-in whose load reads what the relay folder holds (the worker's rule: newer
than min_version, or exactly `exact`), optionally committing a version "during" the load.
"""
from __future__ import annotations

import asyncio
import shutil
import uuid

import numpy as np
import pytest
import structlog
from laminar.roles.rollout.trajectory import Active
from laminar.roles.rollout.weights import WeightFollower
from laminar.roles.rollout.work import Work

from laminar.protocol import TrajectorySpec, WeightsVersion
from laminar.weights.local_write import commit_local
from laminar.weights.manifest import build_manifest, with_lineage
from laminar.weights.pull import LocalWeights
from laminar.weights.store import ShmStore

pytestmark = pytest.mark.timeout(30)
LOG = structlog.get_logger("test")


@pytest.fixture
def store():
    s = ShmStore(f"/dev/shm/laminar-unit-weights-{uuid.uuid4().hex[:10]}", retain=2)
    s.open()
    yield s
    s.close()
    shutil.rmtree(s.dir, ignore_errors=True)


def commit(store: ShmStore, version: int, lineage: int = 1, run_id: str = "run") -> None:
    """A relay committing (run_id, lineage, version) of one small tensor, as its receiver does."""
    m = with_lineage(build_manifest([("w", "float32", (256,))], version, chunk_bytes=512), run_id, lineage)
    with store.cond:
        _, vb = store.begin(m)
    commit_local(store, vb)


class Engine:
    """load_relay as the worker extension answers it; `during(n)` runs inside the n-th load, after
    the version it loads was chosen."""

    def __init__(self, during=None, fail: Exception | None = None):
        self.loads: list[tuple[int, tuple | None]] = []
        self.during, self.fail, self.states = during, fail, []
        self.work: Work | None = None

    async def load_relay(self, shm_dir: str, min_version: int, exact: tuple[str, int, int] | None = None) -> int:
        self.loads.append((min_version, exact))
        if self.work is not None:
            self.states.append(self.work.state)
        if self.fail is not None:
            raise self.fail
        w = LocalWeights(shm_dir)
        if exact is not None:  # (run_id, lineage, version): the number of other weights is not loaded
            return exact[2] if w.has(exact) else -1
        m = w.manifest()
        got = m.version if m is not None and m.version > min_version else -1
        if self.during is not None:  # the relay commits while this load's version is being copied
            self.during(len(self.loads))
        return got


def follower(store: ShmStore | None, engine=None, host: str = "h0") -> WeightFollower:
    work = Work()
    engine = engine or Engine()
    engine.work = work
    return WeightFollower(engine, str(store.dir) if store else None, host, work, LOG, pull_retry_s=60.0)


def test_a_version_is_named_only_when_the_relay_did_not_move_during_the_load(store):
    commit(store, 2)
    eng = Engine(during=lambda n: commit(store, 3) if n == 1 else None)
    w = follower(store, eng)
    asyncio.run(w.update())
    assert (w.version, w.lineage, w.run_id) == (3, 1, "run")
    assert len(eng.loads) == 2  # the first load (of 2) raced the commit of 3: loaded again, then named
    assert eng.states == ["loading", "loading"] and w.work.state == "idle"


def test_a_relay_that_commits_during_every_load_leaves_the_weights_unnamed(store):
    commit(store, 2)
    eng = Engine(during=lambda n: commit(store, 2 + n))
    w = follower(store, eng)
    asyncio.run(w.update())
    assert len(eng.loads) == 3
    assert (w.version, w.lineage, w.run_id) == (-1, 0, "") and w.unnamed()


def test_nothing_loads_while_trajectories_run_and_nothing_without_a_relay(store):
    commit(store, 2)
    w = follower(store)
    w.work.active["t"] = Active(spec=_spec("t"), version=0)
    asyncio.run(w.update())
    assert w.engine.loads == [] and w.version == 0
    w = follower(None)
    asyncio.run(w.update())
    assert w.engine.loads == [] and not w.unnamed() and w.retained_copy(0, 0) == (None, "no relay folder")


def test_the_same_lineage_asks_for_newer_than_held_and_a_new_lineage_from_scratch(store):
    commit(store, 5, lineage=1)
    w = follower(store)
    asyncio.run(w.update())
    commit(store, 6, lineage=1)
    asyncio.run(w.update())
    commit(store, 2, lineage=2)  # a resumed trainer: its new lineage restarts low
    asyncio.run(w.update())
    assert [m for m, _ in w.engine.loads] == [-1, 5, -1]
    assert (w.version, w.lineage) == (2, 2)


def test_a_failed_load_keeps_the_weights_and_is_not_retried_on_the_same_pointer(store):
    commit(store, 1)
    eng = Engine(fail=OSError("truncated slot file"))
    w = follower(store, eng)
    asyncio.run(w.update())
    asyncio.run(w.update())
    assert w.pull_failures == 1 and len(eng.loads) == 1 and w.version == 0
    commit(store, 2)  # a new pointer: tried at once
    eng.fail = None
    asyncio.run(w.update())
    assert w.version == 2 and w.pull_failures == 1


def test_events_wake_the_loop_and_only_this_hosts_relay_folder_is_kept(store):
    w = follower(store)
    w.version, w.lineage, w.run_id = 3, 1, "run"
    here = str(store.dir) + "/"  # the same folder, spelled differently
    events = [WeightsVersion("r", "h0", 3, 1, here, lineage=1, run_id="run"),        # not newer
              WeightsVersion("r", "h1", 5, 1, here, lineage=1, run_id="run"),        # another host
              WeightsVersion("r", "h0", 4, 1, "/dev/shm/elsewhere", lineage=1, run_id="run"),
              WeightsVersion("r", "h0", 4, 1, here, lineage=1, run_id="run"),
              WeightsVersion("r", "h0", 1, 1, here, lineage=2, run_id="run")]       # a new lineage, lower number
    woken = []

    async def go():
        queue: asyncio.Queue = asyncio.Queue()
        sub = type("Sub", (), {"recv": staticmethod(queue.get)})
        task = asyncio.ensure_future(w.follow(sub))
        for ev in events:
            w.work.wake.clear()
            await queue.put(("weights.version", ev))
            while not queue.empty():
                await asyncio.sleep(0)
            await asyncio.sleep(0)
            woken.append(w.work.wake.is_set())
            if len(woken) == 4:
                assert (w.newest_here.host, w.newest_here.version) == ("h0", 4)
        task.cancel()
    asyncio.run(go())
    assert woken == [False, True, True, True, True]
    assert (w.newest_here.version, w.newest_here.lineage) == (1, 2) and w.newer_waiting()


def test_the_pointer_look_reads_the_relay_only_when_its_pointer_changed(store):
    w = follower(store)
    asyncio.run(w.look_at_relay())
    assert w.newest_here is None  # no version yet
    commit(store, 4)
    asyncio.run(w.look_at_relay())
    assert w.newest_here.version == 4 and w.newer_waiting()
    w.newest_here = None
    asyncio.run(w.look_at_relay())  # the same pointer: not read again
    assert w.newest_here is None


def test_an_exact_load_names_the_relays_lineage_or_says_why_not(store):
    commit(store, 1, lineage=3, run_id="r2")
    commit(store, 2, lineage=3, run_id="r2")
    commit(store, 3, lineage=3, run_id="r2")
    w = follower(store)
    assert w.retained_copy(3, 2) == (("r2", 3, 2), "")
    assert w.retained_copy(3, 9)[0] is None
    assert "not of lineage 1" in w.retained_copy(1, 2)[1]   # the same number of another lineage: other weights
    assert "names no lineage" in w.retained_copy(-1, 2)[1]
    assert asyncio.run(w.load_retained(3, 2)) is None
    assert (w.version, w.lineage, w.run_id) == (2, 3, "r2") and w.work.state == "loading"
    assert w.engine.loads[-1] == (-1, ("r2", 3, 2))
    assert asyncio.run(w.load_retained(3, 9)).startswith("its relay holds no version 9") and w.version == 2
    assert "not of lineage 4" in asyncio.run(w.load_retained(4, 1)) and w.version == 2
    w.engine.fail = OSError("torn")
    assert asyncio.run(w.load_retained(3, 1)).startswith("load failed: ") and w.version == -1


def _spec(tid: str) -> TrajectorySpec:
    return TrajectorySpec(trajectory_id=tid, prompt_id="p", group_id="g", sample_index=0, group_size=1,
                          prompt_tokens=np.asarray([1], dtype=np.int32), answer="x", max_tokens=4)


def test_update_reads_the_relays_manifest_once_per_pointer(store, monkeypatch):
    """Every batch-loop turn asks update(); the manifest is read and parsed only when the relay's
    pointer file was replaced (a new version), not on every turn."""
    reads = []
    real = LocalWeights.manifest
    monkeypatch.setattr(LocalWeights, "manifest", lambda self: reads.append(1) or real(self))
    commit(store, 3)
    w = follower(store)

    async def turns(n):
        for _ in range(n):
            await w.update()
    asyncio.run(turns(1))
    assert w.version == 3
    loaded_reads = len(reads)  # the look, the stand-in engine's load, the check after the load
    asyncio.run(turns(5))
    assert len(reads) == loaded_reads  # the same pointer: not read again
    commit(store, 4)
    asyncio.run(turns(3))
    assert w.version == 4 and len(reads) == 2 * loaded_reads  # the new pointer read once, then not again
