"""Chunk transports that misbehave on purpose, selected by name ("laminar.testing.transports:X").

FlipOnceTcp   flips one byte of the payload of chosen CHUNK messages on the wire, once each (the
              sender's own buffer is untouched: the copy that goes out is corrupted), to show the
              receiver detects it by its digest and the chunk is sent again.
WrappedConn   a TcpConn passed through unchanged: subclass it to rewrite some messages.
ThrottledTcp  paces sends to `rate_mbps` so a test can act while a broadcast is in flight (for
              example kill a relay half-way) without racing loopback speed. Pacing is bandwidth
              emulation, not synchronization: nothing waits for a peer through it.
"""
from __future__ import annotations

import os
import threading
import time

from laminar.weights import wire
from laminar.weights.transport import Conn
from laminar.weights.transport.tcp import TcpConn, TcpTransport


class WrappedConn(Conn):
    def __init__(self, inner: TcpConn):
        self.inner, self.peer = inner, inner.peer

    def set_handshake_timeout(self, seconds):
        self.inner.set_handshake_timeout(seconds)

    def recv_header(self, size):
        return self.inner.recv_header(size)

    def recv_into(self, view):
        self.inner.recv_into(view)

    def close(self):
        self.inner.close()

    def send(self, header, payload=None):
        self.inner.send(header, payload)


class _FlipConn(WrappedConn):
    def __init__(self, inner, owner: FlipOnceTcp):
        super().__init__(inner)
        self.owner = owner

    def send(self, header, payload=None):
        h = wire.unpack(header)
        if h.type == wire.CHUNK and payload is not None and self.owner.should_flip(h.version, h.a):
            bad = bytearray(payload)
            bad[len(bad) // 2] ^= 0xFF
            payload = bad
        self.inner.send(header, payload)


class FlipOnceTcp(TcpTransport):
    """Corrupt chunk `chunk` (env LAMINAR_FLIP_CHUNK, default 1) of every version, once each."""

    def __init__(self, chunk: int | None = None, **kw):
        super().__init__(**kw)
        self.chunk = int(os.environ.get("LAMINAR_FLIP_CHUNK", "1")) if chunk is None else chunk
        self.flipped: set[tuple[int, int]] = set()
        self.lock = threading.Lock()

    def should_flip(self, version: int, index: int) -> bool:
        with self.lock:
            if index != self.chunk or (version, index) in self.flipped:
                return False
            self.flipped.add((version, index))
            return True

    def connect(self, address, timeout):
        return _FlipConn(super().connect(address, timeout), self)


class _PacedConn(WrappedConn):
    def __init__(self, inner, rate_bps: float):
        super().__init__(inner)
        self.rate_bps, self.next_free = rate_bps, time.monotonic()

    def send(self, header, payload=None):
        self.inner.send(header, payload)
        if payload is not None:
            now = time.monotonic()
            self.next_free = max(self.next_free, now) + len(payload) / self.rate_bps
            delay = self.next_free - time.monotonic()
            if delay > 0:
                time.sleep(delay)  # bandwidth emulation (see module docstring)


class ThrottledTcp(TcpTransport):
    def __init__(self, rate_mbps: float | None = None, **kw):
        super().__init__(**kw)
        rate = float(os.environ.get("LAMINAR_TEST_RATE_MBPS", "200")) if rate_mbps is None else rate_mbps
        self.rate_bps = rate * 1e6 / 8

    def connect(self, address, timeout):
        return _PacedConn(super().connect(address, timeout), self.rate_bps)
