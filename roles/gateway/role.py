"""GatewayRole: the OpenAI-compatible endpoint of agent episodes (docs/architecture.md §2, §14).

    GET  /v1/models                       the policy, under `model_name`
    POST /v1/chat/completions             one call of an episode (streamed or not; tools, n, stop,
    POST /v1/completions                  logprobs...), routed to the rollout that holds it
    POST /v1/episodes                     claim an open episode: {id, prompt, messages, version}
    GET  /v1/episodes/{id}                where it is and how far
    POST /v1/episodes/{id}/end            {reward}: end it (no reward: the rollout's reward scores it)
    GET  /healthz                         the counters (no key needed)

The episode a call belongs to is named by the `X-Laminar-Episode` header or the request's `user`
field; a call that names none, or an unknown one, is refused (400, 404) and counted. A role of its
own, not a listener in each rollout: agents keep one address for the whole run, while the
episodes behind it move between rollouts (repack, a dead rollout's work resumed elsewhere); the
rollouts keep the engines, the tokens and the chat rendering, and the gateway keeps only the
routing (roles/gateway/book.py) and the wire format (openai_api.py). The price is one bus hop
per call, or per poll of a streamed call.

A call whose rollout died or moved the episode waits (`reroute_wait_s`) for the rollout that
holds it now to announce it, then is asked again there under the same call id: a call that had
not finished is generated again on the episode's own version (the recording never holds half a
call), one that had is answered from the recording. A stream that had already sent text cannot
be resumed that way: it ends with an error event (the OpenAI clients raise it) and the agent
retries. Past the wait: 503 with Retry-After; an episode nobody holds for `lost_after_s`: 410,
and it ends as failed.
"""
from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import unquote

from laminar.bus.errors import PeerUnavailable, RemoteError
from laminar.roles.gateway.book import EpisodeBook, Row
from laminar.roles.gateway.config import GatewayConfig
from laminar.roles.gateway.http import HttpServer, Request, Response, Stream, error_body
from laminar.roles.gateway.openai_api import DONE, ChunkStream, chat_completion, completion, sse

from laminar.protocol import Ack, AgentCall, AgentCallReply, AnnounceEpisodes, EndEpisode
from laminar.role_base import Role

POLL_S = 20.0  # a rollout answers a poll within this (roles/rollout/agent.py), plus the bus deadline
ERRORS = {"rewritten": (409, "history_rewritten"), "ended": (409, "episode_ended"), "busy": (409, "call_in_progress"),
          "bad_request": (400, "bad_request"), "refused": (409, "refused")}


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.retry_after = status, code, message, retry_after

    def response(self) -> Response:
        headers = {"Retry-After": str(int(self.retry_after))} if self.retry_after else {}
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        return Response.of(self.status, error_body(self.message, self.code, kind), headers)


