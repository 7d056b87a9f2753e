"""Kinds of the env role (docs/architecture.md §14): multi-turn episodes served over request/reply.

A rollout drives one episode per trajectory, keyed by an `episode_id` it chooses (the trajectory
id is the natural one: the session survives a repack that moves the trajectory to another
rollout). Token ids in both directions (int32 raw frames); the env role decodes actions and
encodes observations with the policy's tokenizer, so observation tokens can be appended to the
context as they are (with loss mask 0).

Idempotent by step number: EnvReset of a known, not yet stepped episode returns its first reply
again; EnvStep(step=k) after step k was answered returns that same reply (the tool does not run
twice); any other step number is refused. EnvClose of an unknown episode is not an error.
"""
from __future__ import annotations

from dataclasses import field
from typing import Any

import numpy as np

from laminar.protocol.data import TrajectorySpec
from laminar.protocol.registry import event

__all__ = ["EnvReset", "EnvStep", "EnvReply", "EnvClose"]


@event("env.reset")
class EnvReset:
    """Start an episode for `spec` (its prompt tokens, reference answer, token budget)."""
    episode_id: str
    spec: TrajectorySpec


@event("env.step")
class EnvStep:
    """The tokens generated since the last observation (e.g. up to a `</tool>` stop string)."""
    episode_id: str
    step: int                    # 1, 2, ... within the episode
    action_tokens: np.ndarray    # int32


@event("env.reply")
class EnvReply:
    episode_id: str
    step: int                        # 0 answers the reset
    observation_tokens: np.ndarray   # int32, to append to the context (not trained on)
    reward: float                    # the episode's reward when done, else 0
    done: bool
    observation: str = ""            # the same observation as text (logs, debugging)
    info: dict[str, Any] = field(default_factory=dict)  # e.g. tool_calls, tool_wall_s


@event("env.close")
class EnvClose:
    """Forget these episodes (finished or abandoned); replied with Ack."""
    episode_ids: list[str]
