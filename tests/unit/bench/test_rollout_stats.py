"""bench/rollout.py's arithmetic: the median of the rounds' ratios with its 95% interval, spread
and IQR, each round's ratio from its two sides, the pinning of a side to its core, and the clock
of full garbage collections a pass reports."""
from __future__ import annotations

import gc
import math
import os
import random

import pytest

from tests import support

pytestmark = pytest.mark.timeout(60)


def load_bench():
    return support.load_bench("rollout")


def test_spread_is_range_and_iqr_over_the_median():
    bench = load_bench()
    s = bench.spread_of([1.1, 0.9, 1.0, 0.95, 1.05])
    assert s["median"] == 1.0 and s["min"] == 0.9 and s["max"] == 1.1
    assert s["spread"] == pytest.approx(0.2) and s["iqr"] == pytest.approx(0.1)
    one = bench.spread_of([0.8])
    assert one["median"] == 0.8 and one["spread"] == 0.0 and one["iqr"] == 0.0


def test_round_ratio_is_role_rate_over_engine_rate():
    bench = load_bench()
    # role (tokens, seconds, CPU of its process, of its engine, full-GC seconds); twin (tokens,
    # seconds, CPU of its client, of its engine)
    row = bench.round_row(2, (1000, 2.0, 0.05, 0.3, 0.01), (1000, 1.6, 0.04, 0.3))
    assert row["ratio"] == pytest.approx(0.8) and row["role_core"] == 0
    assert row["role_cpu_us_per_token"]["here"] == pytest.approx(50.0)
    assert row["engine_cpu_us_per_token"]["engine"] == pytest.approx(300.0)
    assert row["gc_s"] == 0.01
    assert bench.round_row(3, (10, 1.0, 0, 0, 0), (10, 1.0, 0, 0))["role_core"] == 1


def test_median_interval_is_the_order_statistics_that_cover_95_percent():
    bench = load_bench()
    for n, (lo, hi) in {5: (1, 5), 8: (1, 8), 12: (3, 10), 16: (4, 13), 21: (6, 16)}.items():
        xs = list(range(1, n + 1))
        random.Random(n).shuffle(xs)  # order of the rounds does not matter
        assert bench.median_ci(xs) == (lo, hi)
        # coverage of [x(k), x(n-k+1)] is at least 95%, and one rank tighter is not (n >= 6)
        cover = lambda k, n=n: sum(math.comb(n, j) for j in range(k, n - k + 1)) / 2 ** n  # noqa: E731
        assert (cover(lo) >= 0.95 or n < 6) and (n < 6 or cover(lo + 1) < 0.95)
    with pytest.raises(ValueError):
        bench.median_ci([])


def test_round_summary_reports_the_median_its_interval_and_each_core():
    bench = load_bench()
    rows = [bench.round_row(k, (1000, 1.0, 0.04, 0.2, 0.0), (1000, r, 0.03, 0.2))
            for k, r in enumerate([0.95, 0.97, 0.96, 0.99, 0.98, 0.94, 1.0, 0.93], start=1)]
    s = bench.round_summary(rows)
    ratios = sorted(r["ratio"] for r in rows)
    assert s["role_over_engine"] == pytest.approx((ratios[3] + ratios[4]) / 2)
    assert s["role_over_engine_ci95"] == [ratios[0], ratios[-1]]  # 8 rounds: min and max
    assert s["role_over_engine_spread"] == pytest.approx((ratios[-1] - ratios[0]) / s["role_over_engine"])
    assert set(s["by_core"]) == {"role_on_core_0", "role_on_core_1"} and s["same_tokens"] is True
    assert s["role_cpu_us_per_token"]["process"] == pytest.approx(40.0)


def test_pin_tree_moves_every_thread_of_a_process():
    bench = load_bench()
    twin = bench.sys.modules["_twin"]
    mine = os.sched_getaffinity(0)
    one = min(mine)
    try:
        twin.pin_tree([os.getpid()], {one})
        tids = [int(t) for t in os.listdir(f"/proc/{os.getpid()}/task")]
        assert all(os.sched_getaffinity(t) == {one} for t in tids)
        twin.pin_tree([2 ** 22 + 12345], {one})  # a process that is gone is skipped
    finally:
        twin.pin_tree([os.getpid()], mine)
    assert os.sched_getaffinity(0) == mine


def test_gc_clock_counts_full_collections_only():
    bench = load_bench()
    clock = bench.GcClock()
    try:
        gc.collect(0)
        assert clock.total == 0.0
        junk = [[i] for i in range(200_000)]  # something for a full collection to walk
        gc.collect()
        del junk
        assert clock.total > 0.0
    finally:
        gc.callbacks.remove(clock._event)
        gc.callbacks.remove(bench.GC._event)