class GatewayRole(Role):
    """Serves agent episodes' calls over HTTP, each on the rollout and weight version that hold it."""
    name = "gateway"
    Config = GatewayConfig

    def __init__(self, ctx):
        super().__init__(ctx)
        s = self.settings
        self.book = EpisodeBook(s.lost_after_s, s.stale_after_s, s.remember_ended)
        self.clients: dict[str, object] = {}
        self.server = self.http = None
        self.key: str | None = None

    # -- lifecycle ---------------------------------------------------------------------------------
    async def setup(self) -> None:
        s, t = self.settings, self.ctx.transport
        if s.api_key_file:
            self.key = Path(s.api_key_file).read_text().strip()
        self.server = t.server(self.cluster.bind_endpoint("gateway", self.ctx.id), "gateway", self.ctx.id,
                               s.max_inflight)
        self.server.route(AnnounceEpisodes, self.on_announce)
        await self.server.start()
        host, _ = self.cluster.spec("gateway", self.ctx.id)
        bind = s.http_bind or self.cluster.cluster.hosts[host].bind
        self.http = HttpServer(self.handle, bind, s.http_port, log=self.log, max_connections=s.max_connections,
                               max_body_bytes=s.max_body_bytes)
        await self.http.start()
        self.log.info("gateway_ready", http=f"http://{bind}:{self.http.port}/v1", bus=self.server.address,
                      model=s.model_name, key=self.key is not None)

    async def run(self) -> None:
        self.spawn(self._expire(), "expire")
        await self.wait_stopped()

    async def stop(self) -> None:
        await super().stop()
        if self.http is not None:
            await self.http.close()
        if self.server is not None:
            await self.server.close()
        for c in self.clients.values():
            c.close()

    def status(self) -> dict:
        return {**self.book.status(), "http_port": self.http.port if self.http else 0}

    async def _expire(self) -> None:
        while True:
            await asyncio.sleep(min(5.0, self.settings.lost_after_s / 4))  # the sweep period
            for eid in self.book.expire():
                self.log.warning("episode_lost", episode=eid, after_s=self.settings.lost_after_s)

    def _client(self, address: str):
        if address not in self.clients:
            self.clients[address] = self.ctx.transport.client(address)
        return self.clients[address]

    # -- the bus ------------------------------------------------------------------------------------
    async def on_announce(self, req: AnnounceEpisodes) -> Ack:
        for eid in self.book.announce(req):  # its agent was told it failed: it ends as failed there too
            self.spawn(self._end_failed(req.control_address, eid), f"fail:{eid}", oneshot=True)
        return Ack(f"{len(req.episodes)} episodes")

    async def _end_failed(self, address: str, eid: str) -> None:
        try:
            await self._client(address).call(EndEpisode(eid, None, "failed"), timeout=self.settings.rpc_timeout_s)
        except (PeerUnavailable, RemoteError) as exc:  # its wall budget ends it anyway
            self.log.warning("end_failed_not_sent", episode=eid, error=str(exc))

    # -- HTTP ---------------------------------------------------------------------------------------
    async def handle(self, req: Request) -> Response | Stream:
        try:
            if req.path == "/healthz":
                return Response.of(200, {"ok": True, **self.status()})
            self._authorize(req)
            return await self._route(req)
        except ApiError as exc:
            return exc.response()

    def _authorize(self, req: Request) -> None:
        if self.key is None:
            return
        given = req.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.key}".encode()):
            raise ApiError(401, "invalid_api_key", "a valid API key is required (Authorization: Bearer KEY)")

    async def _route(self, req: Request) -> Response | Stream:
        if req.path.startswith("/v1/episodes/"):  # an episode id may hold "/" (quoted or not)
            rest = req.path[len("/v1/episodes/"):]
            if req.method == "POST" and rest.endswith("/end"):
                return await self._end(req, unquote(rest[:-len("/end")]))
            if req.method == "GET":
                return self._episode(unquote(rest))
        parts = [p for p in req.path.split("/") if p]
        if parts[:1] != ["v1"]:
            raise ApiError(404, "not_found", f"no such path {req.path}")
        parts = parts[1:]
        if req.method == "GET" and parts == ["models"]:
            return Response.of(200, {"object": "list", "data": [self._model()]})
        if req.method == "GET" and len(parts) == 2 and parts[0] == "models":
            if parts[1] != self.settings.model_name:
                raise ApiError(404, "model_not_found", f"no model {parts[1]!r}; this gateway serves "
                                                       f"{self.settings.model_name!r}")
            return Response.of(200, self._model())
        if req.method == "POST" and parts == ["chat", "completions"]:
            return await self._call(req, "chat")
        if req.method == "POST" and parts == ["completions"]:
            return await self._call(req, "completions")
        if req.method == "POST" and parts == ["episodes"]:
            return await self._claim(req)
        raise ApiError(404, "not_found", f"no such endpoint: {req.method} {req.path}")

    def _model(self) -> dict:
        return {"id": self.settings.model_name, "object": "model", "created": 0, "owned_by": "laminar"}

    # -- episodes -----------------------------------------------------------------------------------
    async def _claim(self, req: Request) -> Response:
        body = _json(req)
        wait = min(float(body.get("wait_s", self.settings.claim_wait_s)), self.settings.claim_wait_s)
        row = await self.book.wait_claimable(wait)
        if row is None:
            raise ApiError(503, "no_episode", "no episode is waiting for an agent now", retry_after=1)
        i = row.info
        self.log.info("episode_claimed", episode=row.id, rollout=row.rollout_id, version=i.version)
        return Response.of(200, {"id": row.id, "object": "episode", "prompt": i.prompt,
                                 "messages": [{"role": "user", "content": i.prompt}], "version": i.version,
                                 "lineage": i.lineage, "group_id": i.group_id, "sample_index": i.sample_index,
                                 "model": self.settings.model_name})

    def _episode(self, eid: str) -> Response:
        row = self.book.rows.get(eid)
        if row is None:
            state = self.book.state_of(eid)
            if state is None:
                raise ApiError(404, "unknown_episode", f"unknown episode {eid!r}")
            return Response.of(200, {"id": eid, "object": "episode", "state": state})
        return Response.of(200, {"id": eid, "object": "episode", "state": row.state, "rollout": row.rollout_id,
                                 "version": row.info.version, "calls": row.info.calls, "tokens": row.info.tokens,
                                 "claimed": row.claimed})

    async def _end(self, req: Request, eid: str) -> Response:
        body = _json(req)
        reward = body.get("reward")
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
            raise ApiError(400, "bad_request", "`reward` must be a number or null")
        row = self._row(eid)
        ack = await self._ask(row, EndEpisode(eid, None if reward is None else float(reward),
                                              str(body.get("reason", "agent"))[:64]), time.monotonic() + 60, False)
        return Response.of(200, {"id": eid, "object": "episode", "state": "ending", "detail": ack.detail})

    def _row(self, eid: str | None) -> Row:
        if not eid:
            self.book.counts["unknown_episode_calls"] += 1
            raise ApiError(400, "missing_episode", "name the episode of this call: the X-Laminar-Episode header or "
                                                   "the `user` field (claim one with POST /v1/episodes)")
        row = self.book.rows.get(eid)
        if row is None:
            state = self.book.state_of(eid)
            if state == "failed":
                raise ApiError(410, "episode_failed", f"episode {eid!r} failed (its rollout died and no rollout "
                                                      "could continue it); claim a new one")
            if state is not None:
                raise ApiError(409, "episode_ended", f"episode {eid!r} is over")
            self.book.counts["unknown_episode_calls"] += 1
            raise ApiError(404, "unknown_episode", f"unknown episode {eid!r}: claim one with POST /v1/episodes")
        return row

    # -- calls --------------------------------------------------------------------------------------
    async def _call(self, req: Request, api: str) -> Response | Stream:
        t0 = time.monotonic()
        body = _json(req)
        eid = req.headers.get("x-laminar-episode") or (body.get("user") if isinstance(body.get("user"), str) else None)
        row = self._row(eid)
        call_id = uuid.uuid4().hex
        text = req.body.decode("utf-8", errors="replace")
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return Stream(self._sse(row, api, text, call_id, usage, t0))
        chunks, last = [], None
        try:
            async for reply in self._exchange(row, api, text, call_id, stream=False):
                chunks += reply.chunks
                last = reply
        except ApiError:
            self.book.counts["call_errors"] += 1
            raise
        self._served(row, last, t0)
        fmt = chat_completion if api == "chat" else completion
        return Response.of(200, fmt(call_id, self.settings.model_name, last, chunks),
                           {"X-Laminar-Version": str(last.version)})

    async def _sse(self, row: Row, api: str, text: str, call_id: str, usage: bool, t0: float) -> AsyncIterator[bytes]:
        cs, last = ChunkStream(api, call_id, self.settings.model_name), None
        try:
            async for reply in self._exchange(row, api, text, call_id, stream=True):
                for ev in cs.events(reply):
                    yield ev
                last = reply
        except ApiError as exc:
            self.book.counts["call_errors"] += 1
            yield sse(error_body(exc.message, exc.code, "server_error" if exc.status >= 500 else
                                 "invalid_request_error"))
            return
        if usage:
            yield cs.usage(last)
        yield DONE
        self._served(row, last, t0)

    def _served(self, row: Row, reply: AgentCallReply, t0: float) -> None:
        c = self.book.counts
        if row.calls == 0:
            c["episodes_called"] += 1
        row.calls += 1
        c["calls"] += 1
        c["replayed_calls"] += reply.replayed
        c["history_rewrites"] += reply.rewrite
        self.book.latency.append(time.monotonic() - t0)
        self.book.call_tokens.append(reply.completion_tokens)

    async def _exchange(self, row: Row, api: str, text: str, call_id: str, stream: bool):
        """The call's replies from its rollout, polled until done (one reply when not streamed)."""
        deadline, offset = time.monotonic() + self.settings.call_timeout_s, 0
        while True:
            reply = await self._ask(row, AgentCall(row.id, call_id, api, text, stream, offset), deadline, offset > 0)
            offset += len(reply.chunks)
            yield reply
            if reply.done:
                return
            if time.monotonic() > deadline:
                raise ApiError(504, "call_timeout", f"the call took over {self.settings.call_timeout_s}s")

    async def _ask(self, row: Row, req, deadline: float, streamed: bool):
        """`req` to the rollout holding `row`'s episode, waiting for it to reappear after a move or
        a dead rollout (see the module docstring)."""
        s = self.settings
        while True:
            if row.state != "open":
                raise ApiError(409 if row.state == "ended" else 410, f"episode_{row.state}",
                               f"episode {row.id} is {row.state}")
            if row.rollout_id is None and not await self.book.wait_moved(row, min(s.reroute_wait_s,
                                                                                  deadline - time.monotonic())):
                if row.state != "open":
                    continue
                raise ApiError(503, "episode_unavailable", f"episode {row.id} is being moved or recovered; "
                                                           "retry the call", retry_after=2)
            address = row.address
            try:
                return await self._client(address).call(req, timeout=POLL_S + s.rpc_timeout_s)
            except RemoteError as exc:
                if exc.code != "not_here":
                    if exc.code == "rewritten":
                        self.book.counts["history_rewrites"] += 1
                    status, code = ERRORS.get(exc.code, (502, "rollout_error"))
                    raise ApiError(status, code, exc.message) from None
                why = exc.message
            except PeerUnavailable as exc:
                why = str(exc)
            if streamed:
                raise ApiError(503, "stream_interrupted", f"episode {row.id}: its rollout went away mid-stream "
                                                          f"({why}); retry the call")
            if row.address == address:
                self.book.lost(row)
                self.log.warning("episode_rerouting", episode=row.id, why=why)


def _json(req: Request) -> dict:
    try:
        body = req.json()
    except ValueError as exc:
        raise ApiError(400, "bad_request", f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "bad_request", "the body must be a JSON object")
    return body

