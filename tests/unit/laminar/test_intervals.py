"""laminar/intervals.py: the 95% intervals every reported accuracy carries."""
from __future__ import annotations

import numpy as np
import pytest

from laminar.intervals import bootstrap_mean, interval, paired_difference, wilson


def test_interval_wilson_matches_the_textbook_values():
    # Wilson 95% for 81 of 263 (Newcombe 1998, Table I: 0.2553-0.3662)
    lo, hi = wilson(81, 263)
    assert lo == pytest.approx(0.2553, abs=5e-4) and hi == pytest.approx(0.3662, abs=5e-4)
    assert wilson(0, 10)[0] == 0.0 and 0 < wilson(0, 10)[1] < 0.35
    assert wilson(10, 10)[1] == 1.0
    with pytest.raises(ValueError):
        wilson(11, 10)


def test_interval_width_shrinks_like_one_over_root_n():
    w128 = np.subtract(*wilson(64, 128)[::-1])
    w512 = np.subtract(*wilson(256, 512)[::-1])
    assert w512 == pytest.approx(w128 / 2, rel=0.05)


def test_interval_bootstrap_covers_the_mean_and_is_seeded():
    x = np.random.default_rng(1).random(400)
    lo, hi = bootstrap_mean(x)
    assert lo < x.mean() < hi and hi - lo < 0.08
    assert bootstrap_mean(x) == (lo, hi)
    assert interval([0.5, 0.25, 1.0]) == bootstrap_mean([0.5, 0.25, 1.0])
    assert interval([0, 1, 1]) == wilson(2, 3)


def test_interval_paired_difference_sees_what_two_separate_intervals_cannot():
    rng = np.random.default_rng(2)
    before = (rng.random(512) < 0.4).astype(float)
    after = before.copy()
    flip = rng.choice(np.flatnonzero(before == 0), 30, replace=False)
    after[flip] = 1.0   # +30 of 512 problems, none lost
    d, lo, hi = paired_difference(before, after)
    assert d == pytest.approx(30 / 512)
    assert lo > 0    # significant paired...
    assert wilson(after.sum(), 512)[0] < wilson(before.sum(), 512)[1]   # ...though the two intervals overlap
    with pytest.raises(ValueError):
        paired_difference([1, 0], [1])
