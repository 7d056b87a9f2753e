"""The role shell (laminar/shell.py run_role) and request/reply semantics on the in-process
transport: exit codes, bounded stop, heartbeats, ctrl Shutdown, typed errors of a call."""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import structlog.testing
from laminar.bus.errors import Busy, DeadlineExceeded, Refused, RemoteError
from laminar.bus.inproc import InprocHub
from laminar.bus.rpc import RequestError

from laminar.protocol import PROTOCOL_VERSION, ErrorReply, Heartbeat, Hello, Ping, Pong, Shutdown, Welcome
from laminar.role_base import Role, RoleContext
from laminar.shell import EXIT_STOPPED_BY_OPERATOR, run_role

pytestmark = pytest.mark.timeout(30)


class Toy(Role):
    name = "toy"
    mode = "ok"

    async def setup(self) -> None:
        self.release = asyncio.Event()       # never set unless a test sets it: handlers that must hang
        self.entered = asyncio.Event()
        if self.mode == "setup_fails":
            raise RuntimeError("setup failed")
        if self.mode == "setup_hangs":
            await asyncio.Event().wait()
        self.server = self.ctx.transport.server("inproc://toy", "toy", self.ctx.id, max_inflight=2)
        self.server.route(Ping, self.on_ping)
        await self.server.start()
        if self.mode == "crash":
            self.spawn(self._boom(), "boom")
        if self.mode == "loop_ends":
            self.spawn(self._ends(), "ends")

    async def _boom(self) -> None:
        raise RuntimeError("boom")

    async def _ends(self) -> None:
        return None

    async def run(self) -> None:
        if self.mode == "run_returns":
            return
        if self.mode == "run_fails":
            raise ValueError("run failed")
        await super().run()

    async def on_ping(self, req: Ping) -> Pong:
        if req.seq < 0:
            raise RequestError("refused", "negative seq")
        if req.seq == 13:
            raise KeyError("unlucky")
        if req.seq >= 999:
            self.entered.set()
            await self.release.wait()
        return Pong(seq=req.seq, payload=req.payload, array=req.array)

    async def stop(self) -> None:
        if self.mode == "hang":
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.stop_cut = True  # the shell cut this stop at its deadline
                raise
        await super().stop()
        if getattr(self, "server", None) is not None:
            await self.server.close()


def toy(hub: InprocHub, mode: str = "ok") -> Toy:
    r = Toy(RoleContext(role="toy", id="0", host="h", transport=hub.transport()))
    r.mode = mode
    return r


async def start(r: Toy, **kw) -> tuple[asyncio.Task, asyncio.Event]:
    """Run the role; return its task and an event set by the READY callback."""
    ready = asyncio.Event()
    task = asyncio.create_task(run_role(r, heartbeat_s=0.05, stop_signals=False, on_ready=ready.set, **kw))
    return task, ready


def test_requests_and_typed_errors():
    async def main():
        hub = InprocHub()
        r = toy(hub)
        task, ready = await start(r)
        await asyncio.wait_for(ready.wait(), 5)
        c = hub.transport().client("inproc://toy")
        arr = np.arange(6, dtype=np.int64).reshape(2, 3)
        pong = await c.call(Ping(seq=3, payload=b"x", array=arr))
        assert pong.seq == 3 and pong.payload == b"x" and (pong.array == arr).all()
        welcome = await c.hello("test", "0")
        assert isinstance(welcome, Welcome) and welcome.protocol == PROTOCOL_VERSION and welcome.role == "toy"
        with pytest.raises(Refused, match="negative seq") as e:
            await c.call(Ping(seq=-1))
        assert e.value.code == "refused"
        with pytest.raises(RemoteError) as e:
            await c.call(Shutdown("x"))                          # no handler for this kind
        assert e.value.code == "unknown_kind" and "shutdown" in e.value.message
        with pytest.raises(RemoteError) as e:
            await c.call(Ping(seq=13))                           # handler bug: typed 'internal', server lives on
        assert e.value.code == "internal" and "KeyError" in e.value.message
        with pytest.raises(DeadlineExceeded, match="0.2s"):               # the caller's deadline, not a reply,
            await c.call(Ping(seq=999), timeout=0.2)
        assert r.entered.is_set() and not r.release.is_set()     # ended it: the handler is still waiting
        # a request that arrives after its deadline is refused without running the handler
        late = await r.server.dispatcher.handle(Ping(seq=1), {"dl": time.time() - 60})
        assert isinstance(late, ErrorReply) and late.code == "deadline"
        # a Hello with another protocol version is refused naming both (inproc keeps the check)
        bad = await r.server.dispatcher.handle(Hello(protocol=PROTOCOL_VERSION + 1, role="x", id="0"), {})
        assert bad.code == "protocol_mismatch"
        assert f"protocol {PROTOCOL_VERSION + 1}" in bad.message and f"protocol {PROTOCOL_VERSION}" in bad.message
        stats = r.server.stats
        assert stats["refused"] == 1 and stats["unknown_kind"] == 1 and stats["internal"] == 1 and stats["late"] == 1
        assert (await c.call(Ping(seq=4))).seq == 4               # still serving
        r.stopping.set()
        assert await task == 0
    asyncio.run(main())


