"""In-process Transport: the same API over asyncio queues, for one-process clusters (tests, sim).

One `InprocHub` per simulated cluster; `hub.transport()` gives each role its own view. Events go
through the real codec by default (so anything that works here also serializes), which the
simulator may turn off for speed. Queue bounds stand in for high-water marks: a full subscriber
queue drops, exactly like a SUB socket at its HWM.

Scoped identities (`InprocHub(scoped=True)`, `hub.transport(identity="rollout.r0")`): what CURVE
with scoped keys gives over ZeroMQ (bus/auth.py), in one process. Every request a transport's
clients send carries its identity to the server, which refuses it as a scoped ZeroMQ server does
(`auth.request_refusal`) and hands the identity to the handler (`rpc.current_peer`); every
publication is checked at the hub as the broker checks it (`auth.topic_refusal`). So a whole
cluster, and a hostile key inside it, runs in one process with the same checks as over sockets.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any

from laminar.bus.auth import body_refusal, request_refusal, topic_refusal
from laminar.bus.codec import decode, encode
from laminar.bus.errors import DeadlineExceeded, PeerUnavailable, remote_error
from laminar.bus.transport import Publisher, RpcClient, RpcServer, Subscriber, Transport

from laminar.protocol import ErrorReply


class InprocHub:
    def __init__(self, hwm: int = 10000, codec: bool = True, scoped: bool = False):
        self.hwm, self.codec, self.scoped = hwm, codec, scoped
        self.publish_refused = 0  # publications the hub dropped as the scoped broker would (topic_refusal)
        self.subscribers: list[InprocSubscriber] = []
        self.servers: dict[str, InprocServer] = {}
        self._bound: dict[str, asyncio.Event] = {}

    def bound(self, address: str) -> asyncio.Event:
        """Set while a server listens on `address` (clients wait on it, as a DEALER would)."""
        return self._bound.setdefault(address, asyncio.Event())

    def transport(self, identity: str | None = None) -> InprocTransport:
        """A role's (or a tool's) view of the hub; `identity`: the key it acts as (scoped hubs)."""
        return InprocTransport(self, identity)

    def roundtrip(self, ev: Any, meta: dict | None = None) -> tuple[Any, dict]:
        if not self.codec:
            return ev, dict(meta or {})
        return decode([bytes(f) for f in encode(ev, meta)])


class InprocPublisher(Publisher):
    def __init__(self, hub: InprocHub, identity: str | None = None):
        self.hub, self.identity, self.sent, self.dropped = hub, identity, 0, 0

    def publish(self, topic: str, ev: Any) -> bool:
        if self.hub.scoped and topic_refusal(self.identity, topic.encode()):
            self.hub.publish_refused += 1  # dropped where the broker would drop it
            return True                    # a ZeroMQ publisher does not learn of it either
        ok = True
        for sub in self.hub.subscribers:
            if any(topic.startswith(p) for p in sub.topics):
                ev2, _ = self.hub.roundtrip(ev)
                try:
                    sub.queue.put_nowait((topic, ev2))
                except asyncio.QueueFull:
                    ok = False
        self.sent += ok
        self.dropped += not ok
        return ok

    def close(self) -> None:
        pass


class InprocSubscriber(Subscriber):
    def __init__(self, hub: InprocHub, topics: Iterable[str]):
        self.hub, self.topics = hub, list(topics)
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=hub.hwm)
        self.dropped = 0
        hub.subscribers.append(self)

    async def recv(self) -> tuple[str, Any]:
        while True:  # the same identity check as over ZeroMQ (auth.body_refusal)
            topic, ev = await self.queue.get()
            if not body_refusal(topic, ev):
                return topic, ev
            self.dropped += 1

    def close(self) -> None:
        if self in self.hub.subscribers:
            self.hub.subscribers.remove(self)


class InprocServer(RpcServer):
    def __init__(self, hub: InprocHub, address: str, role: str, id: str, max_inflight: int):
        super().__init__(role, id, max_inflight)
        self.hub, self.address = hub, address
        if hub.scoped:  # as a ZeroMQ server with scoped keys
            self.dispatcher.authorize = request_refusal
        self.calls: set[asyncio.Task] = set()

    def handle(self, req: Any, meta: dict, peer: str | None = None) -> asyncio.Task:
        """Run one request as the server's own task: it outlives a caller that gave up (as over
        ZeroMQ) and is cancelled by close(), which fails its caller with PeerUnavailable. `peer`:
        the caller's identity (scoped hubs)."""
        t = asyncio.create_task(self.dispatcher.handle(req, meta, None, peer), name=f"rpc:{type(req).kind}")
        self.calls.add(t)
        t.add_done_callback(self.calls.discard)
        return t

    async def start(self) -> None:
        if self.address in self.hub.servers:
            raise OSError(f"address {self.address} already in use")
        self.hub.servers[self.address] = self
        self.hub.bound(self.address).set()

    async def close(self) -> None:
        if self.hub.servers.get(self.address) is self:
            self.hub.servers.pop(self.address)
            self.hub.bound(self.address).clear()
        for t in self.calls:
            t.cancel()
        await asyncio.gather(*self.calls, return_exceptions=True)


