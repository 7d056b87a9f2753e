"""SimEngine (roles/rollout/sim_engine.py) driven the way the rollout role drives an engine: one
consuming task per request, cancellation to abort, resume from prompt + output. Runs on the
virtual clock (simulated seconds cost no real time); nothing here asserts on wall-clock speed."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
from laminar.roles.rollout.sim_engine import CompressedClock, SimEngine, SimEngineClosed, VirtualClock

from laminar.sim.lengths import LengthDistribution, z_from_key
from laminar.stepcurve import StepCurve

LENGTHS = LengthDistribution.fit({"mean": 1020, "p50": 920, "p90": 1720, "p99": 2790}, cap=4096)  # 72B_math
CURVE = StepCurve.from_points([(1, 10.0), (16, 12.0), (64, 20.0), (256, 45.0)])
PROMPT = list(range(1, 101))


def engine(capacity: int = 1_000_000, clock=None, **kw) -> SimEngine:
    kw.setdefault("max_model_len", min(capacity, 8192))
    return SimEngine(curve=CURVE, lengths=LENGTHS, kv_capacity_tokens=capacity, prefill_ms_per_token=0.03,
                     clock=clock or VirtualClock(), **kw)


def expected_length(seed: int, max_tokens: int) -> tuple[int, str]:
    total = LENGTHS.from_z(z_from_key(seed, 0))
    return (total, "stop") if total < max_tokens else (max_tokens, "length")


async def consume(e: SimEngine, rid: str, prompt, max_tokens: int, seed, into: list | None = None):
    tokens, finish = into if into is not None else [], None
    async for toks, lps, reason in e.generate(rid, prompt, max_tokens, seed):
        assert len(toks) == len(lps) > 0
        tokens += toks
        finish = reason
    return len(tokens), finish


def run(coro, timeout: float = 20.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_lengths_follow_the_distribution_and_the_seed():
    async def main():
        e = engine()
        await e.start()
        got = await asyncio.gather(*(consume(e, f"r{i}", PROMPT, 3000, seed=i) for i in range(400)))
        stats = e.sim_stats()
        await e.close()
        return got, stats

    got, stats = run(main())
    assert got == [expected_length(i, 3000) for i in range(400)]
    lengths = np.array([n for n, _ in got])
    assert np.median(lengths) == pytest.approx(LENGTHS.quantile(0.5), rel=0.1)
    assert stats["finished"] == 400 and stats["preemptions"] == 0 and stats["free_blocks"] == 62_500
    assert stats["tokens"] == lengths.sum() and stats["sim_time_s"] > 0


def test_unseeded_requests_draw_their_own_lengths():
    async def main():
        e = engine(seed=3)
        await e.start()
        got = await asyncio.gather(*(consume(e, f"r{i}", PROMPT, 2000, seed=None) for i in range(50)))
        await e.close()
        return got

    got = run(main())
    assert len({n for n, _ in got}) > 25 and all(1 <= n <= 2000 for n, _ in got)


def test_small_cache_preempts_never_overfills_and_still_finishes_every_request():
    async def main():
        e = engine(capacity=8192, max_model_len=4096)
        peak = 0.0
        await e.start()
        jobs = asyncio.gather(*(consume(e, f"r{i}", [i + 1] * 50, 3000, seed=i) for i in range(48)))
        while not jobs.done():
            peak = max(peak, e.stats.kv_usage)
            await asyncio.sleep(0)
        got = await jobs
        stats = e.sim_stats()
        await e.close()
        return got, stats, peak

    got, stats, peak = run(main())
    assert got == [expected_length(i, 3000) for i in range(48)]
    assert stats["preemptions"] > 0
    assert 0.9 < peak <= 1.0 and stats["peak_kv_usage"] <= 1.0
    assert stats["free_blocks"] == 8192 // 16 and stats["kv_usage"] == 0.0  # nothing leaked


def test_requests_wait_beyond_max_num_seqs():
    async def main():
        e = engine(max_num_seqs=4)
        seen = []
        await e.start()
        jobs = asyncio.gather(*(consume(e, f"r{i}", PROMPT, 300, seed=i) for i in range(10)))
        while not jobs.done():
            seen.append((e.stats.running, e.stats.waiting))
            await asyncio.sleep(0)
        await jobs
        await e.close()
        return seen

    seen = run(main())
    assert max(r for r, _ in seen) == 4 and max(w for _, w in seen) >= 6


def test_cancelling_the_consumer_aborts_the_request():
    seed = next(s for s in range(1000) if expected_length(s, 4000)[0] > 1500)

    async def main():
        e = engine()
        await e.start()
        tokens: list[int] = []
        task = asyncio.create_task(consume(e, "long", PROMPT, 4000, seed, into=tokens))
        while len(tokens) < 200:
            await asyncio.sleep(0)
        assert e.stats.running == 1 and e.stats.kv_usage > 0
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        after_abort = dict(e.sim_stats())
        again = await consume(e, "long", PROMPT, 300, seed=1)  # the id is free again, the engine serves
        await e.close()
        return len(tokens), after_abort, again

    n, after, again = run(main())
    assert 200 <= n < expected_length(seed, 4000)[0]
    assert after["aborted"] == 1 and after["running"] == 0 and after["free_blocks"] == 62_500
    assert again == expected_length(1, 300)


def test_a_resumed_request_finishes_at_the_total_length():
    seed = next(s for s in range(1000) if 1500 < expected_length(s, 4000)[0] < 4000)
    total, reason = expected_length(seed, 4000)

    async def main():
        first, second = engine(), engine()  # migration: the rest runs on another engine
        await first.start()
        await second.start()
        tokens: list[int] = []
        task = asyncio.create_task(consume(first, "t#a.1", PROMPT, 4000, seed, into=tokens))
        while len(tokens) < 500:
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        done = len(tokens)
        rest = await consume(second, "t#b.2", PROMPT + tokens, 4000 - done, seed)
        capped = await consume(second, "t#b.3", PROMPT + tokens, 900 - done, seed)  # a tighter budget
        await first.close()
        await second.close()
        return done, rest, capped

    done, (rest, rest_reason), (capped, capped_reason) = run(main())
    assert done + rest == total and rest_reason == reason == "stop"
    assert done + capped == 900 and capped_reason == "length"


def test_prefix_caching_shares_a_group_prompt():
    prompt = list(range(1, 171))  # 10 full blocks of 16 + 10 tokens

    async def prefill_tokens(caching: bool) -> tuple[int, float]:
        e = engine(prefix_caching=caching)
        await e.start()
        jobs = asyncio.gather(*(consume(e, f"g.{i}", prompt, 200, seed=i) for i in range(16)))
        while e.stats.running < 16:
            await asyncio.sleep(0)
        kv = e.stats.kv_usage
        await jobs
        stats = e.sim_stats()
        await e.close()
        assert stats["free_blocks"] == 62_500
        return stats["prefill_tokens"], kv

    shared, kv_shared = run(prefill_tokens(True))
    private, kv_private = run(prefill_tokens(False))
    assert shared == 170 + 15 * 10 and private == 16 * 170
    assert kv_shared < kv_private


def test_load_relay_counts_versions_without_a_folder_and_reads_the_relay_with_one(tmp_path):
    torch = pytest.importorskip("torch")
    from laminar.weights.local_write import write_version
    from laminar.weights.store import ShmStore

    async def main():
        e = engine(load_s=2.0)
        await e.start()
        t0 = e.clock.now()
        versions = [await e.load_relay(str(tmp_path / "absent"), 0), await e.load_relay(str(tmp_path / "absent"), 5)]
        cost = e.clock.now() - t0
        (tmp_path / "empty").mkdir()
        versions.append(await e.load_relay(str(tmp_path / "empty"), 0))
        store = ShmStore(tmp_path / "relay")
        store.open()
        try:
            write_version(store, {"w": torch.zeros(4)}, 7)
            versions += [await e.load_relay(str(tmp_path / "relay"), 3), await e.load_relay(str(tmp_path / "relay"), 7)]
        finally:
            store.close()
        await e.load_file(str(tmp_path / "weights.pt"))
        await e.close()
        return versions, cost

    versions, cost = run(main())
    assert versions == [1, 6, -1, 7, -1]
    assert cost == pytest.approx(4.0)  # two loads of 2 simulated seconds


def test_close_fails_open_streams():
    async def main():
        e = engine()
        await e.start()
        tokens: list[int] = []
        task = asyncio.create_task(consume(e, "x", PROMPT, 4000, seed=next(
            s for s in range(1000) if expected_length(s, 4000)[0] > 1000), into=tokens))
        while not tokens:
            await asyncio.sleep(0)
        await e.close()
        with pytest.raises(SimEngineClosed):
            await task
        with pytest.raises(SimEngineClosed):
            await consume(e, "y", PROMPT, 10, seed=1)

    run(main())


def test_bad_requests_are_refused():
    async def main():
        e = engine(capacity=4096, max_model_len=1024)
        await e.start()
        with pytest.raises(ValueError, match="max_model_len"):
            await consume(e, "a", [1] * 1024, 10, seed=1)
        with pytest.raises(ValueError, match="max_tokens"):
            await consume(e, "b", PROMPT, 0, seed=1)
        n, reason = await consume(e, "c", [1] * 1000, 4000, seed=1)  # capped by max_model_len
        await e.close()
        return n, reason

    assert run(main()) == (24, "length")
    with pytest.raises(ValueError, match="exceeds the KV cache"):
        engine(capacity=1024, max_model_len=2048)


def test_compressed_clock_drives_the_engine():
    async def main():
        e = engine(clock=CompressedClock(speedup=1e4))
        await e.start()
        got = await asyncio.gather(*(consume(e, f"r{i}", PROMPT, 200, seed=i) for i in range(8)))
        await e.close()
        return got

    assert run(main()) == [expected_length(i, 200) for i in range(8)]


def test_from_workload_builds_the_paper_setups():
    try:
        e32 = SimEngine.from_workload(model="32B", tp=4, lengths="32B_math", max_num_seqs=1024)
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    from laminar.sim.hardware import gpu, kv_capacity_tokens, model
    assert e32.curve.source == "paper:32B_TP4" and e32.lengths.cap == 16384
    assert e32.num_blocks == kv_capacity_tokens(model("32B"), gpu("H800"), 4) // 16
    e72 = SimEngine.from_workload(model="72B", tp=8, lengths="72B_math", max_model_len=18432)
    assert e72.curve.source.startswith("roofline") and e72.load_s == pytest.approx(145.4e9 / 8 / 25e9, rel=0.01)


async def _three_requests(clock) -> tuple[list[tuple[str, float]], float, list[float]]:
    """Three requests of one 32-token prompt, capped at 40, 60 and 80 tokens (the 72B lengths are
    all longer), on a flat 10 ms step curve, prefill 0.5 ms per token, 1,024 tokens of KV in
    blocks of 16, no prefix caching, a boundary every step. Returns (request, simulated finish
    time) in completion order, the peak KV usage, and the KV usage seen at every token of r2."""
    e = SimEngine(curve=StepCurve.from_points([(1, 10.0), (64, 10.0)]), lengths=LENGTHS, kv_capacity_tokens=1024,
                  prefill_ms_per_token=0.5, max_model_len=512, emit_every=1, prefix_caching=False, clock=clock)
    await e.start()
    done: list[tuple[str, float]] = []
    kv: list[float] = []

    async def one(rid: str, cap: int):
        n = 0
        async for toks, _, _ in e.generate(rid, list(range(1, 33)), cap, seed=hash(rid) % 1000):
            n += len(toks)
            if rid == "r2":
                kv.append(e.stats.kv_usage)
        assert n == cap
        done.append((rid, round(e.sim_stats()["sim_time_s"], 6)))
    await asyncio.gather(one("r0", 40), one("r1", 60), one("r2", 80))
    peak = e.counters["peak_kv_usage"]
    await e.close()
    return done, peak, kv


def test_hand_checked_step_time_kv_usage_and_completion_order():
    """By hand: the three prompts' prefill costs 3 x 32 x 0.5 ms = 48 ms (charged to the steps
    that admit them); every decode step costs 10 ms (flat curve) and yields one token per running
    request, so a request capped at L tokens ends at 0.048 + L x 0.010 s: 0.448, 0.648, 0.848 s,
    in that order. Its consumer reads the engine's timeline when it sees the end, and by then the
    scheduler has already begun the next step while others still run (+10 ms for r0 and r1; r2 is
    the last, so exact). KV: a request holding 32 + t tokens holds ceil((32 + t) / 16) of the 64
    blocks; after the first step 3 x 3 blocks; the peak is 3 x 5 blocks (t = 33..40) = 15 / 64."""
    done, peak, kv = run(_three_requests(VirtualClock()))
    assert [r for r, _ in done] == ["r0", "r1", "r2"]
    assert [t for _, t in done] == pytest.approx([0.448 + 0.010, 0.648 + 0.010, 0.848], abs=1e-9)
    assert peak == pytest.approx(15 / 64)
    assert kv[0] == pytest.approx(3 * 3 / 64)      # after step 1: three requests of 33 tokens, 3 blocks each
    assert max(kv) == pytest.approx(15 / 64)


def test_virtual_and_compressed_time_give_the_same_run():
    """The same scenario on the virtual clock and in compressed real time (x20): the same
    completion order, the same simulated time between completions, the same KV usage (the
    timeline is the engine's own; a compressed clock only decides how long it sleeps, and where
    the timeline starts: at the real moment the first request arrived)."""
    virtual = run(_three_requests(VirtualClock()))
    compressed = run(_three_requests(CompressedClock(speedup=20)))
    assert [r for r, _ in compressed[0]] == [r for r, _ in virtual[0]]

    def gaps(done):
        return [b - a for (_, a), (_, b) in zip(done, done[1:], strict=False)]
    assert gaps(compressed[0]) == pytest.approx(gaps(virtual[0]), abs=1e-6)
    assert compressed[1] == virtual[1] and compressed[2] == virtual[2]
