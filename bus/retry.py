"""The bus's retry policies, written once: a doubling backoff and `call_acked`.

`Backoff(first, cap)` is the wait between tries of something that failed: `first`, then doubled
after each wait up to `cap`; `reset()` after a success starts over. Every retry loop uses it,
each with its own first wait and cap (a rollout's refused put backs off to `put_retry_max_s`, an
env replay to 10 s, a relay's failing accept to 1 s): the caps differ because the costs differ,
the doubling does not. `next()` takes a wait (for a thread, or a wait that a stop may cut short),
`sleep()` takes and sleeps it on the event loop, `delay` is the next wait without taking it (what
a log line reports as `retry_in_s`).

`call_acked` is the bus's rule for requests that must arrive (a rollout's TakeBatch,
PutTrajectory, ReassignPartial, GetPartial; a reward replica's LeaseRewards and SubmitScores):
all of them are idempotent, so a peer that is down, busy or past a deadline is asked again with
backoff (0.1 s doubling to 2 s) until it answers; any other refusal is the caller's. An `internal`
answer (an exception in the peer's handler: a bug, or a store it cannot write) is asked again only
INTERNAL_TRIES times in a row, then given up (`call_gave_up`, an error): retried forever, it kept
a trajectory, and with it the whole batch, from ever ending. What each caller does then is its own.
"""
from __future__ import annotations

import asyncio

from laminar.bus.errors import PeerUnavailable, RemoteError

INTERNAL_TRIES = 6  # `internal` answers in a row before call_acked gives up (a bug of the peer, not load)
RETRIED = ("busy", "unavailable", "internal", "deadline")  # RemoteError codes call_acked retries
ACKED_BACKOFF = (0.1, 2.0)  # call_acked's first wait and cap, seconds


class Backoff:
    """Waits between tries: `first` seconds, then doubled (x `factor`) after each, at most `cap`."""

    def __init__(self, first: float, cap: float, factor: float = 2.0):
        self.first, self.cap, self.factor = first, cap, factor
        self.delay = first  # the next wait

    def next(self) -> float:
        """Take the next wait (the one after it grows)."""
        d = self.delay
        self.delay = min(d * self.factor, self.cap)
        return d

    def reset(self) -> None:
        """A try succeeded: the next failure waits `first` again."""
        self.delay = self.first

    async def sleep(self) -> float:
        """Sleep the next wait on the event loop; returns it."""
        d = self.next()
        await asyncio.sleep(d)
        return d


async def call_acked(client, req, timeout_s: float, log):
    """Call until answered (the request is idempotent); backoff on a peer that is down, busy, or
    answered `deadline` (the request waited past its deadline in a loaded pool)."""
    wait, internal = Backoff(*ACKED_BACKOFF), 0
    while True:
        try:
            return await client.call(req, timeout=timeout_s)
        except (PeerUnavailable, RemoteError) as exc:
            if isinstance(exc, RemoteError) and exc.code not in RETRIED:
                raise
            internal = internal + 1 if isinstance(exc, RemoteError) and exc.code == "internal" else 0
            if internal >= INTERNAL_TRIES:
                log.error("call_gave_up", kind=type(req).kind, error=str(exc), tries=internal)
                raise
            log.warning("call_retry", kind=type(req).kind, error=str(exc), retry_in_s=wait.delay)
            await wait.sleep()  # backoff before retrying a peer that is down
