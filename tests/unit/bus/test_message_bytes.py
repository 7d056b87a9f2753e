"""A request's bytes are bounded as a whole, not only frame by frame, and per peer connection
while its requests are handled. Before, a key holder could send up to 65,536 parts of up to
`max_message_mb` each in one request and the server copied every part into Python and decoded and
handled it; and one connection could keep any number of such requests in flight at once. Now a
request larger than the server's `max_request_bytes` is drained without being kept and answered
`bad_request` naming its size and the limit (the handler never sees it), and a connection whose
requests in flight already hold `max_peer_bytes` gets `busy` for the next one (one request at a
time is always taken, so a large legitimate request is never starved). Real ZeroMQ sockets on
127.0.0.1; libzmq itself still holds one whole message before the first part is readable
(docs/security.md)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
from laminar.bus.errors import RemoteError
from laminar.bus.zmq_transport import ZmqTransport

from laminar.protocol import Ack, PartialList, PartialState, TrajectorySpec

pytestmark = pytest.mark.timeout(60)

MIB = 1 << 20


def big(parts: int, mib: int = 1) -> PartialList:
    """A request of about `parts` x `mib` MiB in `parts` array frames (plus the spec's small ones)."""
    spec = TrajectorySpec("g/0", "p", "g", 0, 1, np.zeros(1, np.int32))
    return PartialList([PartialState(spec=spec, tokens=np.zeros(mib * MIB // 4, np.int32),
                                     logprobs=np.zeros(0, np.float32), version=0, rollout_id="r0", next_seq=0)
                        for _ in range(parts)])


def test_a_request_over_the_whole_message_bound_is_refused_unread():
    async def go():
        t = ZmqTransport("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", None, max_msg=4 * MIB)  # 16 MiB a request
        server = t.server("tcp://127.0.0.1:0", "echo", "0")
        seen = []

        async def handler(req):
            seen.append(sum(len(p.tokens) * 4 for p in req.partials))
            return Ack()
        server.route(PartialList, handler)
        await server.start()
        client = t.client(server.address)
        try:
            with pytest.raises(RemoteError) as err:
                await client.call(big(40), timeout=20)        # 40 parts of 1 MiB: each under max_msg
            ok = await client.call(big(2), timeout=20)         # the connection still serves
            return err.value, ok, seen, server.dispatcher.stats
        finally:
            await t.close()
    err, ok, seen, stats = asyncio.run(go())
    assert err.code == "bad_request" and "exceeds the limit of 16777216" in err.message, err
    assert isinstance(ok, Ack) and seen == [2 * MIB] and stats["too_large"] == 1


def test_a_connection_gets_busy_past_its_bytes_in_flight_and_others_do_not():
    async def go():
        t = ZmqTransport("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", None, max_msg=4 * MIB)  # 16 MiB a peer
        server = t.server("tcp://127.0.0.1:0", "echo", "0")
        release, started = asyncio.Event(), []
        reached = {2: asyncio.Event(), 3: asyncio.Event()}  # that many requests are being handled

        async def handler(req):
            started.append(1)
            if len(started) in reached:
                reached[len(started)].set()
            await release.wait()
            return Ack()
        server.route(PartialList, handler)
        await server.start()
        one, other = t.client(server.address), t.client(server.address)
        try:
            first = [asyncio.create_task(one.call(big(6), timeout=20)) for _ in range(2)]  # 12 MiB in flight
            await reached[2].wait()
            with pytest.raises(RemoteError) as err:
                await one.call(big(6), timeout=20)               # would be 18 MiB: refused
            elsewhere = asyncio.create_task(other.call(big(6), timeout=20))  # another connection: its own bound
            await reached[3].wait()
            release.set()
            done = await asyncio.gather(*first, elsewhere)
            after = await one.call(big(6), timeout=20)           # freed once answered
            return err.value, done, after
        finally:
            await t.close()
    err, done, after = asyncio.run(go())
    assert err.code == "busy" and "in flight" in err.message, err
    assert all(isinstance(d, Ack) for d in done) and isinstance(after, Ack)
