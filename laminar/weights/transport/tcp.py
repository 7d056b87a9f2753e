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
"""
from __future__ import annotations

import os
import socket
import struct

from laminar.weights.transport import ChunkTransport, Conn, LinkError, Listener, split_address

BUF_BYTES = 4 << 20
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
                k = self.sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
                if k == 0:
                    raise LinkError(f"{self.peer} closed the connection")
                got += k
        except LinkError:
            raise
        except BlockingIOError:  # SO_RCVTIMEO passed with nothing received
            raise LinkError(f"nothing from {self.peer} for {self.idle_timeout_s:g} s: the peer stopped or "
                            "vanished") from None
        except OSError as exc:
            raise LinkError(f"receive from {self.peer} failed: {exc}") from None

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
