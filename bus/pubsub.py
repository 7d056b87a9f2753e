"""ZeroMQ publish/subscribe through the broker: PUB connects to the broker's XSUB, SUB to its XPUB.

Frames: [topic, kind, body, *buffers]. Topics are dotted prefixes (docs/architecture.md §3). Publishing never
blocks: a PUB socket at its high-water mark drops, silently (libzmq does not report it, so
`dropped` counts only a send the socket refuses outright, which is rare); that is why only
superseded state travels here.

Identity: the broker lets a key publish only its own topics (`auth.topic_refusal`); the
subscriber drops (as a bad frame) an event whose body names another role than its topic
(`auth.body_refusal`), so a heartbeat or statistics naming someone else never reach a receiver.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import structlog
import zmq
import zmq.asyncio
from laminar.bus import auth as _auth
from laminar.bus.codec import MAX_FRAMES, decode, encode
from laminar.bus.errors import CodecError
from laminar.bus.frames import BoundedReceiver
from laminar.bus.transport import Publisher, Subscriber

log = structlog.get_logger("laminar.bus.pubsub")
# What a publisher receives is only subscriptions forwarded by the broker (0x01 + topic prefix).
MAX_SUBSCRIPTION_BYTES = 4096


class ZmqPublisher(Publisher):
    def __init__(self, ctx: zmq.Context, address: str, keys, hwm: int = 10000, linger_ms: int = 200):
        # A plain (sync) socket on a shadow of the transport's context: send with NOBLOCK is an
        # ordinary call usable from any code path on the loop thread, logging processors included.
        self.sock = ctx.socket(zmq.PUB)
        self.sock.sndhwm = hwm
        self.sock.linger = linger_ms
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_SUBSCRIPTION_BYTES)
        _auth.make_client(self.sock, keys)
        self.sock.connect(address)
        self.sent = self.dropped = 0

    def publish(self, topic: str, ev: Any) -> bool:
        try:
            self.sock.send_multipart([topic.encode(), *encode(ev)], flags=zmq.NOBLOCK, copy=True)
        except zmq.Again:
            self.dropped += 1
            return False
        self.sent += 1
        return True

    def close(self) -> None:
        self.sock.close()


class ZmqSubscriber(Subscriber):
    def __init__(self, ctx: zmq.asyncio.Context, address: str, topics: Iterable[str], keys,
                 hwm: int = 10000, max_msg: int = 64 << 20):
        sock = ctx.socket(zmq.SUB)
        sock.rcvhwm = hwm
        sock.linger = 0
        sock.setsockopt(zmq.MAXMSGSIZE, max_msg)  # a larger frame drops the connection (it reconnects)
        _auth.make_client(sock, keys)
        for t in topics:
            sock.setsockopt(zmq.SUBSCRIBE, t.encode())
        sock.connect(address)
        self.sock = sock
        self._recv = BoundedReceiver(sock, MAX_FRAMES + 1)
        self.dropped = 0

    async def recv(self) -> tuple[str, Any]:
        while True:
            frames, complete = await self._recv.recv()
            try:
                if not complete:
                    raise CodecError(f"more than {MAX_FRAMES} frames: dropped unread")
                topic = frames[0].decode("utf-8")
                ev, _ = decode(frames[1:])
                if why := _auth.body_refusal(topic, ev):  # the body names another role than its topic
                    raise CodecError(f"forged identity: {why}")
            except (CodecError, UnicodeDecodeError) as exc:
                self.dropped += 1
                if self.dropped & (self.dropped - 1) == 0:  # log 1st, 2nd, 4th, 8th... occurrence
                    log.warning("bad_frame_dropped", error=str(exc), dropped=self.dropped)
                continue
            return topic, ev

    def close(self) -> None:
        self.sock.close()
