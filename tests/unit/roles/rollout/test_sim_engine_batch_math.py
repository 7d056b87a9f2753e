"""SimEngine's macro-step arithmetic over the whole batch at once (numpy columns, one pass) gives
exactly what the request-by-request loops it replaced gave: the same simulated time to the last
bit, the same blocks, tokens, finishes and scoring order. The per-request versions are kept here
as the reference."""
from __future__ import annotations

import asyncio
import random

from laminar.roles.rollout.sim_engine import CompressedClock, SimEngine, _ceil_div, _Request

from laminar.sim.reward_cost import RewardCost
from tests.unit.roles.rollout.test_sim_engine import CURVE, LENGTHS


def _engine(rng: random.Random, n: int) -> SimEngine:
    e = SimEngine(curve=CURVE, lengths=LENGTHS, kv_capacity_tokens=10_000_000, prefill_ms_per_token=0.03,
                  kv_ms_per_token=0.00002, host_step_ms=3.0, host_ms_per_seq=0.075, emit_every=32,
                  reward_cost=RewardCost.from_points([[500, 0.002], [4000, 0.004]]), clock=CompressedClock(1.0))
    for i in range(n):
        prompt = rng.randint(16, 600)
        r = _Request(f"r{i}", prompt, 0, 0, target=rng.randint(1, 400), finish="stop", response_tokens=0)
        r.generated = rng.randint(0, r.target - 1)
        r.response_tokens = r.target + rng.randint(0, 100)
        r.blocks = _ceil_div(r.held, e.block_size)
        e.free_blocks -= r.blocks
        e.running.append(r)
    return e


def _decode_s_per_request(e: SimEngine, k: int) -> float:
    pairs = sorted((r.target - r.generated, r.held) for r in e.running)
    total, i, n = 0.0, 0, len(pairs)
    held = sum(h for _, h in pairs)
    for step in range(1, k + 1):
        while i < n and pairs[i][0] < step:
            held -= pairs[i][1]
            i += 1
        if i == n:
            break
        total += e.step_ms(n - i, held + (n - i) * (step - 1))
    return total / 1000.0


def _advance_per_request(e: SimEngine, k: int) -> list:
    scored, still = [], []
    for r in e.running:
        g = min(k, r.target - r.generated)
        new_blocks = _ceil_div(r.held + g, e.block_size) - _ceil_div(r.held, e.block_size)
        e.free_blocks -= new_blocks
        r.blocks += new_blocks
        r.generated += g
        e.counters["tokens"] += g
        if r.generated >= r.target:
            e._free(r)
            r.done = True
            e.counters["finished"] += 1
            e.counters["scoring_s"] += e.scoring.add(r, e._timeline, r.response_tokens)
            scored.append(r.id)
            continue
        still.append(r)
    e.running = still
    return scored


def _state(e: SimEngine) -> tuple:
    return (e.free_blocks, e.counters["tokens"], e.counters["finished"], e.counters["scoring_s"],
            [(r.id, r.generated, r.blocks) for r in e.running], [(r.id, t) for r, t in e.scoring.queue])


def test_batch_math_equals_the_per_request_loops():
    async def main():
        for seed in range(40):
            for k in (1, 7, 32):
                n = random.Random(seed).randint(1, 300)
                a, b = _engine(random.Random(seed), n), _engine(random.Random(seed), n)
                for e in (a, b):
                    await e.start()
                    e._timeline = 12.5
                assert a._decode_s(k) == _decode_s_per_request(b, k)  # exact: the same sums, in order
                a._advance(k)
                ids = _advance_per_request(b, k)
                assert _state(a) == _state(b) and [r.id for r, _ in a.scoring.queue] == ids
                await a.close()
                await b.close()
    asyncio.run(main())
