"""Kinds of agent episodes (docs/architecture.md §14): the gateway role and the rollouts that hold the episodes.

An agent episode is a trajectory of a rollout in agent mode (roles/rollout/agent.py): it waits
for an outside agent program to call the OpenAI-compatible gateway (roles/gateway/), which routes
each call to the rollout holding the episode. Three requests, all must arrive:

    AnnounceEpisodes  rollout -> gateway   the episodes a rollout holds (new ones at once, all of
                                           them every `announce_interval_s`, ended ones when
                                           stored): the gateway's routing table is soft state,
                                           rebuilt from these after a restart or a move
    AgentCall         gateway -> rollout   one /v1/chat/completions or /v1/completions request of
                                           an episode; `call_id` makes it idempotent (a retry, or
                                           the next poll of a streamed call, names it again) and
                                           `offset` says how many chunks the gateway already has
    EndEpisode        gateway -> rollout   the agent's end of the episode, with its reward or none
                                           (then the rollout's reward function scores it)

A call's reply is final (`done`) only once its tokens are durable in the partial pool. Errors
are typed (bus ErrorReply codes): `not_here` (the rollout does not hold the episode: it moved or
ended; the gateway waits for an announce), `rewritten` (the call's context does not extend what
the episode recorded), `ended` (the episode is over), `busy` (another call of it is running),
`bad_request`.
"""
from __future__ import annotations

import numpy as np

from laminar.protocol.registry import event

__all__ = ["EpisodeInfo", "AnnounceEpisodes", "AgentCall", "AgentChunk", "AgentCallReply", "EndEpisode"]


@event("agent.episode")
class EpisodeInfo:
    """One episode as its rollout sees it."""
    episode_id: str
    version: int                 # the weight version that serves every call of it
    lineage: int = 0
    prompt: str = ""             # the prompt pool's prompt, as text: what an agent starts from
    group_id: str = ""
    sample_index: int = 0
    calls: int = 0               # calls recorded so far
    tokens: int = 0              # response tokens recorded so far (observations included)
    state: str = "open"          # open | ended | failed


@event("agent.announce")
class AnnounceEpisodes:
    """The episodes rollout `rollout_id` holds, reachable at `control_address`. `full`: this is all
    of them (an episode the gateway placed here that is missing has left this rollout)."""
    rollout_id: str
    control_address: str
    episodes: list[EpisodeInfo]
    full: bool = False


@event("agent.call")
class AgentCall:
    """One API request of episode `episode_id`: `api` "chat" or "completions", `body` its JSON as the
    client sent it. Streamed (`stream`), the reply comes as soon as there is something new after
    `offset` chunks; otherwise when the call is done."""
    episode_id: str
    call_id: str
    api: str
    body: str
    stream: bool = False
    offset: int = 0


@event("agent.chunk")
class AgentChunk:
    """New output of one choice: text, its token ids and logprobs; `finish_reason` on its last chunk
    (with the parsed tool calls as a JSON list, chat only)."""
    index: int
    text: str
    token_ids: np.ndarray            # int32
    logprobs: np.ndarray             # float32
    finish_reason: str = ""
    tool_calls: str = ""             # JSON [{"name", "arguments"}], "" = none
    top_logprobs: str = ""           # JSON [[[token text, logprob], ...] per token], "" = not asked


@event("agent.call_reply")
class AgentCallReply:
    episode_id: str
    call_id: str
    chunks: list[AgentChunk]         # those after the request's offset
    done: bool                       # the call is over and its tokens are durable
    version: int                     # the weight version that served it
    lineage: int = 0
    prompt_tokens: int = 0           # the context the engine saw
    completion_tokens: int = 0
    rewrite: bool = False            # the context rewrote the episode's history: a new segment began
    replayed: bool = False           # a retry of the episode's last call: its recorded result, not generated again


@event("agent.end")
class EndEpisode:
    """End the episode: `reward` from the agent, or None to have the rollout's reward score it."""
    episode_id: str
    reward: float | None = None
    reason: str = "agent"
