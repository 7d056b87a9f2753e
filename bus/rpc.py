"""Request/reply: the dispatcher (shared by both transports) and the ZeroMQ ROUTER/DEALER pair.

Envelope meta: `rid` request id (unique per client), `st` the caller's clock when it sent the
request, `to` its timeout in seconds, and `dl` = st + to (kept for servers that only know `dl`).
A server skips a request that sat in a queue long after its caller gave up and answers
`deadline`. It never compares the two hosts' clocks: per caller connection it keeps the smallest
`arrival - st` seen lately (skew plus the quickest transit; the minimum over two rotating windows
of FLOOR_WINDOW_S), and a request is late when its own `arrival - st` exceeds that floor by more
than its timeout plus LATE_GRACE_S. The skew cancels out, so hosts whose clocks disagree by any
amount are served; a caller whose clock steps backwards by more than timeout + grace sees at most
two windows of refusals (each naming the measurement). A request with only `dl` (an older client)
gets the old check, tolerant of LEGACY_GRACE_S of skew.
Backpressure contract: a server runs at most `max_inflight` handlers at once; beyond that it
answers `busy` at once instead of queueing. A client's pending calls are bounded by the caller's
own concurrency; each has a deadline and fails with DeadlineExceeded. A disconnect or failed CURVE
handshake seen by the client's socket monitor fails every pending call with PeerUnavailable.
Scopes: with scoped keys (bus/auth.py) the server reads the CURVE identity ZeroMQ attaches to each
request (`User-Id`) and refuses, with `refused` and a log line, what that key's scope may not send
(`auth.request_refusal`: e.g. a rollout key joining the relay chain or writing another rollout's
trajectories).
"""
from __future__ import annotations

import asyncio
import contextvars
import itertools
import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

import structlog
import zmq
import zmq.asyncio
from laminar.bus import auth as _auth
from laminar.bus.codec import MAX_FRAMES, decode, encode
from laminar.bus.errors import CodecError, DeadlineExceeded, PeerUnavailable, ProtocolMismatch, remote_error
from laminar.bus.frames import BoundedReceiver
from laminar.bus.loopsock import LoopSocket
from laminar.bus.transport import Handler, RpcClient, RpcServer
from zmq.utils.monitor import recv_monitor_message

from laminar.protocol import PROTOCOL_VERSION, ErrorReply, Hello, Welcome

log = structlog.get_logger("laminar.bus.rpc")
LATE_GRACE_S = 5.0      # beyond the caller's timeout, measured against its own quickest requests
LEGACY_GRACE_S = 30.0   # for an envelope with an absolute deadline only (compares two clocks)
FLOOR_WINDOW_S = 60.0
MAX_CALLERS = 4096      # callers whose floor is remembered (the least recent is forgotten)
# the key identity (CURVE User-Id, bus/auth.py) of the request a handler is serving; None without
# scoped keys. A handler that must check ownership reads it (the partial pool's CompletePartial).
current_peer: contextvars.ContextVar[str | None] = contextvars.ContextVar("current_peer", default=None)


_WALL_AT_START = time.time() - time.monotonic()


def steady_time() -> float:
    """The wall clock as read at start, advanced by the monotonic clock: what a request's send time
    and its arrival are stamped with. A step of the system clock (an NTP correction, an operator's
    `date -s`) moves neither, so a server whose clock jumped forward, or a caller whose clock
    jumped back, is not taken for a queue that held every request (before, such a step refused
    everyone as late for about two minutes). Slews keep it within a few ms/hour of the wall clock."""
    return _WALL_AT_START + time.monotonic()


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class ArrivalFloor:
    """Per caller, the smallest `arrival - sent` of its recent requests (clock skew + quickest transit)."""

    def __init__(self):
        self.callers: OrderedDict[Any, list[float]] = OrderedDict()  # key -> [current, previous, window start]

    def delay(self, caller: Any, offset: float, now_mono: float) -> float:
        """How much longer than this caller's quickest recent request this one took to arrive."""
        w = self.callers.get(caller)
        if w is None:
            w = self.callers[caller] = [offset, math.inf, now_mono]
            if len(self.callers) > MAX_CALLERS:
                self.callers.popitem(last=False)
        else:
            self.callers.move_to_end(caller)
            if now_mono - w[2] > FLOOR_WINDOW_S:
                w[:] = [math.inf, w[0], now_mono]
        floor = min(w[0], w[1], offset)
        w[0] = min(w[0], offset)
        return offset - floor


