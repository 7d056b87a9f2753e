"""The Transport contract (bus/transport.py), run against both implementations: ZeroMQ (loopback,
CURVE, an in-thread broker) and the in-process hub. Anything a role may rely on is checked here,
so a role tested on the in-process transport behaves the same across processes."""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import numpy as np
import pytest
from laminar.bus import auth
from laminar.bus.broker import Broker
from laminar.bus.errors import Busy, DeadlineExceeded, PeerUnavailable, Refused, RemoteError
from laminar.bus.inproc import InprocHub
from laminar.bus.rpc import RequestError
from laminar.bus.transport import Transport
from laminar.bus.zmq_transport import ZmqTransport

from laminar.protocol import PROTOCOL_VERSION, Hello, Metrics, Ping, Pong, Shutdown, Welcome

pytestmark = pytest.mark.timeout(60)


@dataclass
class Bus:
    """One simulated cluster: `transport()` gives each role its own view; `address()` a fresh
    server address (the same one can be bound again after a close)."""
    kind: str
    free_port: object
    keys: auth.CurveKeys | None = None
    hub: InprocHub | None = None
    broker: Broker | None = None
    transports: list[Transport] = field(default_factory=list)

    def transport(self) -> Transport:
        if self.kind == "inproc":
            t = self.hub.transport()
        else:
            t = ZmqTransport(self.broker.pub_address, self.broker.sub_address, self.keys)
        self.transports.append(t)
        return t

    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.free_port()}" if self.kind == "zmq" else f"inproc://srv{self.free_port()}"


@contextlib.asynccontextmanager
async def open_bus(kind: str, tmp_path, free_port):
    bus = Bus(kind, free_port)
    if kind == "inproc":
        bus.hub = InprocHub()
    else:
        auth.generate_keys(tmp_path / "keys")
        bus.keys = auth.load_keys(tmp_path / "keys")
        bus.broker = Broker("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", bus.keys)
        bus.broker.start()
    try:
        yield bus
    finally:
        for t in bus.transports:
            await t.close()
        if bus.broker is not None:
            await asyncio.to_thread(bus.broker.stop)


@pytest.fixture(params=["inproc", "zmq"])
def run(request, tmp_path, free_port):
    """`run(fn)`: run `async fn(bus)` on a fresh bus of this parameter's kind."""
    def go(fn):
        async def main():
            async with open_bus(request.param, tmp_path, free_port) as bus:
                return await fn(bus)
        return asyncio.run(main())
    return go


class Echo:
    """A server whose handler covers every outcome a caller can see."""

    def __init__(self, bus: Bus, address: str | None = None, max_inflight: int = 2):
        self.srv = bus.transport().server(address or bus.address(), "echo", "0", max_inflight)
        self.srv.route(Ping, self.on_ping)
        self.entered, self.release = asyncio.Event(), asyncio.Event()

    async def on_ping(self, req: Ping) -> Pong:
        if req.seq < 0:
            raise RequestError("refused", "negative seq")
        if req.seq == 13:
            raise KeyError("unlucky")
        if req.seq >= 1000:                 # hangs until released: a slow handler
            self.entered.set()
            await self.release.wait()
        return Pong(seq=req.seq, payload=req.payload, array=req.array, server="echo.0")

    async def __aenter__(self) -> Echo:
        await self.srv.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.srv.close()


def test_call_round_trip_with_arrays_and_hello(run):
    async def body(bus):
        async with Echo(bus) as e:
            c = bus.transport().client(e.srv.address)
            arr = np.arange(12, dtype=np.float32).reshape(3, 4)
            pong = await c.call(Ping(seq=7, payload=b"hi", array=arr), timeout=5)
            assert isinstance(pong, Pong) and pong.seq == 7 and pong.payload == b"hi"
            assert pong.array.dtype == np.float32 and np.array_equal(pong.array, arr)
            welcome = await c.hello("test", "t", timeout=5)
            assert isinstance(welcome, Welcome) and welcome.protocol == PROTOCOL_VERSION and welcome.role == "echo"
            with pytest.raises(RemoteError) as err:
                await c.call(Hello(protocol=PROTOCOL_VERSION + 1, role="new", id="x"), timeout=5)
            assert err.value.code == "protocol_mismatch"
            assert (
                f"protocol {PROTOCOL_VERSION + 1}" in err.value.message
                and f"protocol {PROTOCOL_VERSION}" in err.value.message
            )
            return e.srv.stats
    assert run(body)["requests"] == 3


def test_typed_error_replies_and_busy(run):
    async def body(bus):
        async with Echo(bus) as e:
            c = bus.transport().client(e.srv.address)
            with pytest.raises(Refused, match="negative seq"):
                await c.call(Ping(seq=-1), timeout=5)
            with pytest.raises(RemoteError) as err:
                await c.call(Ping(seq=13), timeout=5)               # handler bug: 'internal', server lives on
            assert err.value.code == "internal" and "KeyError" in err.value.message
            with pytest.raises(RemoteError) as err:
                await c.call(Shutdown("x"), timeout=5)              # no handler for this kind
            assert err.value.code == "unknown_kind"
            slow = [asyncio.create_task(c.call(Ping(seq=1000 + i), timeout=10)) for i in range(2)]
            async with asyncio.timeout(5):
                while e.srv.dispatcher.inflight < 2:
                    await e.entered.wait()
                    e.entered.clear()
            with pytest.raises(Busy):
                await c.call(Ping(seq=5), timeout=5)
            e.release.set()
            assert sorted(p.seq for p in await asyncio.gather(*slow)) == [1000, 1001]
            assert (await c.call(Ping(seq=6), timeout=5)).seq == 6
            return e.srv.stats
    stats = run(body)
    assert stats["refused"] == 1 and stats["internal"] == 1 and stats["unknown_kind"] == 1 and stats["busy"] == 1


