"""Settings of the partial pool (`roles.partial_pool`): held deltas, the store, remembered
completions, paging, and the bounds of the reward plane (docs/rewards.md)."""
from __future__ import annotations

from laminar.roles.sqlite_store import commit_window_field
from pydantic import BaseModel, ConfigDict, Field


class PartialPoolConfig(BaseModel):
    """Settings of the partial pool: held deltas, store, remembered completions, reward leases."""
    model_config = ConfigDict(extra="forbid")
    max_held: int = Field(256, ge=1, description="out-of-order deltas held per trajectory")
    max_held_bytes: int = Field(256 << 20, ge=1 << 16, description="bytes of out-of-order deltas held at once "
                                "(tokens and logprobs), over every trajectory; a delta past it is rejected "
                                "(its writer sends it again after the gap fills)")
    store_dir: str | None = Field(None, description="folder of the SQLite store (default: <workdir>/pools)")
    commit_window_s: float = commit_window_field()
    remember_completed: int = Field(200_000, ge=1, description="completed trajectory ids kept to refuse late "
                                    "deltas; older ones are forgotten, which bounds memory and start-up")
    max_held_only: int = Field(65_536, ge=1, description="trajectories seen only through out-of-order deltas "
                               "(no seq 0 yet) held at once; beyond it the oldest are dropped")
    page_size: int = Field(4096, ge=1, le=8192, description="most trajectories one InFlightOf reply lists (a "
                           "partial is up to five arrays, one bus frame each: 8192 stays well below the frame limit)")
    page_bytes: int = Field(8 << 20, ge=1 << 16, le=12 << 20, description="token bytes one InFlightOf or "
                            "RewardWork reply carries at most (below the bus's 16 MiB body limit; a page holds at "
                            "least one item)")
    experience_buffer: str = Field("0", description="id of the experience buffer that scored trajectories (those "
                                   "that awaited a model's reward here) are handed to")
    forward_retry_s: float = Field(0.2, gt=0, description="first wait before offering a scored trajectory to a "
                                   "buffer that refused it (full) or is down again; doubles up to 5 s")
    forward_window: int = Field(32, ge=1, le=1024, description="scored trajectories handed to the buffer at once "
                                "(their puts overlap, their deletes here share one commit)")
    reward_give_up_expired: int | None = Field(5, ge=1, description="expired leases of one trajectory for one "
                                               "scorer (its replicas died, hung or failed on it) after which the "
                                               "pool stops waiting and applies `reward_fallback`, flagged "
                                               "(docs/rewards.md); None: never")
    reward_give_up_s: float | None = Field(None, gt=0, description="seconds a trajectory may await a scorer before "
                                           "the pool applies `reward_fallback`, flagged (None: wait for ever)")
    reward_never_leased_s: float | None = Field(600.0, gt=0, description="seconds a trajectory may await a scorer "
                                                "that no replica leased it for (a scorer nobody serves) before the "
                                                "pool applies `reward_fallback`, flagged and alarmed (None: for ever)")
    reward_fallback: float = Field(0.0, description="the score a scorer given up on counts as (its weight applies)")
    lease_max_items: int = Field(1024, ge=1, le=8192, description="most trajectories one LeaseRewards gets, "
                                 "whatever it asks (a trajectory is up to five arrays, one bus frame each)")
    lease_max_s: float = Field(600.0, gt=0, description="longest lease handed out: a longer lease_s asked for is cut "
                               "to it (RewardWork.lease_s says what was granted), so no replica holds work for ever")
    lease_shared_after_s: float | None = Field(60.0, gt=0, description="an item leased this long (from its first "
                                               "lease) without a score is leased to any other replica of its scorer "
                                               "that asks as well, and the first score applied wins: a replica "
                                               "sitting on its leases (hung, or a key leasing everything over and "
                                               "over) holds an item back this long, not lease_max_s; keep it above "
                                               "the replicas' own lease_s. null: a lease is exclusive until it ends")
    max_awaiting: int = Field(200_000, ge=1, description="trajectories awaiting their scores held at once; beyond it "
                              "AwaitReward is answered busy (the rollout retries)")
    max_awaiting_bytes: int = Field(4 << 30, ge=1 << 20, description="bytes of those trajectories' arrays held at "
                                    "once; beyond it AwaitReward is answered busy")
