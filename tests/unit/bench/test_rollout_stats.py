"""bench/rollout.py's arithmetic: the median of the rounds' ratios with its spread and IQR, each
round's ratio from its two passes, and the clock of full garbage collections a pass reports."""
from __future__ import annotations

import gc
import math
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
    # (tokens, seconds, CPU here, CPU in the engine's processes, full-GC seconds)
    row = bench.round_row(2, (1000, 2.0, 0.05, 0.3, 0.01), (1000, 1.6, 0.04, 0.3, 0.0))
    assert row["ratio"] == pytest.approx(0.8) and row["role_first"] is True
    assert row["role_cpu_us_per_token"]["here"] == pytest.approx(50.0)
    assert row["gc_s"] == {"role": 0.01, "engine": 0.0}
    assert bench.round_row(3, (10, 1.0, 0, 0, 0), (10, 1.0, 0, 0, 0))["role_first"] is False


def test_median_interval_is_the_order_statistics_that_cover_95_percent():
    bench = load_bench()
    for n, (lo, hi) in {5: (1, 5), 8: (1, 8), 12: (3, 10), 16: (4, 13), 21: (6, 16)}.items():
        xs = list(range(1, n + 1))
        random.Random(n).shuffle(xs)  # the order of the rounds does not matter
        assert bench.median_ci(xs) == (lo, hi)
        # [x(k), x(n-k+1)] covers at least 95%, one rank tighter does not (from six values on)
        cover = lambda k, n=n: sum(math.comb(n, j) for j in range(k, n - k + 1)) / 2 ** n  # noqa: E731
        assert (cover(lo) >= 0.95 or n < 6) and (n < 6 or cover(lo + 1) < 0.95)
    with pytest.raises(ValueError):
        bench.median_ci([])


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
