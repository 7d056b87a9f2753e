"""The chunk transport: one small, blocking, message-oriented interface with two implementations.

    t = get_transport("tcp")                 # or "ucx", or "pkg.module:Class" (tests)
    lst = t.listen("0.0.0.0", 0); lst.address -> "host:port"; conn = lst.accept(timeout=1.0)
    conn = t.connect("10.0.0.2:7000", timeout=2.0)
    conn.send(header, payload)  /  header = conn.recv_header()  /  conn.recv_into(view)

Why blocking, and used from threads: the data plane must not share the role's event loop with
heartbeats and RPC (docs/architecture.md §15), and blocking sockets let the kernel copy straight into the
shared-memory buffer (`recv_into` a memoryview of the mmap) and send straight out of it, with the
GIL released for the whole syscall. Measured on loopback (bench/broadcast.py): threads with
recv_into moved more bytes per CPU-second than asyncio streams, which copy every read into a new
bytes object.

Message semantics (so UCX's tagged messages and TCP's byte stream behave alike): every message is
a fixed-size header, optionally followed by one payload whose size the header states; the
receiver reads the header, then the whole payload in one `recv_into` of exactly that size.
Errors: any failure of a connection is an OSError subclass (`LinkError`); callers treat it as
"link down" and let the manager decide what is dead.
"""
from __future__ import annotations

import abc
import importlib


class LinkError(ConnectionError):
    """A chunk connection failed: peer gone, refused, timed out, or spoke garbage."""


class Conn(abc.ABC):
    peer: str = ""

    @abc.abstractmethod
    def send(self, header: bytes, payload=None) -> None:
        """Send one message (header + optional payload buffer); blocks until handed to the OS."""

    def send_file(self, header: bytes, fd: int, offset: int, payload) -> None:
        """Send one message whose payload (`payload`, len(payload) bytes) is also at `offset` in
        the file `fd`: a transport that can send straight from the file (TCP: sendfile, no copy
        into the socket) does; the default sends `payload` as `send` does."""
        self.send(header, payload)

    @abc.abstractmethod
    def recv_header(self, size: int) -> bytes:
        """Next header of exactly `size` bytes; raises LinkError on EOF."""

    @abc.abstractmethod
    def recv_into(self, view: memoryview) -> None:
        """The payload announced by the last header, exactly len(view) bytes, into `view`."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close; unblocks a thread blocked in recv on this connection. Idempotent."""

    def set_handshake_timeout(self, seconds: float | None) -> None:
        """Deadline for the authentication handshake (None: back to blocking)."""
        return None  # optional: a transport without such a deadline keeps this default

    def set_idle_timeout(self, seconds: float | None) -> None:
        """After the handshake: a receive that gets no byte for `seconds` fails with LinkError
        (the peer stopped or vanished; a live peer sends heartbeats). None: wait for ever."""
        return None  # optional: a transport without it relies on its own keep-alive


class Listener(abc.ABC):
    address: str  # "host:port" a peer can connect to (the bound one; 0.0.0.0 stays as given)

    @abc.abstractmethod
    def accept(self, timeout: float) -> Conn | None:
        """One incoming connection, or None when `timeout` passed."""

    @abc.abstractmethod
    def close(self) -> None: ...


class ChunkTransport(abc.ABC):
    name: str = "?"

    @abc.abstractmethod
    def listen(self, host: str, port: int = 0) -> Listener: ...

    @abc.abstractmethod
    def connect(self, address: str, timeout: float) -> Conn: ...


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"chunk address must be host:port, got {address!r}")
    return host, int(port)


def get_transport(name: str, **options) -> ChunkTransport:
    """'tcp' (default), 'ucx' (needs the `ucx` extra), or 'module:Class' for test transports."""
    if name == "tcp":
        from laminar.weights.transport.tcp import TcpTransport  # late: the transports import this package (their base)
        return TcpTransport(**options)
    if name == "ucx":
        from laminar.weights.transport.ucx import UcxTransport  # late: ucxx (the ucx extra), only when named
        return UcxTransport(**options)
    if ":" in name:
        module, cls = name.split(":", 1)
        return getattr(importlib.import_module(module), cls)(**options)
    raise ValueError(f"unknown chunk transport {name!r}; use tcp, ucx or module:Class")
