"""Refill without a barrier: a rollout that takes new groups as trajectories finish (`refill`)
keeps doing so only while its weights are the newest its own host's relay holds. Once the relay
announces a newer version (`weights.version` naming this rollout's weights folder) it takes no
more work, lets what runs finish with the one version it started on, and then loads the new one.

Before this, `refill: true` in laminar mode refilled for as long as the prompt pool had work: the
batch never drained, so the rollout never loaded another version and generated the whole run with
its first weights. In the barrier modes the prompt pool's gate decides when a version's work ends,
so a newer version does not stop refill there.
"""
from __future__ import annotations

import asyncio
import types

import numpy as np
import pytest
from laminar.roles.rollout.role import RolloutRole
from laminar.roles.rollout.trajectory import Active

from laminar.config import RunSpec
from laminar.protocol import Batch, TrajectorySpec, WeightsVersion
from laminar.role_base import RoleContext

pytestmark = pytest.mark.timeout(30)

OURS = "/dev/shm/laminar-unit-refill-n0"
THEIRS = "/dev/shm/laminar-unit-refill-n1"


def make_role(mode: str | None = "laminar", **settings) -> RolloutRole:
    cluster = None if mode is None else types.SimpleNamespace(run=RunSpec(mode=mode))
    role = RolloutRole(RoleContext(role="rollout", id="r0", host="n0", transport=None,
                                   settings={"engine": "sim", "max_concurrency": 8, **settings}, cluster=cluster))
    role.wire(types.SimpleNamespace(stats=types.SimpleNamespace(kv_usage=0.0, running=0, waiting=0)), shm_dir=OURS)
    role.weights.version, role.weights.lineage, role.weights.run_id = 3, 1, "run"
    return role


def spec(tid: str = "g/0") -> TrajectorySpec:
    return TrajectorySpec(trajectory_id=tid, prompt_id="p", group_id=tid.split("/")[0], sample_index=0, group_size=1,
                          prompt_tokens=np.asarray([1, 2, 3], dtype=np.int32), answer="x", max_tokens=16)


def start_one(role: RolloutRole) -> None:
    role.active["g/0"] = Active(spec=spec(), version=role.version)


def announce(version: int, shm_dir: str = OURS, lineage: int = 1, host: str | None = None) -> WeightsVersion:
    host = host or ("n0" if shm_dir == OURS else "n1")
    return WeightsVersion(f"relay-{host}", host, version, 1024, shm_dir, lineage=lineage, run_id="run")


async def follow(role: RolloutRole, events: list) -> None:
    """Run the role's real `weights.version` follower over `events`, then stop it."""
    queue: asyncio.Queue = asyncio.Queue()
    for ev in events:
        queue.put_nowait(("weights.version", ev))

    async def recv():
        return await queue.get()
    task = asyncio.ensure_future(role.weights.follow(types.SimpleNamespace(recv=recv)))
    while not queue.empty():
        await asyncio.sleep(0)
    await asyncio.sleep(0)
    task.cancel()


def test_refill_stops_once_this_hosts_relay_holds_a_newer_version():
    role = make_role(refill=True)
    start_one(role)
    role.taken_on_version = 8  # a batch's worth (max_concurrency) was taken on version 3
    assert role._room() == 7  # refilling: room for new groups while the batch runs

    asyncio.run(follow(role, [announce(4, THEIRS), announce(4, OURS, host="n1")]))
    assert role._room() == 7  # another host's relay (even under the same path): ours does not hold it yet

    asyncio.run(follow(role, [announce(3), announce(2)]))
    assert role._room() == 7  # not newer than what the engine holds

    asyncio.run(follow(role, [announce(4)]))
    assert role._room() == 0  # drain: what runs finishes on version 3, nothing new starts on it

    role.active.clear()  # the batch drained
    assert role._room() == 8  # nothing runs: the loop loads version 4 before it takes work (_settle_weights)
    role.weights.version = 4  # loaded
    start_one(role)
    assert role._room() == 7  # refilling again, on version 4


def test_a_version_gets_a_batchs_worth_before_refill_drains_for_the_next():
    """A drain costs the engine its longest response whatever came before it: a rollout whose
    version is replaced before it took max_concurrency trajectories on it goes on refilling until
    it has, so it drains at most once per version and at most once per batch's worth."""
    role = make_role(refill=True)
    start_one(role)
    asyncio.run(follow(role, [announce(4)]))
    role.taken_on_version = 7
    assert role._room() == 7  # one short of a batch's worth: keep refilling on version 3
    role.taken_on_version = 8
    assert role._room() == 0  # now drain


def test_a_new_lineage_under_a_lower_number_stops_refill_too():
    role = make_role(refill=True)
    start_one(role)
    role.taken_on_version = 8
    asyncio.run(follow(role, [announce(1, lineage=2)]))  # a resumed trainer: a new lineage restarts low
    assert role._room() == 0


@pytest.mark.parametrize("mode", ["stream", "one_step", "sync"])
def test_in_a_barrier_mode_the_pools_gate_ends_a_versions_work(mode):
    role = make_role(mode, refill=True)
    start_one(role)
    role.taken_on_version = 8
    asyncio.run(follow(role, [announce(4)]))
    assert role._room() == 7


