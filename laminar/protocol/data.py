"""Kinds of the data module (docs/architecture.md §2, §5; every kind with its peers: §4): prompt pool,
partial response pool, experience buffer.

Everything here goes by request/reply and is acknowledged only once durable; every write is
idempotent (trajectory ids, delta sequence numbers), so a retry after a lost reply does no harm.
Token ids are int32 arrays, logprobs float32 arrays (raw frames on the wire).

Multi-turn trajectories (roles/rollout/multiturn.py) interleave the policy's tokens with
environment observations. `loss_mask` marks which response tokens the policy generated (1) and
which an environment wrote (0: trained on by no one, behaviour logprob 0). `obs_spans` lists the
environment's replies in order, the reset's first, as response-token ranges [start, end) (a reply
without tokens has start == end): action k is the tokens between reply k-1's end and reply k's
start, which is what a rollout needs to resume or replay an episode (the final reply, which ends
the episode, is not appended). Both default to None, which means a single-turn trajectory: all
tokens are the policy's.

Mixture-of-experts policies: `routing` holds the experts the inference engine chose for each
processed position of prompt + response (laminar/models/routing.py: `[positions, layers, top_k]`,
uint8 or uint16, position 0 = the first prompt token). A delta carries the rows after those its
trajectory recorded before (rows and tokens are cut separately: a position gets its row when the
engine has processed it, a step after its token was sampled); the partial pool concatenates them and
hands them back in PartialState, so a trajectory resumed elsewhere keeps them; the trainer replays
them (docs/moe.md). None: not recorded (a dense model, or capture off).
"""
from __future__ import annotations

import re
from dataclasses import field
from typing import Any

import numpy as np

from laminar.protocol.registry import event

__all__ = [
    "TrajectorySpec", "TakeBatch", "Batch", "RequeueGroups", "TokenDelta", "AppendDeltas",
    "DeltaResult", "InFlightOf", "GetPartial", "PartialState", "PartialList", "ReassignPartial",
    "CompletePartial", "Trajectory", "PutTrajectory", "PutResult", "SampleGroups", "Samples",
    "BufferStatsRequest", "BufferStats", "PoolCount", "HandedGroups", "HandedList", "GroupPresence",
    "GroupPresenceReply", "AppendDeltaBatch", "RequeueResult", "GrantPartials", "GroupResults", "GateOpen",
]

_FIRST_POOL_GROUP = re.compile(r"e\d+-p")          # prompt pool "0": e<epoch>-p<prompt id>
_OTHER_POOL_GROUP = re.compile(r"(.+?)\.e\d+-p")   # any other: <pool id>.e<epoch>-p<prompt id>


_ATTEMPT = re.compile(r"~a(\d+)(?:~r\d+)*$")


def attempt_of(trajectory_id: str) -> int:
    """The attempt `k` a trajectory id names (`<group>/<i>~a<k>`, a restart's `~r<n>` after it); 0: none."""
    m = _ATTEMPT.search(trajectory_id)
    return int(m.group(1)) if m else 0


def group_id_prefix(pool_id: str) -> str:
    """What a prompt pool's group ids start with: nothing for pool "0", "<id>." for the others
    (group ids are unique across pools)."""
    return "" if str(pool_id) == "0" else f"{pool_id}."


def pool_of_group(group_id: str) -> str:
    """The prompt pool a group id came from (the inverse of `group_id_prefix`; a pool whose id
    itself looks like "e<n>-p..." would be read as pool "0")."""
    if _FIRST_POOL_GROUP.match(group_id):
        return "0"
    m = _OTHER_POOL_GROUP.match(group_id)
    return m.group(1) if m else "0"


@event("data.trajectory_spec")
class TrajectorySpec:
    """One trajectory to generate: a member of a GRPO group (provenance travels with it).
    `handout`: the pools' MAC binding this spec to the rollout it was handed to (roles/handout.py):
    the partial pool and the buffer accept a rollout's first delta, AwaitReward and put of it only
    with a `handout` made for that rollout (b"": none)."""
    trajectory_id: str
    prompt_id: str
    group_id: str
    sample_index: int
    group_size: int
    prompt_tokens: np.ndarray  # int32
    answer: str = ""
    max_tokens: int = 256
    handout: bytes = b""
    handed_prompt: np.ndarray | None = None  # int32: the prompt as handed out, when the rollout replaced it
    #                                          (an agent episode's first call: roles/rollout/agent.py); the
    #                                          hand-out covers this one