class RequestError(Exception):
    """Raise from a handler to send a typed ErrorReply (code from protocol.ERROR_CODES)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class Dispatcher:
    """Routes a decoded request to its handler; enforces deadline and in-flight limit."""

    def __init__(self, role: str, id: str, max_inflight: int):
        self.role, self.id, self.max_inflight = role, id, max_inflight
        self.handlers: dict[type, Handler] = {}
        self.inflight = 0
        self.stats: Counter[str] = Counter()
        self.floor = ArrivalFloor()
        # (identity, request) -> why it is refused ("" = allowed); set by a server with scoped keys
        self.authorize: Callable[[str | None, Any], str] | None = None

    def late(self, req: Any, meta: dict, caller: Any) -> str:
        """Why `req` is too late to be worth running ("" when it is not)."""
        st, to = meta.get("st"), meta.get("to")
        if _number(st) and _number(to):
            delay = self.floor.delay(caller, steady_time() - st, time.monotonic())
            if delay > to + LATE_GRACE_S:
                return (f"{type(req).kind} arrived {delay:.1f} s later than this caller's quickest recent request "
                        f"(its timeout: {to:.3g} s): it sat in a queue after its caller gave up")
            return ""
        dl = meta.get("dl")
        now = time.time()  # an absolute deadline from another host: only its wall clock compares
        if _number(dl) and now > dl + LEGACY_GRACE_S:
            return (f"{type(req).kind} arrived {now - dl:.1f} s after its deadline (this server's clock {now:.3f}, "
                    f"the caller's deadline {dl:.3f}: if the request was fresh, the two hosts' clocks disagree; "
                    "sync them, e.g. with NTP, or update the caller, whose envelope has no send time)")
        return ""

    def route(self, cls: type, handler: Handler) -> None:
        self.handlers[cls] = handler

    async def handle(self, req: Any, meta: dict, caller: Any = None, peer: str | None = None) -> Any:
        """`caller`: what identifies the sending connection (the ROUTER identity), for lateness;
        `peer`: the sender's key identity (CURVE User-Id), for `authorize`."""
        self.stats["requests"] += 1
        why = self.late(req, meta, caller)
        if why:
            self.stats["late"] += 1
            return ErrorReply("deadline", why)
        if isinstance(req, Hello):
            if req.protocol != PROTOCOL_VERSION:  # cannot happen after decode, kept for inproc
                return ErrorReply("protocol_mismatch", str(ProtocolMismatch(req.protocol, PROTOCOL_VERSION)))
            return Welcome(protocol=PROTOCOL_VERSION, role=self.role, id=self.id)
        why = self.authorize(peer, req) if self.authorize is not None else ""
        if why:
            self.stats["forbidden"] += 1
            log.warning("request_refused", role=self.role, id=self.id, kind=type(req).kind, peer=peer, why=why)
            return ErrorReply("refused", f"forbidden: {why}")
        handler = self.handlers.get(type(req))
        if handler is None:
            self.stats["unknown_kind"] += 1
            return ErrorReply("unknown_kind", f"{self.role}.{self.id} has no handler for {type(req).kind!r}")
        if self.inflight >= self.max_inflight:
            self.stats["busy"] += 1
            return ErrorReply("busy", f"{self.role}.{self.id} has {self.inflight} requests in flight")
        self.inflight += 1
        token = current_peer.set(peer)
        try:
            return await handler(req)
        except RequestError as exc:
            self.stats["refused"] += 1
            return ErrorReply(exc.code, exc.message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.stats["internal"] += 1
            log.exception("handler_failed", role=self.role, id=self.id, kind=type(req).kind)
            return ErrorReply("internal", f"{type(exc).__name__}: {exc}")
        finally:
            current_peer.reset(token)
            self.inflight -= 1

    def codec_error_reply(self, exc: CodecError) -> ErrorReply:
        self.stats["bad_frames"] += 1
        code = "protocol_mismatch" if isinstance(exc, ProtocolMismatch) else "bad_request"
        return ErrorReply(code, str(exc))


REQUEST_MSGS = 4  # a whole request, and one connection's requests in flight: at most this many max_msg


def _set_common(sock: zmq.Socket, hwm: int, linger_ms: int, max_msg: int) -> None:
    sock.sndhwm = hwm
    sock.rcvhwm = hwm
    sock.linger = linger_ms
    sock.setsockopt(zmq.MAXMSGSIZE, max_msg)


class _IdentifiedReceiver(BoundedReceiver):
    """A BoundedReceiver that also notes the CURVE identity of each message (`user_id`)."""

    async def recv(self) -> tuple[list[bytes], bool]:
        first = await self._first(copy=False)
        try:
            self.user_id = first.get("User-Id")
        except zmq.ZMQError:  # no ZAP identity on this message
            self.user_id = None
        return self._rest([first.bytes])


class ZmqRpcServer(RpcServer):
    def __init__(self, ctx: zmq.asyncio.Context, address: str, role: str, id: str, keys,
                 max_inflight: int = 256, hwm: int = 10000, linger_ms: int = 200,
                 max_msg: int = 64 << 20, max_request_bytes: int | None = None, max_peer_bytes: int | None = None):
        super().__init__(role, id, max_inflight)
        self.ctx, self.address, self.keys = ctx, address, keys
        self._opts = (hwm, linger_ms, max_msg)
        # a whole request (every part), and one connection's requests being handled, at most
        # REQUEST_MSGS x max_msg each unless given (docs/security.md, Size limits)
        self.max_request_bytes = max_request_bytes or REQUEST_MSGS * max_msg
        self.max_peer_bytes = max_peer_bytes or REQUEST_MSGS * max_msg
        self._peer_bytes: dict[bytes, int] = {}  # connection (ROUTER identity) -> bytes of its requests in flight
        self.sock: LoopSocket | None = None
        self._loop_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._closing = False

    async def start(self) -> None:
        sock = self.ctx.socket(zmq.ROUTER, socket_class=LoopSocket)
        _set_common(sock, *self._opts)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        _auth.make_server(sock, self.keys)
        sock.bind(self.address)
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.sock = sock
        self._loop_task = asyncio.create_task(self._serve(), name=f"rpc-server:{self.address}")
        self._loop_task.add_done_callback(self._serve_ended)

    def _serve_ended(self, task: asyncio.Task) -> None:
        """The serve loop lives until close(): one that stops before it is logged (its callers then
        time out; the role's heartbeat still says alive, so this line is how an operator finds it)."""
        if self._closing:
            return
        exc = None if task.cancelled() else task.exception()
        log.error("rpc_server_loop_failed", role=self.dispatcher.role, id=self.dispatcher.id, address=self.address,
                  error=repr(exc) if exc else "cancelled")

    async def _serve(self) -> None:
        assert self.sock is not None
        scoped = self.keys is not None and getattr(self.keys, "scoped", False)
        if scoped:
            self.dispatcher.authorize = _auth.request_refusal
        receiver = (_IdentifiedReceiver if scoped else BoundedReceiver)(  # + identity frame
            self.sock, MAX_FRAMES + 1, self.max_request_bytes)
        while True:
            frames, complete = await receiver.recv()
            peer = receiver.user_id if scoped else None
            if len(frames) < 2 or not complete:
                self.dispatcher.stats["bad_frames"] += 1
                if len(frames) >= 3 and receiver.why:  # answer it, if the part naming its id was kept
                    await self._refuse_unread(frames[0], frames[1:], receiver.why)
                continue
            ident, rest = frames[0], frames[1:]
            size = sum(len(f) for f in rest)
            held = self._peer_bytes.get(ident, 0)
            if held and held + size > self.max_peer_bytes:  # one request at a time is always taken
                self.dispatcher.stats["peer_busy"] += 1
                await self._refuse_unread(ident, rest, f"this connection has {held} bytes of requests in flight; "
                                          f"{size} more exceed the limit of {self.max_peer_bytes}", "busy")
                continue
            try:
                req, meta = decode(rest)
            except CodecError as exc:
                reply = self.dispatcher.codec_error_reply(exc)
                rid = (exc.meta or {}).get("rid")
                if rid is not None:
                    await self._send(ident, reply, rid)
                continue
            self._peer_bytes[ident] = held + size
            t = asyncio.create_task(self._one(ident, req, meta, peer, size), name=f"rpc:{type(req).kind}")
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def _refuse_unread(self, ident: bytes, frames: list[bytes], why: str, code: str = "bad_request") -> None:
        """Answer a request that is not handled (too large, or its connection holds too much) with
        `code`, if its id can be read from the parts kept; logged either way."""
        if code == "bad_request":
            self.dispatcher.stats["too_large"] += 1
        log.warning("request_refused_unread", role=self.dispatcher.role, id=self.dispatcher.id, why=why)
        try:
            _, meta = decode(frames)
        except CodecError as exc:
            meta = exc.meta or {}
        if meta.get("rid") is not None:
            await self._send(ident, ErrorReply(code, why), meta["rid"])

    async def _one(self, ident: bytes, req: Any, meta: dict, peer: str | None = None, size: int = 0) -> None:
        try:
            reply = await self.dispatcher.handle(req, meta, ident, peer)
            await self._send(ident, reply, meta.get("rid"))
        finally:
            left = self._peer_bytes.get(ident, 0) - size
            if left > 0:
                self._peer_bytes[ident] = left
            else:
                self._peer_bytes.pop(ident, None)

    async def _send(self, ident: bytes, reply: Any, rid: Any) -> None:
        try:
            frames = encode(reply, {"rid": rid})
        except Exception as exc:  # a handler returned what the codec refuses: the caller still gets an answer
            self.dispatcher.stats["internal"] += 1
            log.error("reply_unencodable", role=self.dispatcher.role, id=self.dispatcher.id,
                      reply=type(reply).__name__, error=repr(exc))
            frames = encode(ErrorReply("internal", f"the reply could not be encoded: {exc!r}"), {"rid": rid})
        try:
            await self.sock.asend([ident, *frames])
        except zmq.ZMQError as exc:  # peer gone (ROUTER_MANDATORY) or shutting down
            self.dispatcher.stats["reply_undeliverable"] += 1
            log.debug("reply_undeliverable", error=str(exc))

    async def close(self) -> None:
        self._closing = True
        tasks = [t for t in [self._loop_task, *self._tasks] if t]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class ZmqRpcClient(RpcClient):
    _ids = itertools.count(1)

    def __init__(self, ctx: zmq.asyncio.Context, address: str, keys, hwm: int = 10000,
                 linger_ms: int = 0, max_msg: int = 64 << 20):
        self.address = address
        sock = ctx.socket(zmq.DEALER, socket_class=LoopSocket)
        _set_common(sock, hwm, linger_ms, max_msg)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue requests towards a peer not connected
        _auth.make_client(sock, keys)
        self._monitor = sock.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sock.connect(address)
        self.sock = sock
        self.pending: dict[int, asyncio.Future] = {}
        self.last_failure: str | None = None
        self.late_replies = self.bad_replies = 0
        self.failed: str | None = None  # why a background loop stopped before close(); calls then fail at once
        self._closing = False
        self._tasks = [asyncio.ensure_future(self._recv_loop()), asyncio.ensure_future(self._monitor_loop())]
        for t, name in zip(self._tasks, ("receive", "monitor"), strict=True):
            t.set_name(f"rpc-client-{name}:{address}")
            t.add_done_callback(lambda t, name=name: self._loop_ended(name, t))

    def _loop_ended(self, name: str, task: asyncio.Task) -> None:
        """Both loops live as long as the client: one that stops before close() (its socket closed
        under it, a bug) is logged and fails every pending call, and every later one, at once."""
        if self._closing:
            return
        exc = None if task.cancelled() else task.exception()
        self.failed = f"{name} loop stopped ({exc!r})" if exc else f"{name} loop stopped"
        log.error("rpc_client_loop_failed", address=self.address, loop=name, error=repr(exc) if exc else "cancelled")
        for fut in list(self.pending.values()):
            if not fut.done():
                fut.set_exception(PeerUnavailable(f"{self.address}: client {self.failed}"))

    async def call(self, req: Any, timeout: float = 5.0) -> Any:
        if self.failed:
            raise PeerUnavailable(f"{self.address}: client {self.failed}")
        rid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self.pending[rid] = fut
        sent = steady_time()
        try:
            frames = encode(req, {"rid": rid, "dl": sent + timeout, "st": sent, "to": float(timeout)})
            async with asyncio.timeout(timeout):
                await self.sock.asend(frames, copy=len(frames) < 3)
                reply = await fut
        except TimeoutError:
            why = f" (last connection failure: {self.last_failure})" if self.last_failure else ""
            raise DeadlineExceeded(f"{type(req).kind} to {self.address}: no reply within {timeout:.3g}s{why}") from None
        finally:
            fut = self.pending.pop(rid, None)
            if fut is not None and fut.done() and not fut.cancelled():
                fut.exception()  # failed by the monitor while the send was blocked: retrieved, not leaked
        if isinstance(reply, ErrorReply):
            raise remote_error(reply.code, reply.message)
        return reply

    async def _recv_loop(self) -> None:
        receiver = BoundedReceiver(self.sock, MAX_FRAMES)
        while True:
            frames, complete = await receiver.recv()
            if not complete:
                self.bad_replies += 1  # more frames than any reply has: its caller times out
                continue
            try:
                reply, meta = decode(frames)
            except CodecError as exc:
                code = "protocol_mismatch" if isinstance(exc, ProtocolMismatch) else "bad_request"
                reply, meta = ErrorReply(code, f"reply from {self.address}: {exc}"), exc.meta or {}
            rid = meta.get("rid")
            fut = self.pending.get(rid) if isinstance(rid, int) else None  # a peer's rid may be unhashable
            if fut is None or fut.done():
                self.late_replies += 1
                continue
            fut.set_result(reply)

    async def _monitor_loop(self) -> None:
        while True:
            msg = await recv_monitor_message(self._monitor)
            ev = msg["event"]
            if ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.last_failure = None
                continue
            if ev == zmq.EVENT_DISCONNECTED:
                reason = "peer disconnected"
            else:
                reason = "CURVE handshake refused (is this process using the cluster key?)"
            self.last_failure = reason
            for fut in list(self.pending.values()):
                if not fut.done():
                    fut.set_exception(PeerUnavailable(f"{self.address}: {reason}"))

    def close(self) -> None:
        if self._closing:  # closed by its owner, then again by the transport
            return
        self._closing = True
        for t in self._tasks:
            t.cancel()
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(PeerUnavailable(f"{self.address}: client closed"))
        if not self.sock.closed:
            self.sock.disable_monitor()
        self._monitor.close(linger=0)
        if not self.sock.closed:
            self.sock.close()
