"""TCP chunk transport (the default): blocking sockets, zero-copy receive into the caller's buffer.

Tuning: 4 MiB socket buffers (a shaped 400 Mbit/s link with 100 ms of tbf latency needs a few MiB
in flight), TCP_NODELAY so small control messages (WANT, NACK, DONE) are not held back behind
Nagle (a message's header and payload go in one sendmsg, so a chunk's header never travels
alone), and TCP keep-alive probing after KEEPALIVE_IDLE_S of silence every KEEPALIVE_INTERVAL_S,
KEEPALIVE_PROBES times, so a link to a host that vanished without a FIN fails in about 10 s
instead of the system's default of over two hours. Sends use SO_SNDTIMEO (`send_timeout_s`): a
downstream that stops reading for that long is treated as a dead link. Receives use SO_RCVTIMEO
once the owner sets an idle timeout (`set_idle_timeout`): the peer's heartbeats (wire.py, PING)
keep a live link busy, so a receive that gets nothing for that long means a stopped peer (a
SIGSTOPped process still answers keep-alive probes from its kernel, but sends nothing).
`send_file` sends a payload that lies in a file (a relay's shared-memory slot) with sendfile.

A large receive (a chunk's payload, read WAKE_MAX at a time) sets the socket's SO_RCVLOWAT to the
bytes it waits for and polls: the kernel wakes the receiving thread once they are all queued (or
the receive window is nearly full, or the peer closed), instead of at every arriving segment
(a context switch and a partial copy each, one or two 1500-byte packets apart), and one
non-blocking recv takes them. Small reads (headers, control messages) set the mark back to 1 and
block as before, so a lone small message is never held back.
"""
from __future__ import annotations

import os
import select
import socket
import struct

from laminar.weights.transport import ChunkTransport, Conn, LinkError, Listener, split_address

BUF_BYTES = 4 << 20
# a receive of at least WAKE_MIN bytes waits until all are queued (SO_RCVLOWAT), WAKE_MAX at a time
WAKE_MIN, WAKE_MAX = 32 << 10, 1 << 20
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 4, 2, 3


def _timeval(seconds: float) -> bytes:
    secs = int(seconds)
    return struct.pack("ll", secs, int((seconds - secs) * 1e6))


