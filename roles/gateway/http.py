"""A small HTTP/1.1 server on asyncio streams: what the agent gateway needs, and no more.

    server = HttpServer(handle, "127.0.0.1", 8000, log=log)   # handle(Request) -> Response | Stream
    await server.start(); ...; await server.close()

Keep-alive connections (HTTP/1.1's default; `Connection: close` or HTTP/1.0 ends one after its
response), request bodies by Content-Length (the OpenAI clients send it; chunked request bodies
are answered 411), JSON responses, and streamed responses (`Stream`: server-sent events, sent with
chunked transfer encoding, each event flushed as it comes). Why not a framework: this runs on the
role's own event loop beside the bus, it is ~200 lines, and it adds no dependency to a role that
every agent run places (aiohttp, uvicorn and fastapi arrive only with vLLM's CPU build).

Bounds: at most `max_connections` connections (one more is answered 503 and closed), a request line
and headers of at most `max_header_bytes`, a body of at most `max_body_bytes` (413), an idle
connection (or one whose request head does not arrive within `idle_s`) closed after `idle_s`, a
request whose body does not arrive whole within `idle_s` of its start answered 408 and closed. A
handler that raises answers 500 and is logged; a client that goes away mid-stream stops the stream
(its generator is closed).
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

REASONS = {200: "OK", 204: "No Content", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
           405: "Method Not Allowed", 408: "Request Timeout", 409: "Conflict", 410: "Gone",
           411: "Length Required", 413: "Payload Too Large", 429: "Too Many Requests",
           500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout"}


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]          # lower-case names
    body: bytes

    def json(self):
        """The body as JSON (ValueError when it is not)."""
        return json.loads(self.body or b"{}")


@dataclass
class Response:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, status: int, obj, headers: dict[str, str] | None = None) -> Response:
        return cls(status, json.dumps(obj).encode(), headers=headers or {})


@dataclass
class Stream:
    """A streamed response: each item of `events` is sent (and flushed) as one chunk."""
    events: AsyncIterator[bytes]
    status: int = 200
    content_type: str = "text/event-stream"
    headers: dict[str, str] = field(default_factory=dict)


Handler = Callable[[Request], Awaitable[Response | Stream]]


class HttpServer:
    def __init__(self, handle: Handler, host: str, port: int, *, log, max_connections: int = 512,
                 max_header_bytes: int = 16384, max_body_bytes: int = 8 << 20, idle_s: float = 120.0):
        self.handle, self.host, self.port, self.log = handle, host, port, log
        self.max_connections, self.max_header_bytes = max_connections, max_header_bytes
        self.max_body_bytes, self.idle_s = max_body_bytes, idle_s
        self.server: asyncio.base_events.Server | None = None
        self.connections: set[asyncio.Task] = set()
        self.refused = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._connection, self.host, self.port, limit=self.max_header_bytes)
        self.port = self.server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for t in list(self.connections):
            t.cancel()
        await asyncio.gather(*self.connections, return_exceptions=True)
        if self.server is not None:
            await self.server.wait_closed()

    # -- one connection ----------------------------------------------------------------------------
    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if len(self.connections) >= self.max_connections:
            self.refused += 1
            await self._send(writer, Response.of(503, error_body("too many connections", "overloaded")), False)
            writer.close()
            return
        self.connections.add(task)
        try:
            while True:
                head: list[bytes] = []  # the request's head, once it arrived whole
                try:
                    async with asyncio.timeout(self.idle_s):  # no task per request, as wait_for makes one
                        req = await self._read(reader, head)
                except TimeoutError:
                    if head:  # its body is late: answered, then closed
                        await self._send(writer, Response.of(408, error_body(
                            f"the request did not arrive whole within {self.idle_s}s", "request_timeout")), False)
                    break
                if isinstance(req, Response):  # a malformed or oversized request: answered, then closed
                    await self._send(writer, req, False)
                    break
                if req is None:
                    break
                keep = req.headers.get("connection", "").lower() != "close"
                if not await self._answer(req, writer, keep) or not keep:
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away
        except asyncio.CancelledError:
            pass  # the server closes: this connection's task ends here (asyncio's own callback reads its result)
        finally:
            self.connections.discard(task)
            writer.close()

    async def _read(self, reader: asyncio.StreamReader, got: list[bytes]) -> Request | Response | None:
        """The next request (its head put in `got` as soon as it is read), an error to answer, or None
        when the client closed the connection between requests."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            got.append(head)
        except asyncio.IncompleteReadError as exc:
            return None if not exc.partial else Response.of(400, error_body("incomplete request", "bad_request"))
        except asyncio.LimitOverrunError:
            return Response.of(400, error_body("request headers too large", "bad_request"))
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return Response.of(400, error_body("malformed request line", "bad_request"))
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        if parts[2] == "HTTP/1.0":
            headers.setdefault("connection", "close")
        if "chunked" in headers.get("transfer-encoding", "").lower():
            return Response.of(411, error_body("send the body with a Content-Length", "bad_request"))
        try:
            n = int(headers.get("content-length", "0"))
        except ValueError:
            return Response.of(400, error_body("bad Content-Length", "bad_request"))
        if n > self.max_body_bytes:
            return Response.of(413, error_body(f"body over {self.max_body_bytes} bytes", "bad_request"))
        body = await reader.readexactly(n) if n else b""
        url = urlsplit(parts[1])
        return Request(parts[0].upper(), url.path, parse_qs(url.query), headers, body)

    async def _answer(self, req: Request, writer: asyncio.StreamWriter, keep: bool) -> bool:
        """Handle one request; False when the connection must close (a stream that broke off)."""
        try:
            res = await self.handle(req)
        except Exception as exc:  # noqa: BLE001 - one bad request must not take the server down
            self.log.error("http_handler_failed", path=req.path, error=repr(exc), exc_info=exc)
            res = Response.of(500, error_body(f"internal error: {exc!r}", "internal"))
        if isinstance(res, Stream):
            return await self._stream(writer, res, keep)
        await self._send(writer, res, keep)
        return True

    async def _send(self, writer: asyncio.StreamWriter, res: Response, keep: bool) -> None:
        head = _head(res.status, {"Content-Type": res.content_type, "Content-Length": str(len(res.body)),
                                  "Connection": "keep-alive" if keep else "close", **res.headers})
        writer.write(head + res.body)
        await writer.drain()

    async def _stream(self, writer: asyncio.StreamWriter, res: Stream, keep: bool) -> bool:
        writer.write(_head(res.status, {"Content-Type": res.content_type, "Cache-Control": "no-cache",
                                        "Transfer-Encoding": "chunked",
                                        "Connection": "keep-alive" if keep else "close", **res.headers}))
        try:
            async for event in res.events:
                if event:
                    writer.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
                    await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return True
        finally:
            await res.events.aclose()


def _head(status: int, headers: dict[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}"] + [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def error_body(message: str, code: str, type_: str = "invalid_request_error") -> dict:
    """An OpenAI-style error body."""
    return {"error": {"message": message, "type": type_, "code": code, "param": None}}
