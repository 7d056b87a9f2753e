"""The bus across real processes (docs/architecture.md §3): pub/sub through the broker, request/reply with
deadlines, CURVE refusal, protocol-version refusal, and a fuzz of every kind of bound socket."""
from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import zmq
import zmq.asyncio
from laminar.bus import auth
from laminar.bus.codec import decode, encode
from laminar.bus.errors import PeerUnavailable, RemoteError
from laminar.bus.zmq_transport import ZmqTransport

from laminar.protocol import PROTOCOL_VERSION, ErrorReply, Heartbeat, Hello, Metrics, Ping, Pong
from laminar.testing.fuzz_ports import garbage
from laminar.testing.procs import RoleProc
from tests.integration.cluster_files import echo_cluster

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def cluster(tmp_path):
    path, ports = echo_cluster(tmp_path)
    procs = [RoleProc("broker", "0", path, tmp_path).start(), RoleProc("echo", "0", path, tmp_path).start()]
    for p in procs:
        p.wait_ready(30)
    keys = auth.load_keys(tmp_path / "keys")
    yield procs, ports, keys, tmp_path
    for p in procs:
        p.stop()


def transport(ports, keys):
    return ZmqTransport(f"tcp://127.0.0.1:{ports['pub']}", f"tcp://127.0.0.1:{ports['sub']}", keys)


async def first(sub, kind, timeout=10.0):
    async with asyncio.timeout(timeout):
        while True:
            topic, ev = await sub.recv()
            if isinstance(ev, kind):
                return topic, ev


def test_pubsub_rpc_and_dead_server(cluster):
    procs, ports, keys, _ = cluster

    async def main():
        t = transport(ports, keys)
        sub = t.subscriber(["metrics.echo", "hb.echo"])
        topic, m = await first(sub, Metrics)
        assert topic == "metrics.echo" and m.role == "echo"
        topic, hb = await first(sub, Heartbeat)
        assert topic == "hb.echo.0" and hb.state == "ready" and hb.pid == procs[1].pid
        c = t.client(f"tcp://127.0.0.1:{ports['echo.0']}")
        welcome = await c.hello("test", "t")
        assert welcome.role == "echo"
        arr = np.arange(12, dtype=np.float32).reshape(3, 4)
        pong = await c.call(Ping(seq=7, payload=b"hi", array=arr), timeout=5)
        assert isinstance(pong, Pong) and pong.seq == 7 and np.array_equal(pong.array, arr)
        procs[1].kill()
        with pytest.raises(PeerUnavailable):  # DeadlineExceeded or the disconnect, both typed
            await c.call(Ping(seq=8), timeout=1.0)
        await t.close()
    asyncio.run(main())


async def live(sub, pub, topic: str, timeout: float = 10.0):
    """Publish probes on `topic` until `sub` receives one: the subscription has reached the broker
    and the publisher is connected (a PUB drops everything sent before that)."""
    async with asyncio.timeout(timeout):
        while True:
            pub.publish(topic, Ping(seq=-1))
            try:
                async with asyncio.timeout(0.2):
                    while True:
                        got, ev = await sub.recv()
                        if got == topic:
                            return
            except TimeoutError:
                continue


def test_peer_without_the_cluster_key_is_refused(cluster, tmp_path):
    procs, ports, keys, _ = cluster
    auth.generate_keys(tmp_path / "other")
    other = auth.load_keys(tmp_path / "other")

    async def main():
        good = transport(ports, keys)
        sub = good.subscriber(["intruder."])
        good_pub = good.publisher()
        await live(sub, good_pub, "intruder.probe")            # the keyed subscriber is live
        for bad_keys in (None, other):
            bad = transport(ports, bad_keys)
            c = bad.client(f"tcp://127.0.0.1:{ports['echo.0']}")
            with pytest.raises(PeerUnavailable):               # refused handshake or deadline, both typed
                await c.call(Ping(seq=1), timeout=1.0)
            bad_sub = bad.subscriber(["metrics.echo"])
            with pytest.raises(TimeoutError):                  # an unkeyed subscriber hears nothing
                async with asyncio.timeout(0.5):               # (the echo role publishes every 0.1 s)
                    await bad_sub.recv()
            pub = bad.publisher()
            for i in range(50):
                pub.publish("intruder.x", Ping(seq=i))
            await bad.close()
        # a marker from the keyed publisher arrives; nothing from the intruders came before or after it
        seen = []
        async with asyncio.timeout(5):
            good_pub.publish("intruder.marker", Ping(seq=0))
            while True:
                topic, ev = await sub.recv()
                seen.append(topic)
                if topic == "intruder.marker":
                    break
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):
                while True:
                    topic, _ = await sub.recv()
                    seen.append(topic)
                    if topic == "intruder.x":
                        break
        assert "intruder.x" not in seen, seen
        await good.close()
    asyncio.run(main())