class TcpConn(Conn):
    def __init__(self, sock: socket.socket, send_timeout_s: float):
        self.sock = sock
        try:
            host, port = sock.getpeername()[:2]
            self.peer = f"{host}:{port}"
        except OSError:
            self.peer = "?"
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for opt, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                           ("TCP_KEEPCNT", KEEPALIVE_PROBES)):
            if hasattr(socket, opt):  # Linux; elsewhere the system's defaults apply
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUF_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUF_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(send_timeout_s))
        self._closed = False
        self.idle_timeout_s: float | None = None
        self._lowat = 1  # the socket's SO_RCVLOWAT now (1: the default, wake at any byte)
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)

    def set_handshake_timeout(self, seconds: float | None) -> None:
        self.sock.settimeout(seconds)

    def set_idle_timeout(self, seconds: float | None) -> None:
        self.idle_timeout_s = seconds
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds or 0.0))

    def send(self, header: bytes, payload=None) -> None:
        """Header and payload in one sendmsg (one syscall, and with TCP_NODELAY no packet that
        carries the header alone); what a full socket buffer left unsent follows with sendall."""
        try:
            if payload is None or len(payload) == 0:
                self.sock.sendall(header)
                return
            sent = self.sock.sendmsg([header, payload])
            if sent < len(header):
                self.sock.sendall(header[sent:])
                sent = len(header)
            if sent - len(header) < len(payload):
                self.sock.sendall(memoryview(payload).cast("B")[sent - len(header):])
        except OSError as exc:
            raise LinkError(f"send to {self.peer} failed: {exc}") from None

    def send_file(self, header: bytes, fd: int, offset: int, payload) -> None:
        """The header (held back with MSG_MORE, so it leaves with the first bytes), then the
        payload straight from the file with sendfile: the kernel sends the file's pages (shared
        memory) without copying them into the socket first."""
        n = len(payload)
        try:
            self.sock.sendall(header, socket.MSG_MORE)
            sent = 0
            while sent < n:
                k = os.sendfile(self.sock.fileno(), fd, offset + sent, n - sent)
                if k == 0:
                    raise LinkError(f"send to {self.peer}: the file ended {n - sent} bytes short of the payload")
                sent += k
        except LinkError:
            raise
        except OSError as exc:
            raise LinkError(f"send to {self.peer} failed: {exc}") from None

    def recv_header(self, size: int) -> bytes:
        buf = bytearray(size)
        self.recv_into(memoryview(buf))
        return bytes(buf)

    def recv_into(self, view: memoryview) -> None:
        got, n = 0, len(view)
        try:
            while got < n:
                want = min(n - got, WAKE_MAX)
                if want >= WAKE_MIN:
                    self._ready(want)  # then take what is there (all of it, unless a timeout or a full window)
                    k = self.sock.recv_into(view[got:], want, socket.MSG_DONTWAIT)
                else:
                    self._set_lowat(1)
                    k = self.sock.recv_into(view[got:], want, socket.MSG_WAITALL)
                if k == 0:
                    raise LinkError(f"{self.peer} closed the connection")
                got += k
        except LinkError:
            raise
        except BlockingIOError:  # the idle timeout passed with nothing received
            raise LinkError(f"nothing from {self.peer} for {self.idle_timeout_s:g} s: the peer stopped or "
                            "vanished") from None
        except OSError as exc:
            raise LinkError(f"receive from {self.peer} failed: {exc}") from None

    def _ready(self, want: int) -> None:
        """Wait until `want` bytes are queued on the socket (SO_RCVLOWAT = want, then poll), the
        receive window is nearly full, the peer closed, or the idle timeout passed. A blocking
        recv never runs with the mark raised: it would first take the bytes already queued and
        then sleep until `want` more came, which the rest of this message may never reach."""
        self._set_lowat(want)
        timeout = self.sock.gettimeout()  # the handshake's deadline, else the idle timeout
        timeout = self.idle_timeout_s if timeout is None else timeout
        self._poll.poll(None if timeout is None else max(1, int(timeout * 1000)))

    def _set_lowat(self, lowat: int) -> None:
        if lowat != self._lowat:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
            self._lowat = lowat

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv
        except OSError:
            pass
        self.sock.close()


class TcpListener(Listener):
    def __init__(self, host: str, port: int, send_timeout_s: float):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUF_BYTES)
        self.sock.bind((host, port))
        self.sock.listen(128)  # the accepting thread only accepts (handshakes run elsewhere): drain fast
        self.address = f"{host}:{self.sock.getsockname()[1]}"
        self.send_timeout_s = send_timeout_s

    def accept(self, timeout: float) -> Conn | None:
        self.sock.settimeout(timeout)
        try:
            s, _ = self.sock.accept()
        except TimeoutError:
            return None
        except OSError as exc:
            raise LinkError(f"accept on {self.address} failed: {exc}") from None
        s.settimeout(None)
        return TcpConn(s, self.send_timeout_s)

    def close(self) -> None:
        self.sock.close()


class TcpTransport(ChunkTransport):
    name = "tcp"

    def __init__(self, send_timeout_s: float = 30.0):
        self.send_timeout_s = send_timeout_s

    def listen(self, host: str, port: int = 0) -> Listener:
        return TcpListener(host, port, self.send_timeout_s)

    def connect(self, address: str, timeout: float) -> Conn:
        host, port = split_address(address)
        try:
            s = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise LinkError(f"connect to {address} failed: {exc}") from None
        s.settimeout(None)
        return TcpConn(s, self.send_timeout_s)
