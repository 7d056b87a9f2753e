"""The gateway's HTTP server (roles/gateway/http.py) on a real socket: keep-alive requests answered
in turn, an idle connection closed after `idle_s`, and a request that does not arrive whole within
`idle_s` answered 408 before the connection closes."""
from __future__ import annotations

import asyncio

import pytest
import structlog
from laminar.roles.gateway.http import HttpServer, Response

pytestmark = pytest.mark.timeout(30)


async def _server(idle_s: float) -> HttpServer:
    async def handle(req):
        return Response.of(200, {"path": req.path, "body": req.body.decode()})
    s = HttpServer(handle, "127.0.0.1", 0, log=structlog.get_logger("test"), idle_s=idle_s)
    await s.start()
    return s


def _post(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


async def _response(reader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    n = int(next(x.split(":")[1] for x in lines if x.lower().startswith("content-length")))
    return int(lines[0].split()[1]), await reader.readexactly(n)


def test_keep_alive_requests_idle_close_and_a_slow_request_answered_408():
    async def go():
        s = await _server(0.4)
        try:
            r, w = await asyncio.open_connection("127.0.0.1", s.port)
            w.write(_post("/a", b"1") + _post("/b", b"22"))  # two requests back to back on one connection
            first, second = await _response(r), await _response(r)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            idle_end = await asyncio.wait_for(r.read(), 5)    # nothing more sent: closed after idle_s
            idle_s = loop.time() - t0
            r2, w2 = await asyncio.open_connection("127.0.0.1", s.port)
            w2.write(_post("/c", b"0123456789")[:-4])         # the body never arrives whole
            slow = await asyncio.wait_for(_response(r2), 5)
            after = await asyncio.wait_for(r2.read(), 5)
            w.close()
            w2.close()
            return first, second, idle_end, idle_s, slow, after
        finally:
            await s.close()
    first, second, idle_end, idle_s, slow, after = asyncio.run(go())
    assert first == (200, b'{"path": "/a", "body": "1"}') and second == (200, b'{"path": "/b", "body": "22"}')
    assert idle_end == b"" and 0.3 < idle_s < 3
    assert slow[0] == 408 and b"request_timeout" in slow[1] and after == b""
