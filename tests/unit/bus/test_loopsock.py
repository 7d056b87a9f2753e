"""LoopSocket (bus/loopsock.py): a ZeroMQ socket driven from the loop through its ZMQ_FD, with no
lost wake-ups: parked receivers and senders resume, a full pipe parks the sender until the peer
reads, a close fails whoever is parked, and request/reply under many concurrent calls completes."""
from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio
from laminar.bus.loopsock import LoopSocket
from laminar.bus.zmq_transport import ZmqTransport

from laminar.protocol import Ping, Pong
from laminar.testing.procs import free_port

pytestmark = pytest.mark.timeout(60)


def _pair(ctx: zmq.asyncio.Context, name: str, hwm: int = 1000) -> tuple[LoopSocket, LoopSocket]:
    a = ctx.socket(zmq.PAIR, socket_class=LoopSocket)
    b = ctx.socket(zmq.PAIR, socket_class=LoopSocket)
    a.sndhwm = b.rcvhwm = hwm
    a.bind(f"inproc://{name}")
    b.connect(f"inproc://{name}")
    return a, b


def test_ping_pong_never_loses_a_wake_up():
    """Each side parks on every message (its peer has not answered yet): 2,000 round trips."""
    async def go():
        ctx = zmq.asyncio.Context()
        a, b = _pair(ctx, "pingpong")

        async def echo():
            for _ in range(2000):
                await b.asend([await b.arecv()])
        t = asyncio.create_task(echo())
        for i in range(2000):
            await a.asend([b"%d" % i])
            assert await asyncio.wait_for(a.arecv(), 5) == b"%d" % i
        await t
        ctx.destroy(linger=0)
    asyncio.run(go())


def test_a_full_pipe_parks_the_sender_until_the_peer_reads():
    async def go():
        ctx = zmq.asyncio.Context()
        a, b = _pair(ctx, "full", hwm=1)
        sent: list[int] = []

        async def send_all():
            for i in range(20):
                await a.asend([b"%d" % i, b"more"])
                sent.append(i)
        t = asyncio.create_task(send_all())
        await asyncio.sleep(0.2)
        assert 0 < len(sent) < 20  # the pipe (hwm 1 each side) filled: the sender is parked
        got = []
        for _ in range(20):
            got.append(await asyncio.wait_for(b.arecv(), 5))
            assert await asyncio.wait_for(b.arecv(), 5) == b"more"  # the whole message, in order
        await asyncio.wait_for(t, 5)
        assert got == [b"%d" % i for i in range(20)] and sent == list(range(20))
        ctx.destroy(linger=0)
    asyncio.run(go())


@pytest.mark.parametrize("how", ["socket", "context"])
def test_closing_fails_a_parked_receiver(how):
    async def go():
        ctx = zmq.asyncio.Context()
        a, _b = _pair(ctx, f"close-{how}")
        waiting = asyncio.create_task(a.arecv())
        await asyncio.sleep(0.05)
        assert not waiting.done()
        if how == "socket":
            a.close(linger=0)
        else:
            ctx.destroy(linger=0)
        with pytest.raises(zmq.ZMQError) as got:
            await asyncio.wait_for(waiting, 5)
        assert got.value.errno == zmq.ENOTSOCK
        if how == "socket":
            ctx.destroy(linger=0)
    asyncio.run(go())


def test_many_concurrent_calls_all_answered():
    """A client's sends and its receive loop share one socket (a send can take the wake-up meant
    for an arriving reply): 5 rounds of 300 calls in flight over TCP, every one answered."""
    async def go():
        t = ZmqTransport("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", None)
        server = t.server("tcp://127.0.0.1:0", "echo", "0")

        async def on_ping(req: Ping) -> Pong:
            if req.seq % 3 == 0:
                await asyncio.sleep(0)  # some answers later than others
            return Pong(seq=req.seq, payload=req.payload)
        server.route(Ping, on_ping)
        await server.start()
        client = t.client(server.address)
        try:
            for r in range(5):
                seqs = range(r * 300, (r + 1) * 300)
                replies = await asyncio.gather(*(client.call(Ping(seq=s, payload=b"p"), timeout=20) for s in seqs))
                assert [p.seq for p in replies] == list(seqs)
        finally:
            await t.close()
    asyncio.run(go())


def test_a_send_that_takes_an_arrivals_signal_still_wakes_the_receiver():
    """A send processes the socket's pending commands (libzmq does so at most every ~1 ms), the
    arrival's among them, and that resets the fd the loop watches: the send itself must wake a
    receiver parked on the same socket, or the reply waits forever."""
    import time

    async def go():
        ctx = zmq.asyncio.Context()
        a, b = _pair(ctx, "send-takes-signal")
        for _ in range(3):  # each round: a receiver parked, an arrival, a send before the loop looks
            receiver = asyncio.create_task(a.arecv())
            await asyncio.sleep(0.05)
            assert not receiver.done()
            b.send(b"arrival")
            time.sleep(0.01)  # the arrival is signalled while the loop is busy here...
            await a.asend([b"out"])  # ...and this send, first to run, processes it
            assert await asyncio.wait_for(receiver, 2) == b"arrival"
            assert await asyncio.wait_for(b.arecv(), 2) == b"out"
        ctx.destroy(linger=0)
    asyncio.run(go())