# -- prompt pool ------------------------------------------------------------------------------
@event("data.take_batch")
class TakeBatch:
    """`batch_seq` makes the call idempotent: asking again with the same (rollout_id, batch_seq)
    after a lost reply returns the same batch instead of handing out new groups. `version` is the
    asking rollout's weight version: the barrier modes (sync, one_step, stream) gate on it."""
    rollout_id: str
    max_trajectories: int
    batch_seq: int = -1
    version: int = -1
    pid: int = 0  # the asking process (its heartbeat's pid): what it is handed is accounted to it; 0 = unknown


@event("data.batch")
class Batch:
    trajectories: list[TrajectorySpec]
    exhausted: bool = False  # the dataset has no more epochs to hand out
    # empty because the pool's gate is shut for the asking version: a newer version opens it, or the
    # pool's `data.gate_open` (requeued groups, groups dropped untrained); until then asking is idle
    gated: bool = False


@event("data.requeue_groups")
class RequeueGroups:
    """Groups whose trajectories were lost before completion: hand them out again first. An entry
    is a group id (the whole group) or a member's trajectory id `<group>/<i>` (that member alone).
    `settled`: entries handed to `rollout_id` that are safe elsewhere (partial pool or buffer): the
    pool stops accounting them to that rollout."""
    group_ids: list[str]
    rollout_id: str = ""
    settled: list[str] = field(default_factory=list)


@event("data.handed_groups")
class HandedGroups:
    """Prompt pool query: entries handed out and not yet settled or requeued, oldest first.
    `rollout_id` "*" = every rollout; `pid` != 0: only what that process of it was handed."""
    rollout_id: str = "*"
    pid: int = 0
    limit: int = 4096
    offset: int = 0          # skip this many matching entries (paging)


@event("data.handed_list")
class HandedList:
    entries: list[str]       # group ids or member ids `<group>/<i>`
    rollout_ids: list[str]   # who holds each
    group_sizes: list[int]
    more: bool = False       # the limit cut the list: ask again after settling these
    group_ids: list[str] = field(default_factory=list)  # the group of each entry
    members: list[int] = field(default_factory=list)    # the member of each entry; -1 = the whole group
    pids: list[int] = field(default_factory=list)       # the process each was handed to (0 = unknown)
    attempts: list[int] = field(default_factory=list)   # the attempt each went out as (its ids' `~a<k>`; 0: none)


# -- partial response pool -----------------------------------------------------------------------
@event("data.token_delta")
class TokenDelta:
    trajectory_id: str
    seq: int                   # 0, 1, 2, ... per trajectory: exactly-once by this number
    tokens: np.ndarray         # int32, new tokens since seq-1
    logprobs: np.ndarray       # float32, behaviour logprob of each new token
    version: int               # weight version generating this trajectory
    spec: TrajectorySpec | None = None  # required on seq 0
    loss_mask: np.ndarray | None = None  # uint8 per token of this delta (0 = observation); None = all 1
    obs_spans: np.ndarray | None = None  # int32 [n, 2]: environment replies appended in this delta (module docstring)
    epoch: int = 0  # ownership epoch the writer holds (PartialState.epoch); older than the pool's = fenced off
    lineage: int = -1  # lineage epoch of `version` (with version: which weights; -1 = not known)
    routing: np.ndarray | None = None  # MoE: uint8/uint16 [rows, layers, top_k] expert ids of the positions
    #                                    after those earlier deltas recorded (module docstring); None = none


@event("data.append_deltas")
class AppendDeltas:
    rollout_id: str
    deltas: list[TokenDelta]


