"""A relay whose data port is dead (its node reports `unhealthy`) does not re-join the chain when
it finds itself absent: the manager dropped it for that reason, and joining again would put a relay
that cannot accept links back into the chain. Once healthy, it re-joins as before."""
from __future__ import annotations

import asyncio
import types

import pytest
import structlog
from laminar.roles.relay.role import RelayRole

from laminar.protocol import ChainState

pytestmark = pytest.mark.timeout(30)


class Sub:
    def __init__(self):
        self.q: asyncio.Queue = asyncio.Queue()

    async def recv(self):
        return "weights.chain", await self.q.get()


def relay(status: dict) -> RelayRole:
    r = RelayRole.__new__(RelayRole)
    r.ctx = types.SimpleNamespace(id="r1", role="relay")
    r.settings = types.SimpleNamespace(rejoin_grace_s=0.0)
    r.log = structlog.get_logger("test")
    r.joined_at = -1e9
    r.chain_sub = Sub()
    r.node = types.SimpleNamespace(status=lambda: dict(status))
    r.joins = []

    async def join(why):
        r.joins.append(why)
    r._join = join
    return r


def test_an_unhealthy_relay_does_not_rejoin_until_it_is_healthy():
    async def go():
        status = {"version": 3, "unhealthy": "data port 0.0.0.0:7000 not accepting: accept thread ended"}
        r = relay(status)
        task = asyncio.create_task(r._follow_chain())
        absent = ChainState(epoch=4, order=["r0"], master_id="r0", master_address="tcp://x:1")
        for _ in range(3):
            await r.chain_sub.q.put(absent)
        while not r.chain_sub.q.empty():
            await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert r.joins == []
        del status["unhealthy"]
        r.node = types.SimpleNamespace(status=lambda: dict(status))
        await r.chain_sub.q.put(absent)
        while not r.joins:
            await asyncio.sleep(0.01)
        task.cancel()
        assert len(r.joins) == 1
    asyncio.run(go())
