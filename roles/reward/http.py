"""HttpScorer: a user's scoring service over HTTP (httpx's async client).

Request (POST `url`, JSON): {"scorer": NAME, "items": [{"id", "prompt", "response", "reference",
"prompt_tokens", "response_tokens", "group_id", "version"}, ...]} and the reply must be
{"scores": [float, ...]} (one finite number per item, in order). Items go `batch_size` to a
request, at most `concurrency` requests in flight. A request that fails (connection, timeout,
a status other than 2xx, a reply of another shape) is retried `retries` times with backoff
(`backoff_s`, doubling, at most 10 s); after that the whole batch fails with HttpScoreError,
which names the url and the last problem. The role then submits nothing for that batch: its lease
expires and it is scored again later (by this replica or another), so nothing is lost.
"""
from __future__ import annotations

import asyncio
import math

import httpx
from laminar.bus.retry import Backoff

from laminar.protocol import Trajectory


class HttpScoreError(RuntimeError):
    """A batch the service did not score (after every retry); says why."""


class HttpScorer:
    """Scores trajectories by POSTing them to a user's service."""

    def __init__(self, s, decode, scorer: str):
        self.s, self.decode, self.scorer = s, decode, scorer
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(s.timeout_s), headers=s.headers)
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
                    r = await self.client.post(self.s.url, json={"scorer": self.scorer, "items": items})
                if r.status_code // 100 != 2:
                    why = f"HTTP {r.status_code}: {r.text[:200]!r}"
                    continue
                return _scores(r, len(items))
            except httpx.HTTPError as exc:
                why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            except ValueError as exc:
                why = str(exc)
        self.failures += 1
        raise HttpScoreError(f"{self.s.url}: {len(items)} items not scored after {self.s.retries + 1} attempts; "
                             f"last: {why}")

    async def close(self) -> None:
        await self.client.aclose()


def _scores(r: httpx.Response, n: int) -> list[float]:
    """The reply's scores, or ValueError saying what is wrong with it."""
    try:
        body = r.json()
    except ValueError:
        raise ValueError(f"reply is not JSON: {r.text[:200]!r}") from None
    scores = body.get("scores") if isinstance(body, dict) else None
    if not isinstance(scores, list) or len(scores) != n:
        raise ValueError(f"reply must be {{\"scores\": [{n} numbers]}}, got {r.text[:200]!r}")
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in scores):
        raise ValueError(f"reply's scores are not all finite numbers: {scores[:8]!r}")
    return [float(x) for x in scores]
