"""Work: what the rollout's concurrent tasks share.

The batch loop, the trajectory tasks, the flush task, the weight follower and the migration RPCs
all run on one event loop and meet here: the trajectories in flight (`active`), the lock that
orders weight changes against new work, and the events that wake the loop. The rules for who
may change what are in roles/rollout/role.py's docstring; this object only holds the state, so
every component gets it passed in and none of them imports another.

Writes to the pools that must arrive go through the bus's `call_acked` (bus/retry.py). When one
is given up (an `internal` answer past its bound), what happens is the caller's: the runner
releases the trajectory in the partial pool (migration.give_up), the batch loop waits idle_wait_s
before asking for a batch again.
"""
from __future__ import annotations

import asyncio

from laminar.roles.rollout.trajectory import Active


class Work:
    """The trajectories in flight on one rollout, with the lock and events that order its tasks."""

    def __init__(self):
        self.active: dict[str, Active] = {}
        self.generating: set[str] = set()    # active ones whose generation has not ended (the rest are stored)
        self.lock = asyncio.Lock()           # weight changes vs. new work (loop, MigrateIn, adoption)
        self.batch_done = asyncio.Event()    # the last active trajectory left
        self.gen_done = asyncio.Event()      # the last generating trajectory ended its generation
        self.room_freed = asyncio.Event()    # an active trajectory left (refill takes more)
        self.wake = asyncio.Event()          # a newer version, adopted work, a gate opened: an idle loop wakes
        self.state = "idle"                  # idle | generating | loading (reported in rollout.stats)
        self.generated = 0                   # tokens generated here (the report's tokens_per_s)

    def count(self, n: int) -> None:
        self.generated += n

    def add(self, a: Active) -> None:
        self.active[a.id] = a
        self.generating.add(a.id)
        self.batch_done.clear()
        self.gen_done.clear()

    def generation_ended(self, tid: str) -> None:
        """`tid`'s generation ended (it is scored and stored next), or it left."""
        self.generating.discard(tid)
        if not self.generating:
            self.gen_done.set()

    def left(self, *gone: Active, make_room: bool = True) -> None:
        """`gone` are no longer generated here: stored (their own task), fenced off, released, or
        handed to another rollout (MigrateOut). Each is dropped if it is still the one held under
        its id; the batch loop learns of it: room_freed wakes the refill wait, batch_done ends the
        batch when none is left. MigrateOut passes make_room=False: the manager took that work away
        to balance the fleet, which makes no room for new groups here until the last one is gone."""
        for a in gone:
            if self.active.get(a.id) is a:
                del self.active[a.id]
                self.generation_ended(a.id)  # (a stale one leaves its successor's generation alone)
        if make_room or not self.active:
            self.room_freed.set()
        if not self.active:
            self.batch_done.set()

    async def wait_idle(self, stopping: asyncio.Event, timeout_s: float) -> bool:
        """Nothing to do: wait for `wake` (a new weight version, adopted work, the prompt pool's gate
        opened), a stop, or timeout_s. True when woken or stopping, False at the timeout."""
        self.wake.clear()
        waits = [asyncio.ensure_future(e.wait()) for e in (stopping, self.wake)]
        try:
            done, _ = await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            return bool(done)
        finally:
            for w in waits:
                w.cancel()
