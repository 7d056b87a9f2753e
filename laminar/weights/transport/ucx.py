"""UCX chunk transport through `ucxx` (optional extra `ucx`; RDMA where the hardware has it).

ucxx's Python API is asyncio-only, while the data plane is blocking and threaded (see the package
docstring), so this module runs one private event loop in a daemon thread per process and gives
each Conn a blocking facade over it (`run_coroutine_threadsafe(...).result()`). Each chunk is one
UCX message, so the per-message overhead of crossing threads is paid per chunk (MiBs), not per
packet. UCX is configured before ucxx is imported: without a GPU it needs `UCX_TLS=tcp` (or
tcp,sm,self); `UCX_RNDV_SCHEME=put_zcopy` and the blocking progress mode made it several times
faster on loopback here (bench/broadcast.py measures the transports). Both are defaults we set only
when the caller did not.

Message framing maps one-to-one: `send(header, payload)` is two UCX messages and the receiver
posts `recv_header` then `recv_into` of exactly the announced size, as the interface requires.
"""
from __future__ import annotations

import asyncio
import os
import queue
import threading

from laminar.weights.transport import ChunkTransport, Conn, LinkError, Listener, split_address

_loop: asyncio.AbstractEventLoop | None = None
_lock = threading.Lock()


def _ucx_loop() -> asyncio.AbstractEventLoop:
    """The process's UCX loop thread (started on first use; ucxx imported there)."""
    global _loop
    with _lock:
        if _loop is None:
            os.environ.setdefault("UCX_TLS", "tcp,self,sm")
            os.environ.setdefault("UCX_RNDV_SCHEME", "put_zcopy")
            os.environ.setdefault("UCXPY_PROGRESS_MODE", "blocking")
            # ucxx's own packages set UCX_MEMTYPE_CACHE, which this UCX build no longer knows
            os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
            try:
                import ucxx  # noqa: F401
            except ImportError as exc:
                raise LinkError(f"UCX transport needs the `ucx` extra (pip install 'laminar[ucx]'): {exc}") from None
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="ucx-loop", daemon=True).start()
            _loop = loop
        return _loop


def _run(coro, timeout: float | None = None):
    fut = asyncio.run_coroutine_threadsafe(coro, _ucx_loop())
    try:
        return fut.result(timeout)
    except LinkError:
        raise
    except Exception as exc:  # ucxx raises its own hierarchy (UCXError, UCXCanceled, ...)
        fut.cancel()
        raise LinkError(f"UCX: {type(exc).__name__}: {exc}") from None


class UcxConn(Conn):
    def __init__(self, ep, peer: str):
        self.ep, self.peer = ep, peer
        self._closed = False
        self._timeout: float | None = None

    def set_handshake_timeout(self, seconds: float | None) -> None:
        self._timeout = seconds

    def send(self, header: bytes, payload=None) -> None:
        import numpy as np  # late: numpy, only on the send path

        async def go():
            await self.ep.send(np.frombuffer(header, dtype=np.uint8))
            if payload is not None and len(payload):
                await self.ep.send(np.frombuffer(payload, dtype=np.uint8))
        _run(go(), self._timeout)

    def recv_header(self, size: int) -> bytes:
        buf = bytearray(size)
        self.recv_into(memoryview(buf))
        return bytes(buf)

    def recv_into(self, view: memoryview) -> None:
        import numpy as np  # late: numpy, only on the receive path
        if self._closed:
            raise LinkError(f"connection to {self.peer} is closed")
        _run(self.ep.recv(np.frombuffer(view, dtype=np.uint8)), self._timeout)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        async def go():
            self.ep.abort()  # cancels pending sends/recvs, unblocking their threads
        try:
            _run(go(), timeout=5.0)
        except (LinkError, TimeoutError):
            pass


class UcxListener(Listener):
    def __init__(self, host: str, port: int):
        self.accepted: queue.Queue = queue.Queue(maxsize=64)

        async def on_connect(ep):
            try:
                self.accepted.put_nowait(UcxConn(ep, "ucx-peer"))
            except queue.Full:
                ep.abort()

        async def make():
            import ucxx  # late: ucxx on the UCX loop thread (configured first)
            return ucxx.create_listener(on_connect, port=port)
        self.listener = _run(make())
        self.address = f"{host}:{self.listener.port}"

    def accept(self, timeout: float) -> Conn | None:
        try:
            return self.accepted.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        async def go():
            self.listener.close()
        try:
            _run(go(), timeout=5.0)
        except (LinkError, TimeoutError):
            pass


class UcxTransport(ChunkTransport):
    name = "ucx"

    def listen(self, host: str, port: int = 0) -> Listener:
        return UcxListener(host, port)

    def connect(self, address: str, timeout: float) -> Conn:
        host, port = split_address(address)

        async def go():
            import ucxx  # late: ucxx on the UCX loop thread (configured first)
            return await asyncio.wait_for(ucxx.create_endpoint(host, port), timeout)
        return UcxConn(_run(go()), address)