def test_without_refill_the_batch_runs_to_its_end_as_before():
    role = make_role(refill=False)
    role.work.add(Active(spec=spec(), version=role.version))  # generating
    assert role._room() == 7  # room, but _await_room waits for the batch's generation before taking any
    role.work.generation_ended("g/0")  # generated, now being stored: it takes no room (early intake)
    assert role._room() == 8 and role.work.gen_done.is_set() and not role.work.batch_done.is_set()
    asyncio.run(follow(role, [announce(4)]))  # newer weights wait on the relay: the batch drains first
    assert role._room() == 7 and not role.refill and not role._intake_early()


def test_a_lost_event_does_not_hang_the_drain(tmp_path):
    """PUB/SUB may drop the relay's event: the report loop reads the relay's pointer when it has
    changed and stops refill all the same."""
    torch = pytest.importorskip("torch")
    import shutil
    import uuid

    import laminar.weights.local_write as lw
    from laminar.weights.manifest import with_lineage
    from laminar.weights.store import ShmStore

    store = ShmStore(f"/dev/shm/laminar-unit-refill-{uuid.uuid4().hex[:10]}")
    store.open()
    real = lw.build_manifest
    lw.build_manifest = lambda *a, **k: with_lineage(real(*a, **k), "run", 1)
    try:
        role = make_role(refill=True, report_interval_s=0.01)
        role.taken_on_version = 8
        role.weights.shm_dir = str(store.dir)
        role.ctx.publisher = types.SimpleNamespace(publish=lambda topic, ev: None)
        start_one(role)
        sd = {"w": torch.zeros(256)}

        async def reports(until):
            task = asyncio.ensure_future(role._report_loop())
            for _ in range(200):
                await asyncio.sleep(0.01)
                if until():
                    break
            task.cancel()

        lw.write_version(store, sd, 3, chunk_bytes=4096)  # what the engine holds
        asyncio.run(reports(lambda: role.weights._looked_at is not None))
        assert role._room() == 7 and role.weights.newest_here is None

        lw.write_version(store, sd, 4, chunk_bytes=4096)  # no event comes
        asyncio.run(reports(lambda: role.weights.newest_here is not None))
        assert role.weights.newest_here.version == 4 and role._room() == 0
    finally:
        lw.build_manifest = real
        store.close()
        shutil.rmtree(store.dir, ignore_errors=True)


def test_refilling_without_a_gate_holds_only_what_the_engine_runs():
    """A queue behind the engine's running sequences adds nothing to its pace, and would have to
    drain on the old version before the next one loads: a refilling laminar rollout takes only up
    to max_num_seqs. Batch at a time, and in the barrier modes, it takes max_concurrency."""
    role = make_role(refill=True, max_num_seqs=4)
    assert role._room() == 4
    start_one(role)
    assert role._room() == 3
    assert make_role(refill=False, max_num_seqs=4)._room() == 8
    assert make_role("stream", refill=True, max_num_seqs=4)._room() == 8
    assert make_role(refill=True)._room() == 8  # no max_num_seqs: the engine runs all it is given


def test_the_loop_counts_a_versions_work_and_starts_again_after_every_drain():
    """Through the real `_decide`: every new trajectory counts toward the version's batch's worth;
    the count starts again when the version changes, and also when a drain ends without a load
    (it failed, or waits out pull_retry_s): otherwise the rollout would drain again after every
    intake until a load succeeded."""
    role = make_role(refill=True, max_num_seqs=4)
    loads: list = []  # what each load finds: a version, or None (failed)
    role.weights.update = lambda: _load(role, loads)
    role.runner.start = lambda a: role.active.__setitem__(a.id, a)
    taken = iter(range(10 ** 6))

    async def take(room):
        return Batch([spec(f"g{next(taken)}/0") for _ in range(room)])
    role._take_batch = take

    async def go():
        assert await role._decide() == role.GENERATING
        assert role.taken_on_version == 4 and len(role.active) == 4  # intake: what the engine runs
        for _ in range(2):  # trajectories finish, refill tops up
            role.active.pop(next(iter(role.active)))
            await role._decide()
        assert role.taken_on_version == 6
        role.taken_on_version = 8  # a batch's worth
        await follow(role, [announce(4)])
        role.active.pop(next(iter(role.active)))
        await role._decide()
        assert len(role.active) == 3 and role.taken_on_version == 8  # draining: nothing new on version 3
        role.active.clear()
        loads.append(None)  # the load after the drain fails: version 3 stays
        await role._decide()
        assert role.version == 3 and role.taken_on_version == 4  # a fresh batch's worth, not a drain per intake
        role.active.clear()
        loads.append(4)
        await role._decide()
        assert role.version == 4 and role.taken_on_version == 4 and len(role.active) == 4
    asyncio.run(go())


async def _load(role: RolloutRole, loads: list) -> None:
    if not role.active and loads:
        got = loads.pop(0)
        if got is not None:
            role.weights.version = got
