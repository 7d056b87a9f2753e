"""The rollout role under faults, one piece of its logic at a time: a weight pull that fails
(garbage pointer, truncated slot file) keeps the loaded weights; a new lineage is loaded even under
a lower version number and named in every trajectory; a refused PutTrajectory is offered again
until stored, the partial-pool copy kept meanwhile; batch_seq stays above every earlier one
across a restart even when the wall clock steps back.

The engine is a stand-in whose load runs the real worker-side code (the vLLM worker extension's
`laminar_prepare/commit/settle`, driven as the engine drives them) against a real relay folder
in /dev/shm; the pools are recording stubs.
"""
from __future__ import annotations

import asyncio
import shutil
import types
import uuid

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from laminar.roles.rollout.rank_load import load_on_ranks  # noqa: E402
from laminar.roles.rollout.role import RolloutRole  # noqa: E402
from laminar.roles.rollout.trajectory import Active  # noqa: E402
from laminar.roles.rollout.worker_ext import LaminarWorkerExtension  # noqa: E402

from laminar.protocol import CompletePartial, PutResult, PutTrajectory, TrajectorySpec  # noqa: E402
from laminar.role_base import RoleContext  # noqa: E402
from laminar.weights.local_write import write_version  # noqa: E402
from laminar.weights.manifest import with_lineage  # noqa: E402
from laminar.weights.store import ShmStore, read_pointer  # noqa: E402


class Runner:
    """vLLM's model runner as the worker extension sees it: records what was loaded."""

    def __init__(self):
        self.loaded: dict[str, torch.Tensor] | None = None

    def reload_weights(self, weights_iterator) -> None:
        self.loaded = {k: t.clone() for k, t in weights_iterator}


class Engine(LaminarWorkerExtension):
    """The rollout engine API around the real worker-side load."""

    def __init__(self):
        self.model_runner = Runner()
        self.stats = types.SimpleNamespace(kv_usage=0.0, running=0, waiting=0)

    def laminar_rank(self) -> int:
        return 0

    async def _on_ranks(self, method: str, *args) -> list:
        return [await asyncio.to_thread(getattr(self, method), *args)]  # one rank

    async def load_relay(self, shm_dir: str, min_version: int, exact: tuple[str, int, int] | None = None) -> int:
        return await load_on_ranks(self._on_ranks, ("relay", shm_dir, min_version, exact))


class Client:
    """A pool client stub: answers from a list, records every request."""

    def __init__(self, answers=()):
        self.answers, self.requests = list(answers), []

    async def call(self, req, timeout: float):
        self.requests.append(req)
        return self.answers.pop(0) if self.answers else PutResult("stored")


def make_role(tmp_path, shm_dir=None, partials=None, buffer=None, **settings) -> RolloutRole:
    config = types.SimpleNamespace(workdir=lambda: tmp_path, endpoint=lambda role, id: f"inproc://{role}.{id}")
    role = RolloutRole(RoleContext(role="rollout", id="r0", host="h0", transport=None,
                                   settings={"engine": "sim", **settings}, cluster=config))
    role.wire(Engine(), partials=partials, buffer=buffer, reward=lambda spec, tokens: 1.0, shm_dir=shm_dir,
              seq_file=tmp_path / "rollout-r0" / "batch_seq.json")
    return role


@pytest.fixture
def relay():
    stores = []

    def make() -> ShmStore:
        s = ShmStore(f"/dev/shm/laminar-unit-{uuid.uuid4().hex[:10]}")
        s.open()
        stores.append(s)
        return s
    yield make
    for s in stores:
        s.close()
        shutil.rmtree(s.dir, ignore_errors=True)


def weights(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4096, generator=g), "b": torch.randn(3, generator=g)}


def publish(store: ShmStore, sd: dict, version: int, lineage: int = 1, run_id: str = "run") -> None:
    """A relay committing (run_id, lineage, version), as its receiver does."""
    import laminar.weights.local_write as lw
    real = lw.build_manifest
    lw.build_manifest = lambda *a, **k: with_lineage(real(*a, **k), run_id, lineage)
    try:
        write_version(store, sd, version, chunk_bytes=4096)
    finally:
        lw.build_manifest = real


def same(a: dict, b: dict) -> bool:
    return a is not None and list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in b)


