"""The small interface every role talks to; two implementations (ZeroMQ, in-process).

    pub = transport.publisher();        pub.publish("hb.rollout.0", Heartbeat(...))
    sub = transport.subscriber(["hb."]);  topic, ev = await sub.recv()
    srv = transport.server(addr, "prompt_pool", "0"); srv.route(TakeBatch, handler); await srv.start()
    cli = transport.client(addr);        reply = await cli.call(TakeBatch(...), timeout=2.0)

Semantics shared by both implementations (and tested against both):
- publish never blocks; beyond the high-water mark a message is dropped and counted;
- a subscriber gets events whose topic starts with one of its prefixes; bad frames are counted
  (`dropped`) and skipped;
- `call` returns the reply event or raises: DeadlineExceeded (no reply in time), PeerUnavailable
  (disconnected / handshake failed), RemoteError subclasses for typed error replies.
"""
from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from laminar.protocol import PROTOCOL_VERSION, Hello

Handler = Callable[[Any], Awaitable[Any]]


class Publisher(abc.ABC):
    sent = 0
    dropped = 0

    @abc.abstractmethod
    def publish(self, topic: str, ev: Any) -> bool: ...

    @abc.abstractmethod
    def close(self) -> None: ...


class Subscriber(abc.ABC):
    dropped = 0  # malformed / unknown / wrong-version frames seen and skipped

    @abc.abstractmethod
    async def recv(self) -> tuple[str, Any]: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[str, Any]:
        return await self.recv()


class RpcServer(abc.ABC):
    address: str

    def __init__(self, role: str, id: str, max_inflight: int = 256):
        from laminar.bus.rpc import Dispatcher  # late: rpc imports this module's Handler (a cycle)
        self.dispatcher = Dispatcher(role, id, max_inflight)

    def route(self, cls: type, handler: Handler) -> None:
        self.dispatcher.route(cls, handler)

    @property
    def stats(self) -> dict[str, int]:
        return dict(self.dispatcher.stats)

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...


class RpcClient(abc.ABC):
    address: str

    @abc.abstractmethod
    async def call(self, req: Any, timeout: float = 5.0) -> Any: ...

    async def hello(self, role: str, id: str, timeout: float = 5.0) -> Any:
        """Protocol handshake; raises RemoteError('protocol_mismatch') naming both versions."""
        return await self.call(Hello(protocol=PROTOCOL_VERSION, role=role, id=id), timeout=timeout)

    @abc.abstractmethod
    def close(self) -> None: ...


class Transport(abc.ABC):
    @abc.abstractmethod
    def publisher(self) -> Publisher: ...

    @abc.abstractmethod
    def subscriber(self, topics: Iterable[str]) -> Subscriber: ...

    @abc.abstractmethod
    def server(self, address: str, role: str, id: str, max_inflight: int = 256) -> RpcServer: ...

    @abc.abstractmethod
    def client(self, address: str) -> RpcClient: ...

    @abc.abstractmethod
    async def close(self) -> None: ...
