"""The evaluation metrics of one eval set, from each problem's answers (pure functions, no I/O).

Per problem the evaluator has the greedy answer's correctness and n sampled answers, each with its
correctness (reward >= 1) and, for majority voting, its extracted final answer (None: none). Over
the set's problems, each metric is a mean:

    greedy   the greedy answer is correct
    avg@k    the share of the first k samples that are correct (pass@1 at the set's temperature)
    pass@k   the unbiased estimator 1 - C(n-c, k) / C(n, k) over all n samples, c of them correct
             (Chen et al. 2021): the probability that k samples drawn without replacement from the n
             hold a correct one; with n = k it is "any of the k is correct"
    maj@k    the most frequent extracted answer among the first k samples is correct. Samples
             without an answer do not vote; none voting scores 0. A tie between m answers scores
             the share of them that are correct (the expectation of a uniformly random tie-break),
             so the result never depends on the order of the samples.

A metric name is `greedy`, or `avg@k` / `pass@k` / `maj@k` with k >= 1 no larger than the set's
samples (`parse_metric` says which and checks it).

Every mean comes with its 95% interval over the problems (`score_with_intervals`): the binomial
(Wilson) interval when each problem scores 0 or 1 (greedy, avg@1), else a bootstrap over problems.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from math import comb

from laminar.intervals import interval

_METRIC = re.compile(r"^(greedy|(avg|pass|maj)@([1-9][0-9]*))$")


def parse_metric(name: str, samples: int) -> tuple[str, int]:
    """(kind, k) of a metric name; ValueError naming it when it is unknown or k > samples."""
    m = _METRIC.match(name)
    if m is None:
        raise ValueError(f"unknown eval metric {name!r}: greedy, avg@k, pass@k or maj@k")
    if m.group(1) == "greedy":
        return "greedy", 0
    k = int(m.group(3))
    if k > samples:
        raise ValueError(f"eval metric {name!r} needs {k} samples a problem; the set has samples: {samples}")
    return m.group(2), k


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def majority_correct(answers: list, correct: list[bool]) -> float:
    """maj of these samples: 1 / 0 for a clear winner, the correct share of a tie, 0 for no votes."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return 0.0
    top = max(votes.values())
    winners = [a for a, n in votes.items() if n == top]
    right = {a for a, ok in zip(answers, correct, strict=True) if a is not None and ok}
    return sum(1 for a in winners if a in right) / len(winners)


@dataclass
class ProblemResult:
    """One problem's answers: the greedy one's correctness, the samples' correctness and answers."""
    greedy: bool | None = None
    correct: list[bool] = field(default_factory=list)
    answers: list = field(default_factory=list)


def per_problem(results: list[ProblemResult], metrics: list[str]) -> dict[str, list[float]]:
    """{metric: one score in [0, 1] per problem} for the named metrics (parse_metric's names)."""
    out: dict[str, list[float]] = {}
    if not results:
        return out
    n = min(len(r.correct) for r in results)
    for name in metrics:
        kind, k = parse_metric(name, n)
        if kind == "greedy":
            vals = [1.0 if r.greedy else 0.0 for r in results]
        elif kind == "avg":
            vals = [sum(r.correct[:k]) / k for r in results]
        elif kind == "pass":
            vals = [pass_at_k(len(r.correct), sum(r.correct), k) for r in results]
        else:
            vals = [majority_correct(r.answers[:k], r.correct[:k]) for r in results]
        out[name] = vals
    return out


def score(results: list[ProblemResult], metrics: list[str]) -> dict[str, float]:
    """{metric: mean over the problems} for the named metrics (parse_metric's names)."""
    return {name: sum(vals) / len(vals) for name, vals in per_problem(results, metrics).items()}


def score_with_intervals(results: list[ProblemResult], metrics: list[str]) -> dict[str, tuple[float, float, float]]:
    """{metric: (mean, lo, hi)}: each mean with its 95% interval over the problems
    (laminar/intervals.py: Wilson's when every problem scores 0 or 1, as greedy accuracy does,
    else a bootstrap over problems)."""
    out = {}
    for name, vals in per_problem(results, metrics).items():
        lo, hi = interval(vals, binary=True if name == "greedy" else None)
        out[name] = (sum(vals) / len(vals), lo, hi)
    return out
