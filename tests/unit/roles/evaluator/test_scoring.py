"""The evaluation metrics (roles/evaluator/scoring.py): pass@k's unbiased estimator against a
brute-force count over every k-subset of the samples, and maj@k's documented tie rule."""
from __future__ import annotations

from itertools import combinations

import pytest
from laminar.roles.evaluator.scoring import ProblemResult, majority_correct, parse_metric, pass_at_k, score


def brute_pass_at_k(correct: list[bool], k: int) -> float:
    """The share of k-subsets of the samples that hold a correct one."""
    subsets = list(combinations(range(len(correct)), k))
    return sum(1 for s in subsets if any(correct[i] for i in s)) / len(subsets)


@pytest.mark.parametrize("correct", [[True, False, False, False, False], [False] * 6, [True] * 4,
                                     [False, True, False, True, False, False, True, False]])
def test_pass_at_k_matches_a_brute_force_count(correct):
    for k in range(1, len(correct) + 1):
        assert pass_at_k(len(correct), sum(correct), k) == pytest.approx(brute_pass_at_k(correct, k), abs=1e-12)


def test_pass_at_k_known_values_and_bad_input():
    assert pass_at_k(5, 1, 1) == pytest.approx(0.2)
    assert pass_at_k(5, 1, 2) == pytest.approx(0.4)     # 1 - C(4,2)/C(5,2) = 1 - 6/10
    assert pass_at_k(4, 2, 3) == 1.0                    # three of four always hold a correct one
    with pytest.raises(ValueError, match="n=2 c=0 k=3"):
        pass_at_k(2, 0, 3)


def test_maj_at_k_ties_score_the_correct_share():
    assert majority_correct(["7", "7", "8"], [True, True, False]) == 1.0
    assert majority_correct(["8", "7", "8"], [False, True, False]) == 0.0
    assert majority_correct(["7", "8"], [True, False]) == 0.5                       # a tie of two, one right
    assert majority_correct(["8", "7"], [False, True]) == 0.5                       # order does not matter
    assert majority_correct(["7", "8", "9", "9", "7"], [True, False, False, False, True]) == 0.5
    assert majority_correct([None, None, "8"], [False, False, False]) == 0.0       # no answer: no vote
    assert majority_correct([None, None], [False, False]) == 0.0


def test_pass_at_k_score_over_a_set_and_metric_names():
    rs = [ProblemResult(True, [True, False, False, True], ["3", "4", "4", "3"]),
          ProblemResult(False, [False, False, False, False], ["1", "1", None, "2"])]
    got = score(rs, ["greedy", "avg@4", "avg@2", "pass@2", "maj@4", "maj@3"])
    assert got == {"greedy": 0.5, "avg@4": 0.25, "avg@2": 0.25, "pass@2": pytest.approx((1 - 1 / 6) / 2),
                   "maj@4": 0.25, "maj@3": 0.0}
    assert parse_metric("pass@8", 8) == ("pass", 8)
    with pytest.raises(ValueError, match="needs 9 samples"):
        parse_metric("maj@9", 8)
    with pytest.raises(ValueError, match="unknown eval metric 'best@2'"):
        parse_metric("best@2", 8)
