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
"""
from __future__ import annotations

import threading
import time
import uuid

import zmq
from laminar.bus import auth as _auth
from laminar.bus.pubsub import MAX_SUBSCRIPTION_BYTES


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

        def forward() -> None:
            try:
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
