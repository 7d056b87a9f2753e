"""An RPC client's background loops are owned: if its receive loop stops while the client is still
in use (here: its socket closed under it), the failure is logged and every pending and later call
fails at once with PeerUnavailable naming it, instead of each waiting out its deadline."""
from __future__ import annotations

import asyncio

import pytest
from laminar.bus.errors import DeadlineExceeded, PeerUnavailable
from laminar.bus.zmq_transport import ZmqTransport

from laminar.protocol import MasterInfo, MasterQuery

pytestmark = pytest.mark.timeout(60)


def test_a_stopped_receive_loop_fails_pending_and_later_calls():
    async def go():
        t = ZmqTransport("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", None)
        released = asyncio.Event()
        server = t.server("tcp://127.0.0.1:0", "manager", "0")

        async def master(req):
            await released.wait()
            return MasterInfo(1, "r0", "tcp://127.0.0.1:7000")
        server.route(MasterQuery, master)
        await server.start()
        client = t.client(server.address)
        try:
            released.set()
            assert (await client.call(MasterQuery(), timeout=10)).relay_id == "r0"
            released.clear()
            pending = asyncio.create_task(client.call(MasterQuery(), timeout=20))
            while not client.pending:  # the request is out, its reply not yet
                await asyncio.sleep(0.01)
            client.sock.close(linger=0)
            with pytest.raises(PeerUnavailable) as got:
                await pending
            assert not isinstance(got.value, DeadlineExceeded) and "loop stopped" in str(got.value)
            with pytest.raises(PeerUnavailable, match="loop stopped"):
                await client.call(MasterQuery(), timeout=20)
        finally:
            released.set()
            await t.close()
    asyncio.run(go())
