"""Work: what the rollout's concurrent tasks share, and the one way writes to the pools are retried.

The batch loop, the trajectory tasks, the flush task, the weight follower and the migration RPCs
all run on one event loop and meet here: the trajectories in flight (`active`), the lock that
orders weight changes against new work, and the events that wake the loop. The rules for who
may change what are in roles/rollout/role.py's docstring; this object only holds the state, so
every component gets it passed in and none of them imports another.

`call_acked` is the rollout's rule for requests that must arrive (TakeBatch, PutTrajectory,
ReassignPartial, GetPartial): all of them are idempotent, so a peer that is down, busy or past a
deadline is asked again with backoff until it answers; any other refusal is the caller's. An
`internal` answer (an exception in the peer's handler: a bug, or a store it cannot write) is asked
again only INTERNAL_TRIES times in a row, then given up (`call_gave_up`, an error): retried
forever, it kept a trajectory, and with it the whole batch, from ever ending. What each caller does
then is its own: the runner releases the trajectory in the partial pool (migration.give_up), the
batch loop waits idle_wait_s before asking for a batch again.
"""
from __future__ import annotations

import asyncio

from laminar.bus.errors import PeerUnavailable, RemoteError
from laminar.roles.rollout.trajectory import Active

INTERNAL_TRIES = 6  # `internal` answers in a row before call_acked gives up (a bug of the peer, not load)
RETRIED = ("busy", "unavailable", "internal", "deadline")  # RemoteError codes call_acked retries


class Work:
    """The trajectories in flight on one rollout, with the lock and events that order its tasks."""

    def __init__(self):
        self.active: dict[str, Active] = {}
        self.lock = asyncio.Lock()           # weight changes vs. new work (loop, MigrateIn, adoption)
        self.batch_done = asyncio.Event()    # the last active trajectory left
        self.room_freed = asyncio.Event()    # an active trajectory left (refill takes more)
        self.new_weights = asyncio.Event()   # a newer version or adopted work: an idle loop wakes
        self.state = "idle"                  # idle | generating | loading (reported in rollout.stats)
        self.generated = 0                   # tokens generated here (the report's tokens_per_s)

    def count(self, n: int) -> None:
        self.generated += n

    def add(self, a: Active) -> None:
        self.active[a.id] = a
        self.batch_done.clear()

    def left(self, a: Active) -> None:
        """`a` is no longer generated here (fenced off, or handed to another rollout)."""
        if self.active.get(a.id) is a:
            del self.active[a.id]
        self.room_freed.set()
        if not self.active:
            self.batch_done.set()

    async def wait_idle(self, stopping: asyncio.Event, timeout_s: float) -> None:
        """Nothing to do: wait for a new weight version (barrier modes), a stop, or timeout_s."""
        self.new_weights.clear()
        waits = [asyncio.ensure_future(e.wait()) for e in (stopping, self.new_weights)]
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()


async def call_acked(client, req, timeout_s: float, log):
    """Call until answered (the request is idempotent); backoff on a peer that is down, busy, or
    answered `deadline` (the request waited past its deadline in a loaded pool)."""
    delay, internal = 0.1, 0
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
            log.warning("call_retry", kind=type(req).kind, error=str(exc), retry_in_s=delay)
            await asyncio.sleep(delay)  # backoff before retrying a peer that is down
            delay = min(delay * 2, 2.0)