def test_failed_pulls_keep_the_weights_and_are_counted(tmp_path, relay):
    store = relay()
    role = make_role(tmp_path, shm_dir=str(store.dir), pull_retry_s=60.0)
    v1, v2, v3 = weights(1), weights(2), weights(3)

    async def go():
        publish(store, v1, 1)
        await role.weights.update()
        assert role.version == 1 and same(role.engine.model_runner.loaded, v1)

        publish(store, v2, 2)
        (store.dir / "current").write_bytes(b"\x93garbage")           # a torn pointer
        await role.weights.update()                             # must not raise
        assert role.version == 1 and same(role.engine.model_runner.loaded, v1)
        assert role.weights.pull_failures == 1
        await role.weights.update()                             # same pointer: not retried at once
        assert role.weights.pull_failures == 1

        publish(store, v3, 3)                                          # the next version: tried at once
        slot = read_pointer(store.dir)[0]
        with open(store.slot_path(slot), "r+b") as f:                  # its file cut short
            f.truncate(100)
        await role.weights.update()
        assert role.version == 1 and same(role.engine.model_runner.loaded, v1)
        assert role.weights.pull_failures == 2

        publish(store, v2, 4)                                          # a sound version loads again
        await role.weights.update()
        assert role.version == 4 and same(role.engine.model_runner.loaded, v2)
        st = role.status()
        assert st["weight_pull_failures"] == 2 and st["version"] == 4
    asyncio.run(go())


def test_weights_lost_in_a_failed_commit_are_forgotten_until_a_version_loads(tmp_path, relay, monkeypatch):
    """A commit that fails part-way on a rank whose old version the relay no longer has leaves the
    engine's weights unknown (rank_load.WeightsLost): the role names no version (so no trajectory
    starts), counts the failure, and loads the relay's newest at the next try."""
    from laminar.roles.rollout.worker_ext import FAULT_ENV
    store = relay()
    role = make_role(tmp_path, shm_dir=str(store.dir), pull_retry_s=0.001)
    fault = tmp_path / "fault"
    monkeypatch.setenv(FAULT_ENV, str(fault))

    async def go():
        publish(store, weights(1), 1)
        await role.weights.update()
        assert role.version == 1
        publish(store, weights(2), 2)
        publish(store, weights(3), 3)                                  # v1 is gone from the relay
        fault.write_text("0 commit\n")
        await role.weights.update()
        assert role.version == -1 and role.weights.lineage == 0 and role.weights.pull_failures == 1
        assert role.weights.unnamed()                                 # nothing starts on unknown weights
        fault.unlink()
        while role.version != 3:                                       # after pull_retry_s: the newest
            await role.weights.update()
        assert same(role.engine.model_runner.loaded, weights(3)) and role.weights.pull_failures == 1

    asyncio.run(go())


def test_a_new_lineage_is_loaded_under_a_lower_number_and_named_in_trajectories(tmp_path, relay):
    store = relay()
    role = make_role(tmp_path, shm_dir=str(store.dir), buffer=Client(), partials=Client())
    a5, b3 = weights(5), weights(103)

    async def go():
        publish(store, a5, 5, lineage=1)
        await role.weights.update()
        assert role.version == 5 and same(role.engine.model_runner.loaded, a5)
        publish(store, b3, 3, lineage=2)                               # a resumed trainer's lineage
        await role.weights.update()
        assert role.version == 3 and same(role.engine.model_runner.loaded, b3)
        assert (role.weights.lineage, role.weights.run_id) == (2, "run")
        a = Active(spec=spec("t0"), version=role.version)
        a.add_generated([1, 2], [-0.1, -0.2])
        a.timings["generated"] = 0.0
        role.active[a.id] = a
        await role.runner._finish(a, "stop")
        (put,) = [r for r in role.buffer.requests if isinstance(r, PutTrajectory)]
        assert (put.trajectory.version, put.trajectory.lineage) == (3, 2)
    asyncio.run(go())


def spec(tid: str) -> TrajectorySpec:
    return TrajectorySpec(trajectory_id=tid, prompt_id="p", group_id="g", sample_index=0, group_size=1,
                          prompt_tokens=np.asarray([1, 2, 3], dtype=np.int32), answer="x", max_tokens=8)


