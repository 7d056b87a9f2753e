"""Receiving a multipart ZeroMQ message without trusting its frame count or its total size.

`recv_multipart` turns every part into a Python object before anyone can look at the count, so a
peer sending a million empty parts costs a million objects. `BoundedReceiver` takes the first part
asynchronously (all parts of a message arrive together, so the rest are then ready), keeps at most
`max_frames` parts and at most `max_bytes` in all, and drains the remainder without copying it
(zero-copy frames, released at once). The size of each part is bounded by the socket's MAXMSGSIZE,
which every bus socket sets; libzmq itself holds the whole message before its first part is
readable, which no receiver can prevent (docs/security.md).
"""
from __future__ import annotations

import zmq
import zmq.asyncio
from laminar.bus.loopsock import LoopSocket


class BoundedReceiver:
    """Reads one multipart message at a time, keeping at most `max_frames` parts and `max_bytes`."""

    def __init__(self, sock: zmq.asyncio.Socket | LoopSocket, max_frames: int, max_bytes: int | None = None):
        self.sock, self.max_frames, self.max_bytes = sock, max_frames, max_bytes
        if isinstance(sock, LoopSocket):  # bus/loopsock.py: awaits only its first part
            self._sync, self._first, self._settle = sock, sock.arecv, sock.settle
        else:
            self._sync = zmq.Socket.shadow(sock.underlying)  # the message's remaining parts: no awaiting
            self._first, self._settle = sock.recv, None
        self.oversized = 0  # messages cut short (their caller drops them)
        self.why = ""       # why the last message was cut short ("" = it was not)

    async def recv(self) -> tuple[list[bytes], bool]:
        """(frames, complete): complete is False when parts beyond max_frames were discarded."""
        return self._rest([await self._first()])

    def _rest(self, frames: list[bytes]) -> tuple[list[bytes], bool]:
        """The message's remaining parts after its first (already in `frames`), bounded."""
        extra, size = 0, sum(len(f) for f in frames)
        limit = self.max_bytes if self.max_bytes is not None else float("inf")
        while self._sync.getsockopt(zmq.RCVMORE):
            part = self._sync.recv(zmq.NOBLOCK, copy=False)
            size += len(part)
            if not extra and len(frames) < self.max_frames and size <= limit:
                frames.append(part.bytes)
            else:
                extra += 1
        if self._settle is not None:
            self._settle()
        self.why = ""
        if extra:
            self.oversized += 1
            self.why = (f"message of {size} bytes in {len(frames) + extra} parts exceeds the limit of "
                        f"{self.max_bytes} bytes" if size > limit else
                        f"message of {len(frames) + extra} parts exceeds the limit of {self.max_frames}")
        return frames, not extra
