"""A ZeroMQ socket driven from an asyncio loop without a future per operation.

zmq.asyncio gives every send and receive its own future, its own event-state bookkeeping and flag
arithmetic on Python enums; on the bus's request/reply path that machinery was about a third of a
call's CPU on each side (docs/benchmarks.md, "The bus's request/reply path"). `LoopSocket` is a
plain socket with one reader on its ZMQ_FD:

- every operation is first tried without blocking; only when it would block does the caller park,
  on a future, until the fd's reader wakes it;
- libzmq's fd signals when ZMQ_EVENTS may have changed, and reading ZMQ_EVENTS re-arms it, so the
  reader always reads ZMQ_EVENTS, and a caller parks only after ZMQ_EVENTS itself said the socket
  is not ready: no wake-up is lost between the try and the park;
- reading ZMQ_EVENTS, and any send or receive (they process the socket's commands), re-arms the
  fd for both directions, so whoever does either wakes the parked callers of both directions
  that the state now lets through (`_events`): a send may take an arrival's signal, a receive a
  connection's;
- close() (by the owner, or by the context's destroy) removes the reader and fails any parked
  caller with ZMQError(ENOTSOCK), as zmq.asyncio does with its futures.

One loop watches a socket at a time (the one that last had to park on it; a socket used from a
later loop moves there, as with zmq.asyncio). Any number of senders and
receivers may be parked (a client's concurrent calls before its peer connects); when the state
they wait for shows, all of them are woken and try again.
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.backend

_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_NOBLOCK = int(zmq.NOBLOCK)
_MORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK
PEER_FULL_RETRY_S = 0.001  # a send refused while the socket shows POLLOUT is tried again after this
# the socket's own send and receive, below pyzmq's Python layer (its checks and flag arithmetic on
# enums cost more than the call on a small message)
_send = zmq.backend.Socket.send
_recv = zmq.backend.Socket.recv


def _wake(waiters: list[asyncio.Future]) -> None:
    for fut in waiters:
        if not fut.done():
            fut.set_result(None)
    waiters.clear()


class LoopSocket(zmq.Socket):
    """Create with `ctx.socket(kind, socket_class=LoopSocket)` (so the context still closes it);
    `await arecv()` and `await asend()` from the loop that owns it."""

    _loop: asyncio.AbstractEventLoop | None = None
    _fd: int = -1
    _rwait: list[asyncio.Future] | None = None  # receivers parked until POLLIN
    _wwait: list[asyncio.Future] | None = None  # senders parked until POLLOUT

    def _attach(self) -> asyncio.AbstractEventLoop:
        """The running loop, watching the fd (moved from an earlier loop the socket was used on,
        as zmq.asyncio allows; that loop's parked callers cannot be woken from this one)."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._detach(zmq.ZMQError(zmq.ENOTSOCK, "the socket moved to another event loop"))
            self._loop, self._rwait, self._wwait = loop, [], []
            self._fd = self.get(zmq.FD)
            loop.add_reader(self._fd, self._on_fd)
        return loop

    def _detach(self, why: Exception) -> None:
        """Stop watching the fd on the loop that did, and fail whoever is parked there."""
        loop, self._loop = self._loop, None
        if loop is None:
            return
        if not loop.is_closed():
            try:
                loop.remove_reader(self._fd)
            except (RuntimeError, ValueError, OSError):  # another thread's loop, or the fd gone
                pass
        for waiters in (self._rwait or [], self._wwait or []):
            for fut in waiters:
                if not fut.done() and not fut.get_loop().is_closed():
                    fut.set_exception(why)
            waiters.clear()

    def _on_fd(self) -> None:
        if not self.closed:
            self._events()

    def _events(self) -> int:
        """ZMQ_EVENTS, waking whoever waits for what it shows. Reading it (and any send or receive,
        which process the socket's commands) re-arms the fd for both directions, so every reader
        of the state must wake both: a receive that looks first takes the signal a parked sender
        was waiting for, and the other way round."""
        events = self.get(_EVENTS)
        if events & _POLLIN and self._rwait:
            _wake(self._rwait)
        if events & _POLLOUT and self._wwait:
            _wake(self._wwait)
        return events

    def settle(self) -> None:
        """After a send or receive (a message's further parts included): wake whoever its command
        processing may have left unsignalled; nothing to do while nobody is parked."""
        if self._rwait or self._wwait:
            self._events()

    async def _park(self, flag: int) -> None:
        """Wait for the fd's reader to see `flag`; the caller has just read ZMQ_EVENTS without it.
        Every parked caller is woken together and tries again (one that still cannot, parks again)."""
        fut = self._attach().create_future()
        waiters = self._rwait if flag == _POLLIN else self._wwait
        waiters.append(fut)
        try:
            await fut
        finally:
            if not fut.done() or fut.cancelled():  # cancelled while parked: no longer waiting
                try:
                    waiters.remove(fut)
                except ValueError:
                    pass

    async def arecv(self, copy: bool = True) -> Any:
        """The next part (bytes, or a Frame with copy=False), waiting for one if none is queued.
        ZMQ_EVENTS is read first: cheaper than a receive that fails (an exception each time)."""
        while True:
            if self._events() & _POLLIN:
                try:
                    part = _recv(self, _NOBLOCK, copy=copy)
                except zmq.Again:
                    pass
                else:
                    self.settle()
                    return part
            await self._park(_POLLIN)

    async def asend(self, frames: Sequence[Any], copy: bool = True) -> None:
        """Send one multipart message, waiting while the pipe is full. libzmq takes or refuses a
        message at its first part, so a refused send sent nothing."""
        last = len(frames) - 1
        while True:
            try:
                for i, part in enumerate(frames):
                    _send(self, part, _NOBLOCK if i == last else _MORE_NOBLOCK, copy=copy)
                break
            except zmq.Again:
                if self._events() & _POLLOUT:
                    # the socket can send, yet refused this message: a ROUTER whose pipe to this
                    # one peer is full (ZMQ_EVENTS speaks for the socket, not for one peer), and
                    # no event will say when that pipe drains; or it became ready just now
                    await asyncio.sleep(PEER_FULL_RETRY_S)
                else:
                    await self._park(_POLLOUT)
        self.settle()

    def close(self, linger: int | None = None) -> None:
        if not self.closed:
            self._detach(zmq.ZMQError(zmq.ENOTSOCK))
        super().close(linger=linger)
