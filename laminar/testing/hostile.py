"""What a compromised host's keys can send: the writes of a hostile rollout or reward key, built
from nothing but predictable ids, for tests and for a hostile chaos run.

Every function takes clients that already hold the hostile key (`InprocCluster.client_as`, or a
ZeroMQ transport made with that key's folder) and returns the replies, so a caller can assert
what the pools refused. Nothing here needs a secret the key's host would not have: ids are
`e<epoch>-p<prompt id>/<i>[~a<k>]` and the default prompt id is the dataset's row number.

    forged_spec(i, j, n)        the spec of member j of prompt i's group, as an attacker writes it
    squat_first_deltas(...)     seq 0 of other rollouts' trajectories (AppendDeltaBatch)
    forged_put(...)             a one-member group with a huge reward (PutTrajectory)
    forged_await(...)           AwaitReward for another rollout's id, naming a scorer nobody serves
    lease_everything(...)       LeaseRewards for as much as the pool gives, for as long as it allows
"""
from __future__ import annotations

import dataclasses

import numpy as np

from laminar.bus.errors import RemoteError
from laminar.protocol import (
    AppendDeltaBatch,
    AwaitReward,
    LeaseRewards,
    PutTrajectory,
    Trajectory,
    TrajectorySpec,
)


def forged_spec(prompt: int | str, member: int, group_size: int, epoch: int = 0, attempt: int = 0,
                prompt_tokens: np.ndarray | None = None, max_tokens: int = 256) -> TrajectorySpec:
    """Member `member` of prompt `prompt`'s group (pool "0"), without any hand-out."""
    gid = f"e{epoch}-p{prompt}"
    tail = f"~a{attempt}" if attempt else ""
    toks = np.array([1, 2, 3], np.int32) if prompt_tokens is None else prompt_tokens
    return TrajectorySpec(trajectory_id=f"{gid}/{member}{tail}", prompt_id=str(prompt), group_id=gid,
                          sample_index=member, group_size=group_size, prompt_tokens=toks, max_tokens=max_tokens)


def first_deltas(rollout_id: str, specs: list[TrajectorySpec], version: int = 0) -> AppendDeltaBatch:
    """Seq 0 of each spec (two tokens each), in columns, as a rollout's flush sends it."""
    n = len(specs)
    return AppendDeltaBatch(rollout_id, [s.trajectory_id for s in specs], np.zeros(n, np.int64),
                            np.full(n, version, np.int64), np.arange(0, 2 * n + 1, 2, dtype=np.int64),
                            np.full(2 * n, 7, np.int32), np.full(2 * n, -0.1, np.float32), list(specs))


async def squat_first_deltas(partials, rollout_id: str, specs: list[TrajectorySpec], version: int = 0):
    """Write seq 0 of `specs` as `rollout_id` (a rollout that was not handed them)."""
    return await partials.call(first_deltas(rollout_id, specs, version))


def trajectory(spec: TrajectorySpec, rollout_id: str, reward: float, version: int = 0, tokens: int = 2) -> Trajectory:
    return Trajectory(spec=spec, response_tokens=np.full(tokens, 7, np.int32),
                      logprobs=np.full(tokens, -0.1, np.float32), version=version, rollout_id=rollout_id,
                      reward=reward)


async def forged_put(buffer, rollout_id: str, spec: TrajectorySpec, reward: float = 1e6, group_size: int = 1):
    """Put a member of `spec`'s group as a whole group of `group_size` with `reward`."""
    forged = dataclasses.replace(spec, group_size=group_size)
    return await buffer.call(PutTrajectory(trajectory(forged, rollout_id, reward)))


async def forged_await(partials, rollout_id: str, spec: TrajectorySpec, scorer: str = "nobody"):
    """AwaitReward for `spec`'s trajectory as `rollout_id`, naming a scorer no replica serves; the
    reply, or the RemoteError it was refused with."""
    try:
        return await partials.call(AwaitReward(rollout_id, trajectory(spec, rollout_id, 0.0), {scorer: 1.0}))
    except RemoteError as exc:
        return exc


async def lease_everything(partials, replica_id: str, scorer: str, items: int = 10**6, lease_s: float = 1e9):
    """LeaseRewards asking for everything, for ever; the reply or the RemoteError."""
    try:
        return await partials.call(LeaseRewards(replica_id, scorer, items, lease_s))
    except RemoteError as exc:
        return exc