@event("data.append_delta_batch")
class AppendDeltaBatch:
    """AppendDeltas in columns: one request of a few arrays however many deltas it carries (the
    codec's cost is per array, not per delta). Delta k is (trajectory_ids[k], seqs[k],
    versions[k], tokens and logprobs [offsets[k]:offsets[k+1]]); the seq-0 deltas take `specs` in
    order. Multi-turn deltas carry `loss_mask` (a delta that had none: all 1) and their observation
    spans in `obs_spans`, cut by `obs_offsets` (a delta with no span row had none). Answered with a
    DeltaResult, with the same exactly-once semantics."""
    rollout_id: str
    trajectory_ids: list[str]
    seqs: np.ndarray                     # int64, one per delta
    versions: np.ndarray                 # int64, one per delta
    offsets: np.ndarray                  # int64, one more than deltas
    tokens: np.ndarray                   # int32, every delta's tokens, concatenated
    logprobs: np.ndarray                 # float32, likewise
    specs: list[TrajectorySpec] = field(default_factory=list)  # of the seq-0 deltas, in their order
    epochs: np.ndarray | None = None     # int64 ownership epoch per delta (None: all 0)
    loss_mask: np.ndarray | None = None  # uint8 per token (None: all 1)
    lineages: np.ndarray | None = None   # int64 lineage epoch of each delta's version (None: all -1, not known)
    routing: np.ndarray | None = None    # MoE: every delta's routing rows, concatenated (None: no delta has any)
    routing_offsets: np.ndarray | None = None  # int64, one more than deltas: delta k's rows [off[k]:off[k+1]]
    obs_spans: np.ndarray | None = None  # int32 [m, 2]: every delta's observation spans, concatenated (None: none)
    obs_offsets: np.ndarray | None = None  # int64, one more than deltas: delta k's spans [off[k]:off[k+1]]


@event("data.delta_result")
class DeltaResult:
    applied: int
    duplicates: int
    held: int                                   # out of order, waiting for the gap to fill
    rejected: dict[str, str] = field(default_factory=dict)  # trajectory id -> why


@event("data.in_flight_of")
class InFlightOf:
    """Partial pool query: the trajectories in flight owned by `rollout_id` ("*" or "": any owner),
    one page at a time in trajectory id order. Every reply is bounded (the pool's page size and
    page bytes, whatever `limit` asks): ask again with `after` = the reply's `next_after` while
    its `more` is set."""
    rollout_id: str
    limit: int = 0           # most partials in the reply (0: the pool's page size; never more than it)
    after: str = ""          # paging: only trajectory ids after this one (the previous page's next_after)


@event("data.get_partial")
class GetPartial:
    trajectory_id: str


@event("data.partial_state")
class PartialState:
    spec: TrajectorySpec
    tokens: np.ndarray     # int32, generated so far
    logprobs: np.ndarray   # float32
    version: int
    rollout_id: str
    next_seq: int
    loss_mask: np.ndarray | None = None  # uint8 per token so far (0 = observation); None = all 1
    obs_spans: np.ndarray | None = None  # int32 [n, 2]: every environment reply so far (module docstring)
    lineage: int = -1    # lineage epoch of `version` (-1: not known, e.g. written without one to the partial pool)
    epoch: int = 0  # ownership epoch: a new owner writes with it; writes with an older one are refused
    routing: np.ndarray | None = None  # MoE: [positions, layers, top_k] expert ids recorded so far (docstring)

    @property
    def remaining_tokens(self) -> int:
        return max(0, self.spec.max_tokens - len(self.tokens))


@event("data.partial_list")
class PartialList:
    partials: list[PartialState]
    more: bool = False       # a page bound cut the list: ask again with after = next_after
    next_after: str = ""     # the last trajectory id in this page


@event("data.reassign_partial")
class ReassignPartial:
    """Give a trajectory to another owner; with `fence` its ownership epoch advances, so the
    previous owner's later writes are refused (the Ack's detail is `epoch <n>`)."""
    trajectory_id: str
    rollout_id: str
    fence: bool = False


@event("data.grant_partials")
class GrantPartials:
    """Manager to partial pool, before a MigrateIn: rollout `rollout_id` may take these
    trajectories over (fence them to itself). Their owner does not change until it does, so a
    MigrateIn that never comes leaves them where they were. A rollout key may claim only what it
    owns or was granted (docs/security.md)."""
    trajectory_ids: list[str]
    rollout_id: str


@event("data.group_presence")
class GroupPresence:
    """Partial pool or buffer query: which members of these groups does it hold? `attempts`: entry
    (group id, or member id `<group>/<i>`) -> the attempt that is current for it; the partial pool
    then counts a member in flight only under that attempt's ids (a member id's own entry first)."""
    group_ids: list[str]
    attempts: dict[str, int] = field(default_factory=dict)


@event("data.group_presence_reply")
class GroupPresenceReply:
    present: dict[str, list[int]]  # group id -> sample indices held; [-1] = the whole group is settled here


@event("data.complete_partial")
class CompletePartial:
    trajectory_ids: list[str]


