"""The sim engine's scorer timeline: when each finished request has been scored (docs/sim.md,
"Scoring a response").

The rollout role scores each trajectory inline when its stream ends, one after another on its
event loop, but the sim rollouts' reward function is a stand-in that costs nothing
(`laminar.tasks.rewards:zero`), so the sim engine charges it here: a finished request's last chunk
is handed over only once it has been scored, on a timeline of its own (sequential: a request waits
for the ones that finished before it), `cost.seconds(response tokens)` of simulated time each. The
GPU does not wait (in vLLM the engine core runs in its own process and keeps stepping); the
trajectory reaches the buffer that much later. Needs a CompressedClock (a VirtualClock has one
sleeper).

A request's scored time is set when it ends (`add`); the task (`run`) hands over every request
scored by now at once and sleeps until the next: one wake-up per burst of finishes, not one per
request (a burst of a thousand took a thousand turns of a busy event loop).
"""
from __future__ import annotations

import asyncio
from collections import deque


class ScorerTimeline:
    """Finished requests waiting for their scoring, in the order they ended. `cost`: seconds by
    response tokens (the simulator's RewardCost, built by the sim engine)."""

    def __init__(self, cost, clock):
        self.cost, self.clock = cost, clock
        self.queue: deque = deque()  # (request, simulated time it is scored)
        self.ready = asyncio.Event()
        self.until = 0.0  # simulated time the scorer is busy until

    def add(self, r, ended: float, response_tokens: int) -> float:
        """Queue request `r` that ended at simulated time `ended`; returns its scoring time."""
        cost = self.cost.seconds(response_tokens)
        self.until = max(self.until, ended) + cost
        self.queue.append((r, self.until))
        self.ready.set()
        return cost

    def drain(self) -> list:
        """Every queued request, taken off the queue (a failing engine fails them)."""
        out = [r for r, _ in self.queue]
        self.queue.clear()
        return out

    async def run(self) -> None:
        """Hand each request over (its `wake`) once the clock passes its scored time."""
        while True:
            while not self.queue:
                self.ready.clear()
                await self.ready.wait()
            now = self.clock.now()
            while self.queue and self.queue[0][1] <= now:
                self.queue.popleft()[0].wake.set()
            if self.queue:
                await self.clock.sleep(self.queue[0][1] - now)