def test_a_refused_put_is_offered_again_and_the_partial_kept_until_stored(tmp_path):
    role = make_role(tmp_path, put_retry_s=0.01, put_retry_max_s=0.02, partials=Client([None]),
                     buffer=Client([PutResult("full", "buffer at capacity"), PutResult("full", "buffer at capacity"),
                                    PutResult("stored")]))
    a = Active(spec=spec("t1"), version=0)
    a.add_generated([4, 5], [-0.5, -0.25])
    a.timings["generated"] = 0.0
    role.active[a.id] = a

    async def go():
        await role.runner._finish(a, "stop")
    asyncio.run(go())
    puts = [r for r in role.buffer.requests if isinstance(r, PutTrajectory)]
    assert len(puts) == 3 and all(p.trajectory.spec.trajectory_id == "t1" for p in puts)
    # the partial-pool copy is released once, after the buffer stored it
    assert [type(r) for r in role.partials.requests] == [CompletePartial]
    assert role.runner.puts_refused == 2 and a.id not in role.active


def test_batch_seq_stays_above_earlier_ones_when_the_clock_steps_back(tmp_path, monkeypatch):
    import laminar.roles.rollout.batch_seq as mod
    now = [1_800_000_000 * 10**9]
    monkeypatch.setattr(mod.time, "time_ns", lambda: now[0])

    async def seqs(role, n: int) -> list[int]:
        role.seqs.start()
        out = []
        for _ in range(n):
            out.append(await role.seqs.at(role.batches))
            role.batches += 1
        return out
    first = asyncio.run(seqs(make_role(tmp_path), 3))
    now[0] -= 10 * 10**9                      # restart after the clock was stepped back 10 s
    second = asyncio.run(seqs(make_role(tmp_path), 3))
    assert len(set(first)) == 3 and min(second) > max(first), (first, second)


def test_work_of_the_same_number_on_another_lineage_is_not_migrated_in(tmp_path):
    from laminar.bus.rpc import RequestError

    from laminar.protocol import MigrateIn, PartialState
    role = make_role(tmp_path, partials=Client([None]))
    role.weights.version, role.weights.lineage = 6, 2
    role.runner._generate = lambda a: asyncio.sleep(0)          # not generating anything here
    old = PartialState(spec=spec("t9"), tokens=np.asarray([1], np.int32), logprobs=np.asarray([-0.1], np.float32),
                       version=6, rollout_id="r1", next_seq=1, lineage=1)   # 6 of the discarded lineage

    async def go():
        with pytest.raises(RequestError, match=r"lineage 1 vs 2"):
            await role.migration.on_migrate_in(MigrateIn([old]))
    asyncio.run(go())
    assert not role.active


def test_adopted_work_is_not_run_on_another_lineage_under_its_number(tmp_path):
    """Work of lineage 1 version 14 was adopted while the relay retained that version; before it
    ran, the trainer resumed (lineage 2) and the relay retained lineage 2's version 14 under the
    same number. The rollout loads nothing, gives the work back to the partial pool (the manager
    restarts it) and keeps its weights: no token of it comes from lineage 2's version 14."""
    from laminar.protocol import PartialState, ReassignPartial
    store = ShmStore(f"/dev/shm/laminar-unit-{uuid.uuid4().hex[:10]}", retain=4)
    store.open()
    try:
        role = make_role(tmp_path, shm_dir=str(store.dir), partials=Client([None]))
        role.runner._generate = lambda a: asyncio.sleep(0)          # not generating anything here
        w = {(lin, v): weights(100 * lin + v) for lin, v in [(1, 14), (1, 15), (2, 14), (2, 15), (2, 16)]}

        async def go():
            for v in (14, 15):
                publish(store, w.get((1, v), weights(v)), v, lineage=1)
            await role.weights.update()
            assert (role.version, role.weights.lineage) == (15, 1)
            role.migration.adopted = [PartialState(spec=spec("t14"), tokens=np.asarray([1, 2], np.int32),
                                                   logprobs=np.zeros(2, np.float32), version=14, rollout_id="r0",
                                                   next_seq=1, lineage=1)]
            for v in (14, 15, 16):                            # the resumed trainer's lineage reuses 14
                publish(store, w[2, v], v, lineage=2)
            assert await role.engine.load_relay(str(store.dir), -1, exact=("run", 1, 14)) == -1
            await role.migration.run_adopted()
        asyncio.run(go())
        assert not role.active and not role.migration.pinned, "lineage-1 work started on lineage 2's version 14"
        assert (role.version, role.weights.lineage) == (15, 1) and same(role.engine.model_runner.loaded, w[1, 15])
        assert role.partials.requests == [ReassignPartial("t14", "")]   # an orphan again: nothing lost
    finally:
        store.close()
        shutil.rmtree(store.dir, ignore_errors=True)