def test_other_protocol_version_is_refused_naming_both(cluster):
    procs, ports, keys, _ = cluster

    async def main():
        ctx = zmq.asyncio.Context()
        s = ctx.socket(zmq.DEALER)
        auth.make_client(s, keys)
        s.connect(f"tcp://127.0.0.1:{ports['echo.0']}")
        await s.send_multipart(encode(Hello(protocol=2, role="old", id="x"), {"rid": 1}, version=2))
        async with asyncio.timeout(5):
            frames = await s.recv_multipart()
        ctx.destroy(linger=0)
        # and a current-codec client stating another protocol in its Hello
        t = transport(ports, keys)
        c = t.client(f"tcp://127.0.0.1:{ports['echo.0']}")
        with pytest.raises(RemoteError) as e:
            await c.call(Hello(protocol=PROTOCOL_VERSION + 1, role="new", id="x"), timeout=5)
        assert (await c.hello("test", "t")).protocol == PROTOCOL_VERSION   # the connection still works
        await t.close()
        return frames, e.value
    frames, hello_err = asyncio.run(main())
    err, meta = decode(frames)
    assert isinstance(err, ErrorReply) and err.code == "protocol_mismatch" and meta["rid"] == 1
    assert "peer speaks protocol 2" in err.message and f"this side speaks protocol {PROTOCOL_VERSION}" in err.message
    assert hello_err.code == "protocol_mismatch"
    assert f"peer speaks protocol {PROTOCOL_VERSION + 1}" in hello_err.message
    assert f"this side speaks protocol {PROTOCOL_VERSION}" in hello_err.message
    assert procs[1].alive()


def test_fuzz_every_bound_socket_leaves_roles_serving(cluster):
    procs, ports, keys, _ = cluster
    rng = random.Random(1234)
    N = 10_000
    valid = [bytes(f) for f in encode(Ping(seq=1, array=np.arange(3, dtype=np.int32)), {"rid": 9, "dl": 2e9})]

    async def main():
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.DEALER)          # the echo role's ROUTER
        xsub = ctx.socket(zmq.PUB)               # the broker's XSUB (publishers' side)
        xpub = ctx.socket(zmq.XSUB)              # the broker's XPUB (subscribers' side): random subscription frames
        for s in (router, xsub, xpub):
            s.sndhwm = 0
            auth.make_client(s, keys)
        router.connect(f"tcp://127.0.0.1:{ports['echo.0']}")
        xsub.connect(f"tcp://127.0.0.1:{ports['pub']}")
        xpub.connect(f"tcp://127.0.0.1:{ports['sub']}")
        t = transport(ports, keys)
        sub = t.subscriber(["fuzz.", "metrics.echo"])
        await first(sub, Metrics)                # subscriber is live
        for _ in range(N):
            await router.send_multipart(garbage(rng, valid))
            await xsub.send_multipart([b"fuzz.x", *garbage(rng, valid)])
            await xpub.send(bytes([rng.choice([0, 1])]) + rng.randbytes(rng.randint(0, 16)))
        # still serving: a valid call is answered, valid events still arrive
        c = t.client(f"tcp://127.0.0.1:{ports['echo.0']}")
        pong = await c.call(Ping(seq=99), timeout=10)
        assert pong.seq == 99
        pub = t.publisher()
        async with asyncio.timeout(10):
            while True:
                pub.publish("fuzz.ok", Ping(seq=5))
                topic, ev = await sub.recv()
                if topic == "fuzz.ok" and isinstance(ev, Ping):
                    break
        assert sub.dropped > 0, "garbage published through the broker was not counted"
        hb_sub = t.subscriber(["hb.echo"])
        _, hb = await first(hb_sub, Heartbeat)
        ctx.destroy(linger=0)
        await t.close()
        return hb
    hb = asyncio.run(main())
    assert procs[0].alive() and procs[1].alive()
    assert hb.status["bad_frames"] > 1000 and hb.dropped_frames == hb.status["bad_frames"], hb
