"""Request deadlines do not depend on two hosts' wall clocks agreeing.

A caller's clock 100 s behind (or ahead of) the server's must not get fresh requests refused as
late; a request that really sat in a queue long after its caller gave up is still skipped, judged
against the same caller's other requests (so the skew cancels out). Real ZeroMQ sockets; the
skewed caller is a raw DEALER that stamps its requests with a clock offset by the skew.
"""
from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
import zmq
from laminar.bus import auth
from laminar.bus.codec import decode, encode
from laminar.bus.zmq_transport import ZmqTransport

from laminar.protocol import ErrorReply, Ping, Pong
from tests.support import curve_echo_server

pytestmark = pytest.mark.timeout(60)


def request_meta(rid: int, clock: float, timeout: float) -> dict:
    """What this code's client puts in a request's envelope, on a host whose clock reads `clock`."""
    return {"rid": rid, "dl": clock + timeout, "st": clock, "to": timeout}


@pytest.mark.parametrize("skew_s", [-100.0, 100.0, -3600.0])
def test_skewed_caller_is_served_and_stale_requests_are_still_skipped(tmp_path, skew_s):
    auth.generate_keys(tmp_path / "k")
    keys = auth.load_keys(tmp_path / "k")

    async def main():
        async with curve_echo_server(keys) as (t, srv, (d,)):
            async def call(seq: int, stamp_age_s: float = 0.0):
                clock = time.time() + skew_s - stamp_age_s
                d.send_multipart(encode(Ping(seq=seq), request_meta(seq, clock, 5.0)))
                for _ in range(200):
                    if d.poll(0):
                        return decode(d.recv_multipart())[0]
                    await asyncio.sleep(0.01)
                raise AssertionError("no reply")
            for i in range(5):   # fresh requests from a caller whose clock is off by skew_s
                r = await call(i)
                assert isinstance(r, Pong) and r.seq == i, r
            # one that was stamped 60 s before it arrived (it sat in a queue): skipped
            r = await call(99, stamp_age_s=60.0)
            assert isinstance(r, ErrorReply) and r.code == "deadline", r
            assert "60" in r.message and "clock" not in r.message.split("(")[0], r.message
            r = await call(100)  # and the next fresh one is served again
            assert isinstance(r, Pong) and r.seq == 100
            assert srv.stats.get("late") == 1
    asyncio.run(main())


def test_client_sends_a_relative_timeout():
    """The real client's envelope carries its send time and its timeout (the server needs both)."""
    async def main():
        t = ZmqTransport("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", None)
        raw = zmq.Context()
        srv = raw.socket(zmq.ROUTER)
        srv.linger = 0
        port = srv.bind_to_random_port("tcp://127.0.0.1")
        try:
            cli = t.client(f"tcp://127.0.0.1:{port}")
            task = asyncio.ensure_future(cli.call(Ping(seq=1), timeout=2.5))
            for _ in range(300):
                if srv.poll(0):
                    break
                await asyncio.sleep(0.01)
            frames = srv.recv_multipart()
            _, meta = decode(frames[1:])
            assert meta["to"] == 2.5 and abs(meta["st"] - time.time()) < 5, meta
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        finally:
            srv.close()
            raw.destroy(linger=0)
            await t.close()
    asyncio.run(main())


def test_no_envelope_time_means_no_lateness_check():
    from laminar.bus.rpc import Dispatcher
    d = Dispatcher("x", "0", 4)

    async def pong(req):
        return Pong(seq=req.seq)
    d.route(Ping, pong)
    assert isinstance(asyncio.run(d.handle(Ping(seq=1), {"rid": 1})), Pong)
    # garbage in the envelope is no reason to refuse, nor to crash
    meta = {"rid": 1, "st": "x", "to": msgpack.ExtType(1, b"")}
    assert isinstance(asyncio.run(d.handle(Ping(seq=1), meta)), Pong)
