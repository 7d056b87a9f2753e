"""Settings of a rollout that holds agent episodes (`roles.rollout.agent`; roles/rollout/agent.py)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class RolloutAgentConfig(BaseModel):
    """Agent mode: every trajectory of this rollout is an episode that an outside agent program drives
    through the gateway's OpenAI-compatible API (docs/architecture.md §14)."""
    model_config = ConfigDict(extra="forbid")
    gateway: str = Field("0", description="id of the gateway role the episodes are announced to")
    tokenizer_dir: str | None = Field(None, description="model folder whose tokenizer and chat template render "
                                      "the calls (default: the rollout's model_dir)")
    chat_template: str = Field("auto", description="auto (the tokenizer's own template; the byte tokenizer's "
                               "built-in one) or the path of a Jinja chat template file")
    max_calls: int = Field(32, ge=1, description="turn budget: calls per episode; the episode ends after this many")
    wall_s: float = Field(600.0, gt=0, description="wall-time budget of an episode from when it was taken; then it "
                          "ends (finish_reason timeout, or agent_failed if it was never called)")
    default_max_tokens: int = Field(256, ge=1, description="completion tokens of a call that names no max_tokens "
                                    "(never more than the episode's token budget leaves)")
    on_rewrite: Literal["refuse", "segment"] = Field(
        "refuse", description="a call whose rendered context does not extend the episode's recorded tokens (the "
        "agent rewrote its history): refuse it (HTTP 409), or start a new segment: its whole context appended as "
        "an observation, which later calls extend (the engine still sees the earlier segments first: the "
        "trajectory stays one sequence the engine saw); counted either way")
    announce_interval_s: float = Field(1.0, gt=0, description="how often the rollout announces all its episodes "
                                       "to the gateway (new and ended ones go at once)")
    rpc_timeout_s: float = Field(5.0, gt=0, description="deadline of one announce to the gateway")
