"""A peer that answers `internal` (a bug on its side, not load) is retried a bounded number of
times, then given up with an error logged; a trajectory whose store is given up this way is made
durable and released in the partial pool (owner none: the manager's reconcile finds it and places
it again), never lost and never left active here. Before, `call_acked` retried `internal` forever:
the trajectory's task, and with it the batch, never ended. Stub pools around the real partial-pool
book (tests/unit/roles/rollout/test_wiring.py)."""
from __future__ import annotations

import asyncio

import pytest
import structlog
from laminar.bus.errors import RemoteError
from laminar.bus.retry import INTERNAL_TRIES, call_acked

from laminar.protocol import Ack, PutTrajectory, TakeBatch
from tests.unit.roles.rollout.test_wiring import Book, Client, active, make_role

pytestmark = pytest.mark.timeout(60)


def failing(code: str, times: int | None = None):
    """An answer that raises RemoteError(code) (the first `times` calls, or always)."""
    calls = []

    def answer(req):
        calls.append(req)
        if times is None or len(calls) <= times:
            raise RemoteError(code, "boom")
        return Ack("ok")
    return answer


def test_internal_is_given_up_after_a_bound_and_busy_is_still_retried():
    log = structlog.get_logger("test")

    async def go():
        c = Client(failing("internal"))
        with pytest.raises(RemoteError) as err:
            await asyncio.wait_for(call_acked(c, TakeBatch("r0", 1), 1.0, log), 20)
        busy = Client(failing("busy", times=3))
        ack = await asyncio.wait_for(call_acked(busy, TakeBatch("r0", 1), 1.0, log), 20)
        return len(c.requests), err.value.code, len(busy.requests), ack
    tries, code, busy_tries, ack = asyncio.run(go())
    assert (tries, code) == (INTERNAL_TRIES, "internal")
    assert busy_tries == 4 and ack.detail == "ok"


def test_a_trajectory_whose_put_is_answered_internal_is_released_in_the_pool(tmp_path):
    buffer = Client(failing("internal"))
    role = make_role(tmp_path, partials=Book(), buffer=buffer)
    a = active(role, "g/0", [7, 8, 9])

    async def go():
        await asyncio.wait_for(role.runner._finish(a, "length"), 20)
    asyncio.run(go())
    book = role.partials.book
    assert "g/0" not in role.active                        # not left active: the batch can end
    assert book.entries["g/0"].owner == ""                 # owned by nobody: reconcile makes it an orphan
    assert book.entries["g/0"].state().tokens.tolist() == [7, 8, 9]   # every token durable
    assert sum(isinstance(r, PutTrajectory) for r in buffer.requests) == INTERNAL_TRIES
    assert role.status()["gave_up"] == 1


def test_a_take_batch_answered_internal_leaves_the_loop_idle_not_stuck(tmp_path):
    role = make_role(tmp_path, prompts=Client(failing("internal")), refill=False)
    role.weights.unnamed = lambda: False  # weights it can name: the loop asks for prompts

    async def go():
        return await asyncio.wait_for(role._decide(), 20)
    assert asyncio.run(go()) == role.IDLE
    assert role.status()["take_failures"] == 1 and len(role.prompts.requests) == INTERNAL_TRIES
