"""HttpScorer: a user's scoring service over HTTP (httpx's async client).

Request (POST `url`, JSON): {"scorer": NAME, "items": [{"id", "prompt", "response", "reference",
"prompt_tokens", "response_tokens", "group_id", "version"}, ...]} and the reply must be
{"scores": [float, ...]} (one finite number per item, in order). Items go `batch_size` to a
request, at most `concurrency` requests in flight. A request has one deadline, `timeout_s`, for
all of it (connect, send, wait and read the whole reply: httpx's own timeout applies to each phase
alone, so a service that sent its reply a byte at a time held a batch for ever), and its reply is
read up to `max_reply_bytes`, no further. A request that fails (connection, deadline, a reply too
long, a status other than 2xx, a reply of another shape) is retried `retries` times with backoff
(`backoff_s`, doubling, at most 10 s); after that the whole batch fails with HttpScoreError,
which names the url and the last problem. The role then submits nothing for that batch: its lease
expires and it is scored again later (by this replica or another), so nothing is lost.
"""
from __future__ import annotations

import asyncio
import json
import math

import httpx
from laminar.bus.retry import Backoff

from laminar.protocol import Trajectory
from laminar.secrets import resolve


def request_headers(s) -> dict[str, str]:
    """The headers to send: literal ones as written, secret ones read now from where the config
    says they are (an environment variable or a 0600 file: laminar/secrets.py)."""
    return {k: resolve(v, f"roles.reward.http.headers.{k}") for k, v in s.headers.items()}


class HttpScoreError(RuntimeError):
    """A batch the service did not score (after every retry); says why."""


class HttpScorer:
    """Scores trajectories by POSTing them to a user's service."""

    def __init__(self, s, decode, scorer: str):
        self.s, self.decode, self.scorer = s, decode, scorer
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(s.timeout_s), headers=request_headers(s))
        self.gate = asyncio.Semaphore(s.concurrency)
        self.parse_failures = 0
        self.retries = 0       # requests sent again
        self.failures = 0      # batches that failed after every retry

    def item(self, t: Trajectory) -> dict:
        return {"id": t.spec.trajectory_id, "prompt": self.decode(t.spec.prompt_tokens),
                "response": self.decode(t.response_tokens), "reference": t.spec.answer,
                "prompt_tokens": [int(x) for x in t.spec.prompt_tokens],
                "response_tokens": [int(x) for x in t.response_tokens],
                "group_id": t.spec.group_id, "version": t.version}

    async def score(self, trajs: list[Trajectory]) -> tuple[list[float], list[str]]:
        chunks = [trajs[i:i + self.s.batch_size] for i in range(0, len(trajs), self.s.batch_size)]
        parts = await asyncio.gather(*(self._post([self.item(t) for t in c]) for c in chunks))
        return [x for p in parts for x in p], []

    async def _post(self, items: list[dict]) -> list[float]:
        wait, why = Backoff(self.s.backoff_s, 10.0), ""
        for attempt in range(self.s.retries + 1):
            if attempt:
                self.retries += 1
                await wait.sleep()  # backoff before retrying the service
            try:
                async with self.gate:
                    status, body = await self._request(items)
                if status // 100 != 2:
                    why = f"HTTP {status}: {body[:200]!r}"
                    continue
                return _scores(body, len(items))
            except TimeoutError:
                why = f"no whole reply within {self.s.timeout_s:g} s (one deadline for connect, send, wait and read)"
            except httpx.HTTPError as exc:
                why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            except ValueError as exc:
                why = str(exc)
        self.failures += 1
        raise HttpScoreError(f"{self.s.url}: {len(items)} items not scored after {self.s.retries + 1} attempts; "
                             f"last: {why}")

    async def _request(self, items: list[dict]) -> tuple[int, bytes]:
        """(status, body) of one POST, under one deadline for all of it, reading at most
        `max_reply_bytes` of the body (TimeoutError, or ValueError past the bound)."""
        most = self.s.max_reply_bytes
        async with asyncio.timeout(self.s.timeout_s):
            async with self.client.stream("POST", self.s.url, json={"scorer": self.scorer, "items": items}) as r:
                if int(r.headers.get("content-length", 0) or 0) > most:
                    raise ValueError(f"reply of {r.headers['content-length']} bytes is longer than max_reply_bytes "
                                     f"({most} bytes): not read")
                body = bytearray()
                async for chunk in r.aiter_bytes():
                    body += chunk
                    if len(body) > most:
                        raise ValueError(f"reply longer than max_reply_bytes ({most} bytes): read no further")
                return r.status_code, bytes(body)

    async def close(self) -> None:
        await self.client.aclose()


def _scores(raw: bytes, n: int) -> list[float]:
    """The reply's scores, or ValueError saying what is wrong with it."""
    text = raw[:200].decode("utf-8", "replace")
    try:
        body = json.loads(raw)
    except ValueError:
        raise ValueError(f"reply is not JSON: {text!r}") from None
    scores = body.get("scores") if isinstance(body, dict) else None
    if not isinstance(scores, list) or len(scores) != n:
        raise ValueError(f"reply must be {{\"scores\": [{n} numbers]}}, got {text!r}")
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in scores):
        raise ValueError(f"reply's scores are not all finite numbers: {scores[:8]!r}")
    return [float(x) for x in scores]
