"""The role shell and request/reply semantics on the in-process transport."""
from __future__ import annotations

import asyncio

import pytest

from laminar.bus.errors import DeadlineExceeded, Refused, RemoteError
from laminar.bus.inproc import InprocHub
from laminar.bus.rpc import RequestError
from laminar.protocol import Ping, Pong, Shutdown
from laminar.roles.base import Role, RoleContext
from laminar.shell import run_role


class Toy(Role):
    name = "toy"
    mode = "ok"

    async def setup(self) -> None:
        self.server = self.ctx.transport.server("inproc://toy", "toy", self.ctx.id)
        self.server.route(Ping, self.on_ping)
        await self.server.start()
        if self.mode == "crash":
            self.spawn(self._boom(), "boom")

    async def _boom(self) -> None:
        raise RuntimeError("boom")

    async def on_ping(self, req: Ping) -> Pong:
        if req.seq < 0:
            raise RequestError("refused", "negative seq")
        if req.seq == 999:
            await asyncio.sleep(10)
        return Pong(seq=req.seq)

    async def stop(self) -> None:
        if self.mode == "hang":
            await asyncio.sleep(60)
        await super().stop()
        await self.server.close()


def toy(hub: InprocHub, mode: str) -> Toy:
    r = Toy(RoleContext(role="toy", id="0", host="h", transport=hub.transport()))
    r.mode = mode
    return r


def test_requests_and_typed_errors():
    async def main():
        hub = InprocHub()
        r = toy(hub, "ok")
        task = asyncio.create_task(run_role(r, heartbeat_s=0.05, stop_signals=False))
        c = hub.transport().client("inproc://toy")
        assert (await c.call(Ping(seq=3))).seq == 3
        with pytest.raises(Refused, match="negative seq"):
            await c.call(Ping(seq=-1))
        with pytest.raises(RemoteError) as e:
            await c.call(Shutdown("x"))
        assert e.value.code == "unknown_kind"
        with pytest.raises(DeadlineExceeded):
            await c.call(Ping(seq=999), timeout=0.2)
        r.stopping.set()
        assert await task == 0
    asyncio.run(main())


def test_failed_background_task_stops_the_role_with_exit_1():
    async def main():
        return await run_role(toy(InprocHub(), "crash"), heartbeat_s=0.05, stop_signals=False)
    assert asyncio.run(main()) == 1


def test_stop_is_bounded_by_shutdown_s():
    async def main():
        r = toy(InprocHub(), "hang")
        task = asyncio.create_task(run_role(r, heartbeat_s=0.05, shutdown_s=0.3, stop_signals=False))
        await asyncio.sleep(0.1)
        r.stopping.set()
        return await asyncio.wait_for(task, 5)
    assert asyncio.run(main()) == 1


def test_shutdown_event_on_the_bus_stops_the_role():
    async def main():
        hub = InprocHub()
        r = toy(hub, "ok")
        task = asyncio.create_task(run_role(r, heartbeat_s=0.05, stop_signals=False))
        c = hub.transport().client("inproc://toy")
        await c.call(Ping(seq=1))  # READY
        hub.transport().publisher().publish("ctrl.toy.0", Shutdown("test"))
        return await asyncio.wait_for(task, 5)
    assert asyncio.run(main()) == 0
