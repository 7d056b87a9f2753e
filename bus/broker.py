"""The broker: a ZeroMQ XSUB<->XPUB forwarder (docs/architecture.md §3), in C via zmq.proxy_steerable.

Publishers connect to the XSUB port, subscribers to the XPUB port; subscriptions flow upstream so
a publisher only sends what someone wants. The broker never decodes: a bad frame is forwarded and
dropped (counted) by the subscribers, so no input can stop it. Runs on its own thread with a sync
context (the proxy is a blocking C loop); `stop()` sends TERMINATE on the control socket and waits
for the proxy's reply (libzmq >= 4.3.5 answers TERMINATE and blocks until the answer is taken, so
closing the control peer at once would leave the proxy stuck in that send).

Size limits: the XSUB side (publishers) refuses a frame above `max_msg` and the XPUB side
(subscribers, who only send subscriptions) one above MAX_SUBSCRIPTION_BYTES; libzmq drops the
offending connection, so no input can make the broker buffer more than hwm x max_msg per peer.

Scoped keys (bus/auth.py): the broker is the one place that sees who published what, so with
scoped keys it forwards in Python instead of zmq.proxy: each message's publisher identity (the
CURVE User-Id ZeroMQ attaches) and topic go through `auth.topic_refusal`, and a refused message
(a Shutdown on `ctrl.*` from anything but the operator key, a heartbeat in another role's name)
is dropped, counted in `refused` and logged (the 1st, 2nd, 4th... time). Subscribers cannot make
that check themselves: the identity of a message's publisher does not travel past the broker. The
verdict depends on the (key, topic) pair alone, so it is computed once per pair and looked up
after that (at most DECIDED_MAX pairs remembered: a key cycling through endless topics only makes
the broker decide again, never forward what it should not).
"""
from __future__ import annotations

import collections
import threading
import time
import uuid

import structlog
import zmq
from laminar.bus import auth as _auth
from laminar.bus.pubsub import MAX_SUBSCRIPTION_BYTES

log = structlog.get_logger("laminar.bus.broker")
DECIDED_MAX = 1 << 16  # (key, topic) pairs whose verdict the scoped broker remembers (then starts over)


class Verdicts:
    """`auth.topic_refusal` remembered per (publisher key, topic): the rule depends on nothing else."""

    def __init__(self, limit: int = DECIDED_MAX):
        self.limit = limit
        self.decided: dict[tuple[str | None, bytes], str] = {}

    def why(self, who: str | None, topic: bytes) -> str:
        why = self.decided.get((who, topic))
        if why is None:
            why = _auth.topic_refusal(who, topic)
            if len(self.decided) >= self.limit:
                self.decided.clear()
            self.decided[(who, topic)] = why
        return why