def test_busy_beyond_max_inflight():
    async def main():
        hub = InprocHub()
        r = toy(hub)
        task, ready = await start(r)
        await asyncio.wait_for(ready.wait(), 5)
        c = hub.transport().client("inproc://toy")
        slow = [asyncio.create_task(c.call(Ping(seq=1000 + i), timeout=10)) for i in range(2)]
        async with asyncio.timeout(5):
            while r.server.dispatcher.inflight < 2:
                await r.entered.wait()
                r.entered.clear()
        with pytest.raises(Busy):
            await c.call(Ping(seq=5))
        r.release.set()
        assert sorted(p.seq for p in await asyncio.gather(*slow)) == [1000, 1001]
        r.stopping.set()
        assert await task == 0
    asyncio.run(main())


@pytest.mark.parametrize("mode, code", [("crash", 1), ("loop_ends", 1), ("setup_fails", 1), ("run_fails", 1),
                                        ("run_returns", 0)])
def test_exit_codes(mode, code):
    async def main():
        return await asyncio.wait_for(run_role(toy(InprocHub(), mode), heartbeat_s=0.05, stop_signals=False), 10)
    assert asyncio.run(main()) == code


def test_stop_during_setup_returns_0():
    async def main():
        r = toy(InprocHub(), "setup_hangs")
        task, ready = await start(r)
        await asyncio.sleep(0)       # let setup() start (and block); not a wait for anything external
        r.stopping.set()
        code = await asyncio.wait_for(task, 5)
        return code, ready.is_set()
    code, was_ready = asyncio.run(main())
    assert code == 0 and not was_ready


def test_requested_stop_returns_0():
    async def main():
        r = toy(InprocHub())
        task, ready = await start(r)
        await asyncio.wait_for(ready.wait(), 5)
        r.stopping.set()
        return await asyncio.wait_for(task, 5)
    assert asyncio.run(main()) == 0


def test_stop_is_bounded_by_shutdown_s():
    """A stop() that never returns is cut at shutdown_s: the shell cancels it, logs the missed
    deadline and exits 1 (the outer wait_for only guards against a hang)."""
    async def main():
        r = toy(InprocHub(), "hang")
        r.stop_cut = False
        task, ready = await start(r, shutdown_s=0.3)
        await asyncio.wait_for(ready.wait(), 5)
        with structlog.testing.capture_logs() as logs:
            r.stopping.set()
            code = await asyncio.wait_for(task, 20)
        return code, r.stop_cut, [e for e in logs if e["event"] == "stop_deadline_exceeded"]
    code, cut, missed = asyncio.run(main())
    assert code == 1 and cut
    assert [(e["role"], e["deadline_s"]) for e in missed] == [("toy", 0.3)]


def test_heartbeats_carry_state_and_counters():
    async def main():
        hub = InprocHub()
        sub = hub.transport().subscriber(["hb.toy"])
        r = toy(hub)
        task, ready = await start(r)
        await asyncio.wait_for(ready.wait(), 5)
        async with asyncio.timeout(5):
            while True:
                topic, hb = await sub.recv()
                if isinstance(hb, Heartbeat) and hb.state == "ready":
                    break
        r.stopping.set()
        assert await task == 0
        return topic, hb
    topic, hb = asyncio.run(main())
    assert topic == "hb.toy.0" and hb.role == "toy" and hb.id == "0" and hb.dropped_frames == 0


def test_shutdown_event_on_the_bus_stops_the_role():
    async def main():
        hub = InprocHub()
        r = toy(hub)
        task, ready = await start(r)
        await asyncio.wait_for(ready.wait(), 5)
        hub.transport().publisher().publish("ctrl.toy.0", Shutdown("test"))
        return await asyncio.wait_for(task, 5)
    assert asyncio.run(main()) == EXIT_STOPPED_BY_OPERATOR  # told to stop: not "finished" (0)


def test_shutdown_for_another_role_is_ignored():
    async def main():
        hub = InprocHub()
        r = toy(hub)
        task, ready = await start(r)
        await asyncio.wait_for(ready.wait(), 5)
        hub.transport().publisher().publish("ctrl.toy.1", Shutdown("not you"))
        c = hub.transport().client("inproc://toy")
        assert (await c.call(Ping(seq=2))).seq == 2               # the ctrl event was delivered before this
        assert not task.done() and not r.stopping.is_set()
        hub.transport().publisher().publish("ctrl.all", Shutdown("everyone"))
        return await asyncio.wait_for(task, 5)
    assert asyncio.run(main()) == EXIT_STOPPED_BY_OPERATOR