class InprocClient(RpcClient):
    def __init__(self, hub: InprocHub, address: str, identity: str | None = None):
        self.hub, self.address, self.identity = hub, address, identity
        self._closed = False
        self._closing: asyncio.Future | None = None  # set by close(); every call waits on this one future

    async def call(self, req: Any, timeout: float = 5.0) -> Any:
        deadline = time.time() + timeout
        try:
            async with asyncio.timeout(timeout):
                await self.hub.bound(self.address).wait()  # like a DEALER with IMMEDIATE
                server = self.hub.servers[self.address]
                req2, meta = self.hub.roundtrip(req, {"dl": deadline})
                reply, _ = self.hub.roundtrip(await self._reply(server.handle(req2, meta, self.identity)))
        except TimeoutError:
            raise DeadlineExceeded(f"{type(req).kind} to {self.address}: no reply within {timeout:.3g}s") from None
        if isinstance(reply, ErrorReply):
            raise remote_error(reply.code, reply.message)
        return reply

    async def _reply(self, handling: asyncio.Task) -> Any:
        loop = asyncio.get_running_loop()
        if self._closing is None or self._closing.get_loop() is not loop:  # one future, not a task per call
            self._closing = loop.create_future()
            if self._closed:
                self._closing.set_result(None)
        await asyncio.wait([handling, self._closing], return_when=asyncio.FIRST_COMPLETED)
        if handling.done() and not handling.cancelled():
            return handling.result()
        why = "client closed" if self._closed else "server closed"
        raise PeerUnavailable(f"{self.address}: {why}")

    def close(self) -> None:
        self._closed = True
        if self._closing is not None and not self._closing.done():
            self._closing.set_result(None)


class InprocTransport(Transport):
    def __init__(self, hub: InprocHub, identity: str | None = None):
        self.hub, self.identity = hub, identity
        self._subs: list[InprocSubscriber] = []

    def publisher(self) -> Publisher:
        return InprocPublisher(self.hub, self.identity)

    def subscriber(self, topics: Iterable[str]) -> Subscriber:
        s = InprocSubscriber(self.hub, topics)
        self._subs.append(s)
        return s

    def server(self, address: str, role: str, id: str, max_inflight: int = 256) -> RpcServer:
        return InprocServer(self.hub, address, role, id, max_inflight)

    def client(self, address: str) -> RpcClient:
        return InprocClient(self.hub, address, self.identity)

    async def close(self) -> None:
        for s in self._subs:
            s.close()


__all__ = ["InprocHub", "InprocTransport", "PeerUnavailable"]
