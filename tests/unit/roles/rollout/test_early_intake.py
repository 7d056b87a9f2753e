"""Early intake: without refill or a gate, a rollout takes its next batch (same weights) as soon as
nothing generates, while the last trajectories of the batch are still being stored; the engine
no longer idles through their puts. When newer weights wait on the relay, the batch drains as
before (the weights change only with nothing active), and at most one intake's worth of stored-
but-unacknowledged work is held."""
from __future__ import annotations

import asyncio

import pytest
from laminar.roles.rollout.trajectory import Active

from laminar.config import RunSpec
from laminar.protocol import Batch, PutResult, PutTrajectory, TakeBatch
from tests.unit.roles.rollout.test_wiring import Book, make_role, spec

pytestmark = pytest.mark.timeout(60)


class Engine:
    """Two tokens a trajectory, at once."""

    stats = None

    async def generate(self, request_id, prompt, max_tokens, seed):
        yield [7, 8], [-0.1, -0.2], "stop"


class Pools:
    """TakeBatch: `size` new single-trajectory groups each time; PutTrajectory: held until released."""

    def __init__(self, size: int):
        self.size, self.taken, self.puts = size, 0, []
        self.released = asyncio.Event()

    async def call(self, req, timeout: float):
        if isinstance(req, TakeBatch):
            n = min(self.size, req.max_trajectories)
            self.taken += 1
            return Batch([spec(f"b{self.taken}-{i}/0") for i in range(n)])
        assert isinstance(req, PutTrajectory)
        self.puts.append(req.trajectory.spec.trajectory_id)
        await self.released.wait()
        return PutResult("stored")


def rollout(tmp_path, pools: Pools):
    role = make_role(tmp_path, prompts=pools, partials=Book(), buffer=pools, max_concurrency=4, refill=False)
    role.cluster.run = RunSpec(mode="laminar")
    role.engine = role.runner.engine = Engine()
    role.weights.unnamed = lambda: False
    return role


def test_the_next_batch_starts_while_the_last_puts_wait(tmp_path):
    async def go():
        pools = Pools(4)
        role = rollout(tmp_path, pools)
        assert await role._decide() == role.GENERATING and pools.taken == 1
        await asyncio.wait_for(role._await_room(), 5)       # generation ended; the puts still wait
        assert len(pools.puts) == 4 and len(role.active) == 4 and not role.work.generating
        assert await role._decide() == role.GENERATING and pools.taken == 2  # a full batch's room
        assert len(role.active) == 8
        await asyncio.wait_for(role._await_room(), 5)
        assert await role._decide() == role.GENERATING and pools.taken == 2  # two intakes held: no third
        waiting = asyncio.ensure_future(role._await_room())
        await asyncio.sleep(0.2)
        assert not waiting.done()                           # backpressure until the puts are answered
        pools.released.set()
        await asyncio.wait_for(waiting, 5)
        role.stopping.set()
        await role.cancel_tasks()
    asyncio.run(go())


def test_newer_weights_waiting_drain_the_batch_first(tmp_path):
    async def go():
        pools = Pools(4)
        role = rollout(tmp_path, pools)
        role.weights.newer_waiting = lambda: True
        assert await role._decide() == role.GENERATING
        waiting = asyncio.ensure_future(role._await_room())
        await asyncio.sleep(0.3)
        assert not role.work.generating and not waiting.done()  # generated, but stored not yet: no intake
        assert not role._intake_early() and role._room() == 0
        pools.released.set()
        await asyncio.wait_for(waiting, 5)
        assert not role.active
        role.stopping.set()
        await role.cancel_tasks()
    asyncio.run(go())


def test_a_trajectory_generating_still_takes_room_and_a_migrant_counts(tmp_path):
    role = rollout(tmp_path, Pools(4))
    role.work.add(Active(spec=spec("m/0"), version=role.version))  # a migrant, generating
    assert role._room() == 3
    role.work.generation_ended("m/0")
    assert role._room() == 4


def test_weights_written_since_the_last_look_drain_the_batch_first(tmp_path):
    """A version the relay got while the batch generated, that no event or report has told of yet
    (a PUB/SUB event lost, the report not due): the rollout looks at the relay's pointer before
    it takes the next batch early, and drains to load it instead of holding a batch more on the
    old version."""
    async def go():
        pools = Pools(4)
        role = rollout(tmp_path, pools)
        role.weights.shm_dir = str(tmp_path)
        on_relay = []  # the relay: the newer version is in its folder, unannounced

        async def look_at_relay():
            role.weights.newest_here = on_relay[-1] if on_relay else None
        role.weights.look_at_relay = look_at_relay
        role.weights.newer_waiting = lambda: role.weights.newest_here is not None
        assert await role._decide() == role.GENERATING and pools.taken == 1
        on_relay.append("version 2")
        waiting = asyncio.ensure_future(role._await_room())
        await asyncio.sleep(0.3)
        assert not role.work.generating and not waiting.done()  # generated; drains instead of taking more
        assert role._room() == 0
        pools.released.set()
        await asyncio.wait_for(waiting, 5)
        assert not role.active and pools.taken == 1
        role.stopping.set()
        await role.cancel_tasks()
    asyncio.run(go())