# -- experience buffer ----------------------------------------------------------------------------
@event("data.trajectory")
class Trajectory:
    """A finished, scored trajectory with full provenance (docs/architecture.md §5)."""
    spec: TrajectorySpec
    response_tokens: np.ndarray     # int32
    logprobs: np.ndarray            # float32, behaviour logprobs
    version: int
    rollout_id: str
    reward: float
    finish_reason: str = "stop"     # stop | length | abort | env_failed (multi-turn)
    loss_mask: np.ndarray | None = None  # uint8 per response token (0 = tool output), None = all 1
    timings: dict[str, float] = field(default_factory=dict)  # phase -> epoch seconds (`*_s`: durations)
    obs_spans: np.ndarray | None = None  # int32 [n, 2]: environment replies (multi-turn); None = none
    lineage: int = 0                # lineage epoch of the weights `version` names (with version: which weights)
    reward_components: dict[str, float] = field(default_factory=dict)  # name -> raw score ("fn:<module:fn>",
    #                                 a scorer's name); `reward` is their weighted sum (docs/rewards.md)
    run_id: str = ""                # the run of the weights that generated it ("": none, the model folder's)
    routing: np.ndarray | None = None  # MoE: uint8/uint16 [positions, layers, top_k] experts the rollout's engine
    #                                 chose, from the first prompt token on (module docstring); None = not recorded


@event("data.put_trajectory")
class PutTrajectory:
    trajectory: Trajectory


@event("data.put_result")
class PutResult:
    status: str  # stored | duplicate | full
    detail: str = ""


@event("data.sample_groups")
class SampleGroups:
    """Up to `num_groups` complete groups. `cursor`: the caller's position (groups it has received
    and kept so far); groups handed out at or after it that were not committed are handed again
    first (a trainer resumed from a checkpoint, or a reply lost). `committed`: positions below it
    are durable on the caller's side (checkpointed) and may be forgotten; None: a hand-out is final
    at once (no re-hand possible). `lineage`: the trainer's lineage epoch (-1: not known, nothing
    is checked) and `forks` ({epoch: the version it started from}): groups generated by weights
    outside that lineage's history are dropped, counted and requeued, never handed out."""
    num_groups: int
    trainer_version: int
    cursor: int | None = None
    committed: int | None = None
    lineage: int = -1
    forks: dict[str, int] = field(default_factory=dict)
    # dynamic sampling: a complete group whose `filter_metric` ("reward" or "accuracy": reward >= 1)
    # has a population std <= `filter_min_std` is dropped (never handed out, counted per prompt pool),
    # at most `filter_max_drop` of them in this request; past that they are handed out as usual.
    # "" (the default): no filter
    filter_metric: str = ""
    filter_min_std: float = 0.0
    filter_max_drop: int = 0
    run_id: str = ""  # the trainer's run: samples generated by another run's weights are dropped like off-lineage ones


@event("data.samples")
class Samples:
    groups: list[list[Trajectory]]
    cursor: int                     # groups handed out so far (checkpointed by the trainer)
    dropped_stale: int = 0
    dropped_nosignal: int = 0       # groups this request dropped for no spread (SampleGroups.filter_metric)
    dropped_nosignal_tokens: int = 0  # their response tokens: the generation they cost


@event("data.buffer_stats_request")
class BufferStatsRequest:
    pass


@event("data.buffer_stats")
class BufferStats:
    counts: dict[str, int]
    staleness_histogram: dict[str, int] = field(default_factory=dict)


@event("data.gate_open")
class GateOpen:
    """Published on `data.gate_open` by a gated prompt pool when groups may be handed out again
    without a newer version: groups were requeued, or the experience buffer dropped groups
    untrained (their window gets replacements). Rollouts idle at the gate ask again at once."""
    pool_id: str


@event("data.pool_count")
class PoolCount:
    """Published on `metrics.<pool>` by each pool: its full current counts."""
    role: str
    id: str
    counts: dict[str, Any] = field(default_factory=dict)


@event("data.requeue_result")
class RequeueResult:
    """The prompt pool's answer to RequeueGroups, item by item: one bad entry does not sink the rest."""
    requeued: list[str]                  # entries that will be handed out again (as their next attempt)
    settled: list[str]                   # `settled` entries no longer accounted to the rollout
    refused: dict[str, str] = field(default_factory=dict)  # entry -> why (unknown id, never handed out)


@event("data.group_results")
class GroupResults:
    """Experience buffer -> the prompt pool that made these groups: how many samples of each
    completed group solved its prompt (reward >= 1), for the pool's difficulty curriculum. Item i
    is (group_ids[i], solved[i], sizes[i]); idempotent by group id. Answered with Ack."""
    group_ids: list[str]
    solved: list[int]
    sizes: list[int]
