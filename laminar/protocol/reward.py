"""Kinds of model-scored rewards (docs/rewards.md): a finished trajectory waits in the partial
pool for its model scores; reward replicas lease that work, score it and submit the scores.

    rollout     --AwaitReward-->   partial pool   (durable, then the rollout moves on)
    reward role --LeaseRewards-->  partial pool   -> RewardWork (leased until a deadline)
    reward role --SubmitScores-->  partial pool   -> ScoreResult (each score applied once)

All three go by request/reply and are idempotent by trajectory id: AwaitReward again is a
duplicate; a second score for a (trajectory, scorer) already scored is refused and counted.
"""
from __future__ import annotations

from dataclasses import field

from laminar.protocol.data import Trajectory
from laminar.protocol.registry import event

__all__ = ["AwaitReward", "LeaseRewards", "RewardWork", "SubmitScores", "ScoreResult"]


@event("reward.await")
class AwaitReward:
    """Keep this finished trajectory until every scorer in `pending` has scored it. Its `reward`
    holds the weighted sum of the components computed already (the rule functions, also listed
    in `reward_components`); `pending` maps each scorer still to come to its weight."""
    rollout_id: str
    trajectory: Trajectory
    pending: dict[str, float] = field(default_factory=dict)


@event("reward.lease")
class LeaseRewards:
    """Up to `max_items` trajectories awaiting `scorer`, leased to `replica_id` for `lease_s`
    seconds (work whose lease expired is handed out again). The pool bounds both (items, bytes,
    lease time) and a `reward.<scorer>` key may lease only that scorer's work."""
    replica_id: str
    scorer: str
    max_items: int
    lease_s: float = 30.0


@event("reward.work")
class RewardWork:
    """One bounded page of leased work (the pool caps items, bytes and the lease's length): ask
    again for more while `waiting` says there is."""
    trajectories: list[Trajectory]
    waiting: int = 0    # trajectories awaiting this scorer and not leased, after this lease
    lease_s: float = 0.0  # the lease granted (at most the pool's lease_max_s); 0: as asked (an older pool)


@event("reward.submit")
class SubmitScores:
    """Scores of `scorer` for these trajectories (one per id, in order); `parse_failed` lists the
    ids whose score is a configured fallback (a judge answer that did not parse). A score is
    applied only against `replica_id`'s own lease of that trajectory."""
    replica_id: str
    scorer: str
    trajectory_ids: list[str]
    scores: list[float]
    parse_failed: list[str] = field(default_factory=list)


@event("reward.score_result")
class ScoreResult:
    applied: int
    refused: dict[str, str] = field(default_factory=dict)  # trajectory id -> why (already scored, unknown)