class Broker:
    def __init__(self, pub_address: str, sub_address: str, keys=None, hwm: int = 100000,
                 max_msg: int = 64 << 20):
        self.pub_address, self.sub_address, self.keys, self.hwm = pub_address, sub_address, keys, hwm
        self.max_msg = max_msg
        self.socket_limits: dict[str, int] = {}
        self.ctx = zmq.Context()
        self._ctrl_addr = f"inproc://broker-ctrl-{uuid.uuid4().hex}"
        self._thread: threading.Thread | None = None
        self._auth = None
        self.error: BaseException | None = None
        self.refused: collections.Counter[str] = collections.Counter()  # identity -> messages dropped
        self.forwarded = 0

    def start(self) -> None:
        """Bind both ports (errors such as a port in use raise here) and start forwarding."""
        self._auth = _auth.start_authenticator(self.ctx, self.keys, threaded=True)
        xsub, xpub = self.ctx.socket(zmq.XSUB), self.ctx.socket(zmq.XPUB)
        try:
            for s in (xsub, xpub):
                s.sndhwm = s.rcvhwm = self.hwm
                s.linger = 0
                _auth.make_server(s, self.keys)
            xsub.setsockopt(zmq.MAXMSGSIZE, self.max_msg)
            xpub.setsockopt(zmq.MAXMSGSIZE, MAX_SUBSCRIPTION_BYTES)
            self.socket_limits = {"xsub": xsub.getsockopt(zmq.MAXMSGSIZE), "xpub": xpub.getsockopt(zmq.MAXMSGSIZE)}
            xsub.bind(self.pub_address)
            xpub.bind(self.sub_address)
        except BaseException:  # e.g. port in use: open sockets would make ctx.term() in stop() hang
            xsub.close(linger=0)
            xpub.close(linger=0)
            raise
        self.pub_address = xsub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.sub_address = xpub.getsockopt_string(zmq.LAST_ENDPOINT)
        ctrl = self.ctx.socket(zmq.PAIR)
        ctrl.bind(self._ctrl_addr)

        scoped = self.keys is not None and self.keys.scoped

        def forward() -> None:
            try:
                if scoped:
                    self._filter(xsub, xpub, ctrl)
                else:
                    zmq.proxy_steerable(xsub, xpub, None, ctrl)
            except zmq.ContextTerminated:
                pass
            except BaseException as exc:  # surfaced by is_alive()/error, never swallowed
                self.error = exc
            finally:
                for s in (xsub, xpub, ctrl):
                    s.close(linger=0)

        self._thread = threading.Thread(target=forward, name="broker-proxy", daemon=True)
        self._thread.start()

    def _filter(self, xsub: zmq.Socket, xpub: zmq.Socket, ctrl: zmq.Socket) -> None:
        """zmq.proxy_steerable in Python, checking every published message's publisher and topic."""
        poller = zmq.Poller()
        verdicts = Verdicts()
        for s in (xsub, xpub, ctrl):
            poller.register(s, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if ctrl in ready:
                if ctrl.recv() == b"TERMINATE":
                    ctrl.send(b"")  # what libzmq's proxy answers
                    return
            if xpub in ready:  # subscriptions, upstream
                for _ in range(1000):
                    try:
                        xsub.send_multipart(xpub.recv_multipart(zmq.NOBLOCK))
                    except zmq.Again:
                        break
            if xsub in ready:
                for _ in range(1000):
                    try:
                        frames = xsub.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    try:
                        who = frames[0].get("User-Id")
                    except zmq.ZMQError:
                        who = None
                    why = verdicts.why(who, frames[0].bytes)
                    if why:
                        self.refused[who or "?"] += 1
                        n = sum(self.refused.values())
                        if n & (n - 1) == 0:
                            log.warning("publish_refused", publisher=who, topic=frames[0].bytes[:80].decode(
                                "utf-8", "replace"), why=why, refused=n)
                        continue
                    try:
                        xpub.send_multipart(frames, zmq.NOBLOCK, copy=False)
                        self.forwarded += 1
                    except zmq.Again:  # a subscriber at its high-water mark: dropped, as the proxy does
                        pass

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 2.0) -> None:
        if self._thread is not None and self._thread.is_alive():
            ctl = self.ctx.socket(zmq.PAIR)
            ctl.connect(self._ctrl_addr)
            ctl.send(b"TERMINATE")
            deadline = time.monotonic() + timeout
            while self._thread.is_alive() and time.monotonic() < deadline:
                if ctl.poll(50):  # the reply of libzmq >= 4.3.5 (older ones send none)
                    ctl.recv()
                    break
            ctl.close(linger=0)
            self._thread.join(timeout)
        if self._auth is not None:
            self._auth.stop()
        if self._thread is not None and self._thread.is_alive():
            # Closing sockets under a running proxy aborts the process (a libzmq assertion):
            # leave the daemon thread and its context to process exit instead.
            self.error = self.error or TimeoutError(f"broker proxy did not stop within {timeout}s")
            return
        self.ctx.term()
