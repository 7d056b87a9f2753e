"""An idle rollout at the prompt pool's shut gate (Batch.gated: a barrier mode's step, flow control)
does not ask again every idle_wait_s: a newer version or the pool's `data.gate_open` wakes it at
once, and gated_wait_s bounds the wait should that event be lost; a lost `weights.version` is seen
within idle_wait_s by the relay's pointer moving (one stat, no ask). (A barrier run's 128 rollouts
asking every half second through each long-tailed step were most of its CPU in the simulator.)
An empty pool that is not gated is asked again every idle_wait_s, as before."""
from __future__ import annotations

import asyncio

import pytest

from laminar.config import RunSpec
from laminar.protocol import Batch, GateOpen
from tests.unit.roles.rollout.test_wiring import Client, make_role

pytestmark = pytest.mark.timeout(60)


def idle_rollout(tmp_path, gated: bool):
    prompts = Client(lambda req: Batch([], gated=gated))
    role = make_role(tmp_path, prompts=prompts, idle_wait_s=0.02, gated_wait_s=30.0, report_interval_s=60.0)
    role.cluster.run = RunSpec(mode="sync")
    role.weights.unnamed = lambda: False
    queue: asyncio.Queue = asyncio.Queue()
    role.versions_sub = type("Sub", (), {"recv": staticmethod(queue.get)})
    return role, prompts, queue


async def stop(role, task) -> None:
    role.stopping.set()
    await asyncio.wait_for(task, 5)
    await role.cancel_tasks()


async def asked(prompts, n: int, within_s: float) -> bool:
    for _ in range(int(within_s / 0.01)):
        if len(prompts.requests) >= n:
            return True
        await asyncio.sleep(0.01)
    return len(prompts.requests) >= n


def test_a_shut_gate_is_asked_again_when_woken_not_every_idle_wait(tmp_path):
    async def go():
        role, prompts, queue = idle_rollout(tmp_path, gated=True)
        task = asyncio.ensure_future(role.run())
        await asyncio.sleep(0.5)
        assert len(prompts.requests) == 1          # 25 idle waits went by: no second ask
        await queue.put(("data.gate_open", GateOpen("0")))
        assert await asked(prompts, 2, 5.0)         # the pool's gate_open: asked again at once
        await asyncio.sleep(0.3)
        assert len(prompts.requests) == 2
        await stop(role, task)
    asyncio.run(go())


def test_an_empty_pool_without_a_gate_is_asked_every_idle_wait(tmp_path):
    async def go():
        role, prompts, _ = idle_rollout(tmp_path, gated=False)
        task = asyncio.ensure_future(role.run())
        assert await asked(prompts, 5, 5.0)
        await stop(role, task)
    asyncio.run(go())


def test_a_lost_version_event_at_a_shut_gate_costs_idle_wait_not_gated_wait(tmp_path):
    """PUB/SUB may drop the relay's `weights.version`: the gate's wait looks at the relay's pointer
    every idle_wait_s (gated_wait_s is 30 s here) and asks again once it has moved."""
    async def go():
        role, prompts, _ = idle_rollout(tmp_path, gated=True)
        stamp = [(1, 1)]
        role.weights.pointer_stamp = lambda: stamp[0]
        task = asyncio.ensure_future(role.run())
        await asyncio.sleep(0.3)
        assert len(prompts.requests) == 1          # the pointer did not move: no second ask
        stamp[0] = (2, 2)                          # a new version on the relay, its event lost
        assert await asked(prompts, 2, 2.0)
        await stop(role, task)
    asyncio.run(go())


def test_without_a_relay_pointer_the_gate_waits_for_a_wake_alone(tmp_path):
    """No pointer to look at (the simulator's modeled chain has no shared-memory folder): no look
    every idle_wait_s, only a wake or gated_wait_s ends the wait."""
    async def go():
        role, prompts, _ = idle_rollout(tmp_path, gated=True)
        looks = []
        role.weights.pointer_stamp = lambda: looks.append(1)
        task = asyncio.ensure_future(role.run())
        await asyncio.sleep(0.3)
        assert len(prompts.requests) == 1 and len(looks) <= 1
        await stop(role, task)
    asyncio.run(go())