def test_slow_handler_is_a_deadline(run):
    async def body(bus):
        async with Echo(bus) as e:
            c = bus.transport().client(e.srv.address)
            with pytest.raises(DeadlineExceeded, match="no reply within"):
                await c.call(Ping(seq=1000), timeout=0.3)
            e.release.set()
            assert (await c.call(Ping(seq=1), timeout=5)).seq == 1  # the late reply did not confuse the next call
    run(body)


def test_nobody_serving_is_a_deadline(run):
    async def body(bus):
        c = bus.transport().client(bus.address())
        with pytest.raises(DeadlineExceeded):
            await c.call(Ping(seq=1), timeout=0.3)
    run(body)


def test_server_going_away_fails_pending_calls_then_restart_is_reached(run):
    async def body(bus):
        address = bus.address()
        e = Echo(bus, address)
        await e.srv.start()
        c = bus.transport().client(e.srv.address)
        assert (await c.call(Ping(seq=1), timeout=5)).seq == 1
        pending = asyncio.create_task(c.call(Ping(seq=1000), timeout=30))
        await asyncio.wait_for(e.entered.wait(), 5)
        await e.srv.close()
        with pytest.raises(PeerUnavailable):           # at once, not after the 30 s deadline
            await asyncio.wait_for(pending, 10)
        with pytest.raises(DeadlineExceeded):          # the server is gone
            await c.call(Ping(seq=2), timeout=0.3)
        async with Echo(bus, address):                 # back on the same address: the same client reaches it
            assert (await c.call(Ping(seq=3), timeout=10)).seq == 3
    run(body)


def test_client_close_fails_its_pending_calls(run):
    async def body(bus):
        async with Echo(bus) as e:
            c = bus.transport().client(e.srv.address)
            pending = asyncio.create_task(c.call(Ping(seq=1000), timeout=30))
            await asyncio.wait_for(e.entered.wait(), 5)
            c.close()
            with pytest.raises(PeerUnavailable):
                await asyncio.wait_for(pending, 10)
            e.release.set()
            c2 = bus.transport().client(e.srv.address)     # the server is unaffected
            assert (await c2.call(Ping(seq=4), timeout=5)).seq == 4
    run(body)


async def wait_live(sub, pub, topic: str) -> None:
    """Publish probes until `sub` gets one: its subscription reached the broker and `pub` is
    connected (a PUB drops what it sends before that). Immediate on the in-process hub."""
    async with asyncio.timeout(10):
        while True:
            pub.publish(topic, Ping(seq=-1))
            try:
                async with asyncio.timeout(0.1):
                    while (await sub.recv())[0] != topic:
                        pass
                return
            except TimeoutError:
                continue


def test_pubsub_prefixes_arrays_and_order(run):
    async def body(bus):
        sub = bus.transport().subscriber(["a.b", "m."])
        other = bus.transport().subscriber(["zzz"])
        pub = bus.transport().publisher()
        await wait_live(sub, pub, "a.b.probe")
        while True:                                    # drain probes still in flight
            try:
                async with asyncio.timeout(0.2):
                    await sub.recv()
            except TimeoutError:
                break
        arr = np.arange(6, dtype=np.int64).reshape(2, 3)
        pub.publish("a.x", Ping(seq=0))                # not a prefix match: never delivered
        for i in range(100):
            pub.publish("a.b.c", Ping(seq=i, array=arr * i))
        pub.publish("m.echo", Metrics(role="echo", id="0", ts=1.0, values={"served": 2.0}))
        got = []
        async with asyncio.timeout(10):
            while len(got) < 101:
                got.append(await sub.recv())
        assert [t for t, _ in got[:100]] == ["a.b.c"] * 100
        assert [ev.seq for _, ev in got[:100]] == list(range(100))          # one publisher's order is kept
        assert all(np.array_equal(ev.array, arr * ev.seq) for _, ev in got[:100])
        assert got[100] == ("m.echo", Metrics(role="echo", id="0", ts=1.0, values={"served": 2.0}))
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await other.recv()
        assert sub.dropped == 0 and pub.dropped == 0
    run(body)


def test_unencodable_events_raise_at_the_sender(run):
    async def body(bus):
        pub = bus.transport().publisher()
        sub = bus.transport().subscriber(["x"])  # noqa: F841  (inproc encodes per subscriber)
        with pytest.raises(TypeError, match="cannot travel"):
            pub.publish("x", Ping(seq=1, array=np.array([1 + 2j])))
        with pytest.raises(TypeError, match="cannot encode"):
            pub.publish("x", Metrics(role="r", id="0", ts=0.0, values={"v": {1, 2}}))
    run(body)
