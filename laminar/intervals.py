"""95% intervals for accuracies, so a reader can tell whether +0.03 on 128 problems means anything.

    lo, hi = wilson(k, n)                          # greedy accuracy: k right of n problems
    lo, hi = bootstrap_mean(per_problem)           # avg@k, pass@k, maj@k: one score in [0, 1] per problem
    d, lo, hi = paired_difference(before, after)   # the same problems scored twice (before/after RL)

- `wilson` is the Wilson score interval of a binomial proportion: unlike the normal approximation
  it stays inside [0, 1] and is honest at 0 and at n.
- `bootstrap_mean` resamples problems with replacement (percentile interval): the problems are
  the unit of sampling, whatever each problem's score is made of (k samples, a majority...).
- `paired_difference` resamples problems and takes the mean difference of the two scores of each
  problem: the right interval for "after minus before" on one held-out set, much narrower than two
  independent intervals because a problem's difficulty is shared by both. The difference is
  significant when the interval excludes 0.

Bootstraps are seeded (same input, same interval) and vectorized with numpy.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

Z95 = 1.959963984540054   # the standard normal's 97.5% quantile


def wilson(k: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of k successes in n trials ((0, 1) when n is 0)."""
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= k <= n:
        raise ValueError(f"wilson: {k} successes of {n}")
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    lo, hi = max(0.0, mid - half), min(1.0, mid + half)
    return (0.0 if k == 0 else lo), (1.0 if k == n else hi)   # exact at the ends, not 1 - 1e-16


def _boot_index(n: int, reps: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n, size=(reps, n))


def bootstrap_mean(values: Sequence[float], reps: int = 2000, conf: float = 0.95,
                   seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of per-problem scores ((0, 1) when empty)."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return 0.0, 1.0
    means = x[_boot_index(x.size, reps, seed)].mean(axis=1)
    a = (1 - conf) / 2
    return float(np.quantile(means, a)), float(np.quantile(means, 1 - a))


def paired_difference(before: Sequence[float], after: Sequence[float], reps: int = 2000, conf: float = 0.95,
                      seed: int = 0) -> tuple[float, float, float]:
    """(mean of after − before, lo, hi): a bootstrap over problems of the paired difference."""
    b = np.asarray(before, dtype=np.float64)
    a = np.asarray(after, dtype=np.float64)
    if b.shape != a.shape:
        raise ValueError(f"paired_difference: {b.size} scores before, {a.size} after (the same problems needed)")
    if b.size == 0:
        return 0.0, -1.0, 1.0
    d = a - b
    means = d[_boot_index(d.size, reps, seed)].mean(axis=1)
    q = (1 - conf) / 2
    return float(d.mean()), float(np.quantile(means, q)), float(np.quantile(means, 1 - q))


def interval(values: Sequence[float], binary: bool | None = None) -> tuple[float, float]:
    """The interval of a mean of per-problem scores: Wilson when every score is 0 or 1 (or
    `binary`), else the bootstrap."""
    x = [float(v) for v in values]
    if binary is None:
        binary = all(v in (0.0, 1.0) for v in x)
    return wilson(sum(x), len(x)) if binary else bootstrap_mean(x)
