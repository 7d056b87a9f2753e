"""ZeroMQ implementation of Transport: one asyncio context per process, CURVE when keyed."""
from __future__ import annotations

from collections.abc import Iterable

import zmq
import zmq.asyncio
from laminar.bus import auth as _auth
from laminar.bus.pubsub import ZmqPublisher, ZmqSubscriber
from laminar.bus.rpc import ZmqRpcClient, ZmqRpcServer
from laminar.bus.transport import Publisher, RpcClient, RpcServer, Subscriber, Transport


class ZmqTransport(Transport):
    """`pub_address`: the broker's XSUB endpoint; `sub_address`: its XPUB endpoint."""

    def __init__(self, pub_address: str, sub_address: str, keys: _auth.CurveKeys | None = None,
                 hwm: int = 10000, linger_ms: int = 200, max_msg: int = 64 << 20):
        self.pub_address, self.sub_address, self.keys = pub_address, sub_address, keys
        self.hwm, self.linger_ms, self.max_msg = hwm, linger_ms, max_msg
        self.ctx = zmq.asyncio.Context()
        self.sync_ctx = zmq.Context.shadow(self.ctx.underlying)
        self._auth = None
        self._closables: list = []

    def _ensure_auth(self) -> None:
        if self.keys is not None and self._auth is None:
            self._auth = _auth.start_authenticator(self.ctx, self.keys)

    def publisher(self) -> Publisher:
        p = ZmqPublisher(self.sync_ctx, self.pub_address, self.keys, self.hwm, self.linger_ms)
        self._closables.append(p)
        return p

    def subscriber(self, topics: Iterable[str]) -> Subscriber:
        s = ZmqSubscriber(self.ctx, self.sub_address, topics, self.keys, self.hwm, self.max_msg)
        self._closables.append(s)
        return s

    def server(self, address: str, role: str, id: str, max_inflight: int = 256) -> RpcServer:
        self._ensure_auth()
        s = ZmqRpcServer(self.ctx, address, role, id, self.keys, max_inflight, self.hwm,
                         self.linger_ms, self.max_msg)
        self._closables.append(s)
        return s

    def client(self, address: str) -> RpcClient:
        c = ZmqRpcClient(self.ctx, address, self.keys, self.hwm, 0, self.max_msg)
        self._closables.append(c)
        return c

    async def close(self) -> None:
        for c in reversed(self._closables):
            r = c.close()
            if hasattr(r, "__await__"):
                await r
        self._closables.clear()
        if self._auth is not None:
            self._auth.stop()
        self.ctx.destroy(linger=0)
