"""The broker: a ZeroMQ XSUB<->XPUB forwarder (DESIGN §3), in C via zmq.proxy_steerable.

Publishers connect to the XSUB port, subscribers to the XPUB port; subscriptions flow upstream so
a publisher only sends what someone wants. The broker never decodes: a bad frame is forwarded and
dropped (counted) by the subscribers, so no input can stop it. Runs on its own thread with a sync
context (the proxy is a blocking C loop); `stop()` sends TERMINATE on the control socket.
"""
from __future__ import annotations

import threading
import uuid

import zmq

from laminar.bus import auth as _auth


class Broker:
    def __init__(self, pub_address: str, sub_address: str, keys=None, hwm: int = 100000):
        self.pub_address, self.sub_address, self.keys, self.hwm = pub_address, sub_address, keys, hwm
        self.ctx = zmq.Context()
        self._ctrl_addr = f"inproc://broker-ctrl-{uuid.uuid4().hex}"
        self._thread: threading.Thread | None = None
        self._auth = None
        self.error: BaseException | None = None

    def start(self) -> None:
        """Bind both ports (errors such as a port in use raise here) and start forwarding."""
        self._auth = _auth.start_authenticator(self.ctx, self.keys, threaded=True)
        xsub, xpub = self.ctx.socket(zmq.XSUB), self.ctx.socket(zmq.XPUB)
        for s in (xsub, xpub):
            s.sndhwm = s.rcvhwm = self.hwm
            s.linger = 0
            _auth.make_server(s, self.keys)
        xsub.bind(self.pub_address)
        xpub.bind(self.sub_address)
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
            ctl.close(linger=100)
            self._thread.join(timeout)
        if self._auth is not None:
            self._auth.stop()
        self.ctx.term() if not (self._thread and self._thread.is_alive()) else self.ctx.destroy(linger=0)
