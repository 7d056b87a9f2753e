"""RewardPlan: what a finished trajectory's reward is made of (`roles.rollout.rewards`).

Each term is a rule function (`fn: module:fn`, called here in the rollout) or a scorer (`role:
<name>`, a `reward` role's model: classifier, judge or HTTP service) with a weight. The rollout
computes the rule terms at once; if the plan has no scorer the trajectory goes to the buffer as
before, else it goes to the partial pool to await its scorers (docs/rewards.md) and the rollout
moves on. reward = sum(weight x score) over the terms; every term's raw score is kept in
`Trajectory.reward_components` ("fn:<module:fn>" for a rule function, the scorer's name else).

The older `reward: module:fn` is the plan [{fn: that, weight: 1}].
"""
from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field, model_validator

from laminar.tasks import load_callable


class RewardTerm(BaseModel):
    """One term of a composed reward: a rule function or a model scorer, with its weight."""
    model_config = ConfigDict(extra="forbid")
    fn: str | None = Field(None, description="rule function 'module:fn' (spec, response tokens) -> float")
    role: str | None = Field(None, description="scorer name of a `reward` role (its `scorer` setting)")
    weight: float = Field(1.0, description="weight of this term in the sum")

    @model_validator(mode="after")
    def _one_source(self):
        if (self.fn is None) == (self.role is None):
            raise ValueError("a rewards term names exactly one of fn (a rule function) or role (a scorer)")
        return self


class RewardPlan:
    """The rule functions to call here and the scorers to wait for."""

    def __init__(self, fns: list[tuple[str, Callable, float]], scorers: dict[str, float]):
        self.fns, self.scorers = fns, scorers

    @classmethod
    def from_settings(cls, reward: str, terms: list[RewardTerm] | None) -> RewardPlan:
        if not terms:
            return cls([(f"fn:{reward}", load_callable(reward), 1.0)], {})
        fns = [(f"fn:{t.fn}", load_callable(t.fn), t.weight) for t in terms if t.fn is not None]
        return cls(fns, {t.role: t.weight for t in terms if t.role is not None})

    @classmethod
    def of(cls, fn) -> RewardPlan:
        """A bare reward function (tests, older callers) or a plan already."""
        return fn if isinstance(fn, RewardPlan) else cls([("fn", fn, 1.0)], {})

    def rule_part(self, spec, tokens, log=None) -> tuple[float, dict[str, float]]:
        """(weighted sum of the rule terms, their raw scores). A function that raises scores 0
        (a broken verifier must not lose the trajectory) and is logged."""
        total, parts = 0.0, {}
        for name, fn, w in self.fns:
            try:
                v = float(fn(spec, tokens))
            except Exception as exc:
                if log is not None:
                    log.error("reward_failed", trajectory=spec.trajectory_id, fn=name, error=repr(exc))
                v = 0.0
            parts[name] = v
            total += w * v
        return total, parts
