"""What scoring one response costs, by its length: detokenizing it and verifying its answer.

    cost = RewardCost.from_points([(500, 0.004), (16000, 0.03)])   # (response tokens, seconds)
    cost.seconds(4000)            # one response of 4,000 tokens
    cost.total([812, 4000, ...])  # a batch scored one after another (a single controller)

Design decisions:
- The points are measured, not assumed: bench/reward_cost.py times `laminar.tasks.math:
  math_reward` and SmolLM2's detokenizer on step-by-step solutions of 500 to 16,000 tokens, and
  configs/sim/paper.yaml (`reward.s_by_response_tokens`) copies each bucket's mean (a sum over
  thousands of responses is their count times the mean, not the median).
- Between points the cost is interpolated linearly; below the first it is the first point's
  (scoring has a floor: the verifier's parse of the answer); above the last it follows the last
  segment (detokenizing and scanning the text grow with it), never downwards.
- Who pays it is the scenario's business (laminar/sim/scenario.py): the barrier baselines'
  driver sums it over the batch, in the trainer's iteration (verl's reward manager scores one
  response after another); laminar's rollouts pay it inline, one trajectory after another per
  rollout, before a trajectory is stored (roles/rollout/sim_engine.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RewardCost:
    """Seconds to score a response, piecewise-linear in its tokens (module docstring)."""
    tokens: tuple[float, ...]
    seconds_at: tuple[float, ...]

    def __post_init__(self):
        if not self.tokens or len(self.tokens) != len(self.seconds_at):
            raise ValueError("reward cost: needs matching, non-empty token and second lists")
        if any(b <= a for a, b in zip(self.tokens, self.tokens[1:], strict=False)):
            raise ValueError(f"reward cost: token counts must increase, got {list(self.tokens)}")
        if min(self.seconds_at) < 0:
            raise ValueError(f"reward cost: seconds must be >= 0, got {list(self.seconds_at)}")

    @classmethod
    def from_points(cls, points) -> RewardCost:
        """From [(tokens, seconds), ...] in any order."""
        pts = sorted((float(n), float(s)) for n, s in points)
        return cls(tuple(n for n, _ in pts), tuple(s for _, s in pts))

    def seconds(self, tokens):
        """Seconds to score a response of `tokens` tokens (a number, or an array of them)."""
        x = np.asarray(tokens, dtype=float)
        y = np.interp(x, self.tokens, self.seconds_at)
        if len(self.tokens) > 1:
            slope = max(0.0, (self.seconds_at[-1] - self.seconds_at[-2]) / (self.tokens[-1] - self.tokens[-2]))
            y = np.where(x > self.tokens[-1], self.seconds_at[-1] + slope * (x - self.tokens[-1]), y)
        return float(y) if np.ndim(y) == 0 else y

    def total(self, lengths) -> float:
        """Seconds to score every response of `lengths`, one after another."""
        lengths = np.asarray(list(lengths), dtype=float)
        return float(self.seconds(lengths).sum()) if lengths.size else 0.0
