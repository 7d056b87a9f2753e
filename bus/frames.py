"""Receiving a multipart ZeroMQ message without trusting its frame count.

`recv_multipart` turns every part into a Python object before anyone can look at the count, so a
peer sending a million empty parts costs a million objects. `BoundedReceiver` takes the first part
asynchronously (all parts of a message arrive together, so the rest are then ready), keeps at most
`max_frames` parts and drains the remainder without keeping it. The size of each part is bounded
by the socket's MAXMSGSIZE, which every bus socket sets.
"""
from __future__ import annotations

import zmq
import zmq.asyncio


class BoundedReceiver:
    def __init__(self, sock: zmq.asyncio.Socket, max_frames: int):
        self.sock, self.max_frames = sock, max_frames
        self._sync = zmq.Socket.shadow(sock.underlying)  # the message's remaining parts: no awaiting
        self.oversized = 0  # messages cut short (their caller drops them)

    async def recv(self) -> tuple[list[bytes], bool]:
        """(frames, complete): complete is False when parts beyond max_frames were discarded."""
        return self._rest([await self.sock.recv()])

    def _rest(self, frames: list[bytes]) -> tuple[list[bytes], bool]:
        """The message's remaining parts after its first (already in `frames`), bounded."""
        extra = 0
        while self._sync.getsockopt(zmq.RCVMORE):
            part = self._sync.recv(zmq.NOBLOCK)
            if len(frames) < self.max_frames:
                frames.append(part)
            else:
                extra += 1
        if extra:
            self.oversized += 1
        return frames, not extra