def test_every_parked_sender_resumes():
    """Many sends wait at once (a client's concurrent calls before its peer is connected): when
    the socket can send again every one of them goes, not just the last to park."""
    async def go():
        ctx = zmq.asyncio.Context()
        dealer = ctx.socket(zmq.DEALER, socket_class=LoopSocket)
        dealer.setsockopt(zmq.IMMEDIATE, 1)  # no peer yet: every send waits
        addr = f"tcp://127.0.0.1:{free_port()}"
        dealer.connect(addr)
        sends = [asyncio.create_task(dealer.asend([b"%d" % i])) for i in range(20)]
        await asyncio.sleep(0.1)
        assert not any(s.done() for s in sends)
        router = ctx.socket(zmq.ROUTER, socket_class=LoopSocket)
        router.bind(addr)
        await asyncio.wait_for(asyncio.gather(*sends), 5)
        got = sorted([(await asyncio.wait_for(router.arecv(), 5), await router.arecv())[1] for _ in range(20)])
        assert got == sorted(b"%d" % i for i in range(20))
        ctx.destroy(linger=0)
    asyncio.run(go())


def test_a_router_blocked_on_one_full_peer_does_not_stall_the_loop():
    """A ROUTER shows POLLOUT whatever one peer's pipe holds; a reply to a peer that does not read
    waits (without holding the loop) until that peer reads, then goes."""
    async def go():
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER, socket_class=LoopSocket)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.sndhwm = 1
        router.bind("inproc://slow-peer")
        dealer = ctx.socket(zmq.DEALER, socket_class=LoopSocket)
        dealer.rcvhwm = 1
        dealer.connect("inproc://slow-peer")
        await dealer.asend([b"hello"])
        ident, _ = await asyncio.wait_for(router.arecv(), 5), await router.arecv()

        async def replies():
            for i in range(20):
                await router.asend([ident, b"%d" % i])
        t = asyncio.create_task(replies())
        ticks = 0
        for _ in range(20):  # the loop keeps running while the replies wait
            await asyncio.sleep(0.005)
            ticks += 1
        assert ticks == 20 and not t.done()
        got = [await asyncio.wait_for(dealer.arecv(), 5) for _ in range(20)]
        await asyncio.wait_for(t, 5)
        assert got == [b"%d" % i for i in range(20)]
        ctx.destroy(linger=0)
    asyncio.run(go())


def test_a_socket_moves_to_a_later_loop():
    """Used from one `asyncio.run` and then another (as zmq.asyncio allows): the reader follows
    the socket to the loop that uses it now."""
    ctx = zmq.asyncio.Context()
    a, b = _pair(ctx, "two-loops")

    async def one_message(tag: bytes):
        waiting = asyncio.create_task(a.arecv())
        await asyncio.sleep(0.05)  # parked on this loop
        await b.asend([tag])
        return await asyncio.wait_for(waiting, 5)
    assert asyncio.run(one_message(b"first")) == b"first"
    assert asyncio.run(one_message(b"second")) == b"second"
    ctx.destroy(linger=0)


def test_a_receive_that_takes_a_senders_signal_still_wakes_the_sender():
    """Reading ZMQ_EVENTS re-arms the fd for both directions: a receiver that looks at the socket
    after the connection came up (its signal pending, the loop not yet polling) takes the signal
    the parked sender was waiting for, so whoever reads the state must wake both."""
    import time

    async def go():
        ctx = zmq.asyncio.Context()
        dealer = ctx.socket(zmq.DEALER, socket_class=LoopSocket)
        dealer.setsockopt(zmq.IMMEDIATE, 1)
        addr = f"tcp://127.0.0.1:{free_port()}"
        dealer.connect(addr)
        sender = asyncio.create_task(dealer.asend([b"out"]))
        await asyncio.sleep(0.05)
        assert not sender.done()  # parked: no peer yet
        router = ctx.socket(zmq.ROUTER, socket_class=LoopSocket)
        router.bind(addr)
        time.sleep(0.3)  # the connection comes up while the loop is busy here
        look = dealer.arecv()  # a receive looks first (the client's receive loop, say): no message,
        look.send(None)        # so it parks, having read the state
        look.close()
        await asyncio.wait_for(sender, 2)
        _ident, got = await asyncio.wait_for(router.arecv(), 2), await router.arecv()
        assert got == b"out"
        ctx.destroy(linger=0)
    asyncio.run(go())
