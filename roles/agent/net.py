"""The agent role's two network pieces: a small JSON client of the gateway, and the unix-socket door
that its sandboxed agents reach the gateway through.

    status, body = await post_json("http://h:8000/v1", "/episodes", {"wait_s": 5}, key, timeout_s=30)
    door = GatewayDoor("h", 8000, "/tmp/laminar-agent-x/gateway.sock"); await door.start()

The client speaks HTTP/1.1 with `Connection: close` (one request a connection: claims and ends are
rare), reads the whole answer and parses its JSON. The door listens on a unix socket (mode 0666:
the sandbox's uid connects to it) and relays each connection to the gateway's TCP address byte
for byte; the sandbox init binds the socket into the agent's file system and forwards the agent's
127.0.0.1:PORT to it (laminar/envs/_sandbox_init.py), so the gateway is the only thing an agent
can reach.
"""
from __future__ import annotations

import asyncio
import json
import os
from urllib.parse import urlsplit


class GatewayUnreachable(ConnectionError):
    pass


async def post_json(base_url: str, path: str, body: dict, key: str | None, timeout_s: float) -> tuple[int, dict]:
    """POST `body` to base_url + path; (HTTP status, the answer's JSON or {})."""
    url = urlsplit(base_url.rstrip("/") + path)
    payload = json.dumps(body).encode()
    head = [f"POST {url.path} HTTP/1.1", f"Host: {url.hostname}:{url.port}", "Content-Type: application/json",
            f"Content-Length: {len(payload)}", "Connection: close"] + ([f"Authorization: Bearer {key}"] if key else [])
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(url.hostname, url.port or 80)
            try:
                writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
                await writer.drain()
                raw = await reader.read()
            finally:
                writer.close()
    except (OSError, TimeoutError) as exc:
        raise GatewayUnreachable(f"{base_url}{path}: {exc!r}") from None
    status_line, _, rest = raw.partition(b"\r\n")
    _, _, body_bytes = rest.partition(b"\r\n\r\n")
    try:
        status = int(status_line.split()[1])
    except (IndexError, ValueError):
        raise GatewayUnreachable(f"{base_url}{path}: not an HTTP answer: {raw[:80]!r}") from None
    try:
        data = json.loads(body_bytes) if body_bytes else {}
    except ValueError:
        data = {}
    return status, data if isinstance(data, dict) else {}


class GatewayDoor:
    """A unix socket whose every connection is relayed to the gateway's TCP address."""

    def __init__(self, host: str, port: int, path: str):
        self.host, self.port, self.path = host, port, path
        self.server: asyncio.base_events.Server | None = None
        self.tasks: set[asyncio.Task] = set()
        self.relayed = 0

    async def start(self) -> None:
        os.makedirs(os.path.dirname(self.path), mode=0o755, exist_ok=True)
        if os.path.exists(self.path):
            os.unlink(self.path)
        self.server = await asyncio.start_unix_server(self._relay, self.path)
        os.chmod(self.path, 0o666)  # the sandbox's uid connects to it; nothing but the gateway is behind it

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if os.path.exists(self.path):
            os.unlink(self.path)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self.tasks.add(task)
        self.relayed += 1
        try:
            up_r, up_w = await asyncio.open_connection(self.host, self.port)
        except OSError:
            writer.close()
            self.tasks.discard(task)
            return
        try:
            await asyncio.gather(_pump(reader, up_w), _pump(up_r, writer))
        except asyncio.CancelledError:
            pass  # the door closes: this relay ends here
        finally:
            for w in (writer, up_w):
                w.close()
            self.tasks.discard(task)


async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
    except (ConnectionError, OSError):
        pass  # one side went away: the other is closed by the caller
    finally:
        if dst.can_write_eof():
            try:
                dst.write_eof()
            except OSError:
                pass  # already closed
