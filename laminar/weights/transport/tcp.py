"""TCP chunk transport (the default): blocking sockets, zero-copy receive into the caller's buffer.

Tuning: 4 MiB socket buffers (a shaped 400 Mbit/s link with 100 ms of tbf latency needs a few MiB
in flight), TCP_NODELAY so small control messages (WANT, NACK, DONE) are not held back behind
Nagle, keep-alive so an idle link to a vanished host is eventually noticed. Sends use SO_SNDTIMEO
(`send_timeout_s`): a downstream that stops reading for that long is treated as a dead link, while
receives block without limit (a relay waits indefinitely for the next version).
"""
from __future__ import annotations

import socket
import struct

from laminar.weights.transport import ChunkTransport, Conn, LinkError, Listener, split_address

BUF_BYTES = 4 << 20


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
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUF_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUF_BYTES)
        secs = int(send_timeout_s)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                        struct.pack("ll", secs, int((send_timeout_s - secs) * 1e6)))
        self._closed = False

    def set_handshake_timeout(self, seconds: float | None) -> None:
        self.sock.settimeout(seconds)

    def send(self, header: bytes, payload=None) -> None:
        try:
            if payload is None or len(payload) == 0:
                self.sock.sendall(header)
            else:
                self.sock.sendall(header)
                self.sock.sendall(payload)
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
