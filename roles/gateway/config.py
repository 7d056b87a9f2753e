"""Settings of the agent gateway (`roles.gateway` in the run config; roles/gateway/role.py)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class GatewayConfig(BaseModel):
    """The OpenAI-compatible endpoint: where it listens, what it calls its model, how long a call
    may wait for a moved episode, and its bounds."""
    model_config = ConfigDict(extra="forbid")
    http_port: int = Field(8000, ge=0, le=65535, description="HTTP port of the OpenAI-compatible API (0: any free)")
    http_bind: str | None = Field(None, description="interface of the HTTP API (null: the host's `bind`)")
    model_name: str = Field("laminar-policy", description="the model id GET /v1/models lists and replies name")
    api_key_file: str | None = Field(None, description="file holding the key a client must send as `Authorization: "
                                     "Bearer KEY` (the OpenAI clients' api_key); null: no key")
    call_timeout_s: float = Field(900.0, gt=0, description="longest one API call may take, generation included")
    reroute_wait_s: float = Field(60.0, gt=0, description="how long a call of an episode whose rollout died or "
                                  "moved it waits for the rollout that holds it now to announce it; then 503, "
                                  "retryable")
    lost_after_s: float = Field(120.0, gt=0, description="an episode no live rollout has announced for this long "
                                "ends as failed (410 to its agent)")
    stale_after_s: float = Field(10.0, gt=0, description="a rollout silent this long (no announcement) hands out "
                                 "no new episodes and is taken for dead by the calls it fails")
    claim_wait_s: float = Field(10.0, ge=0, description="longest POST /v1/episodes waits for an episode to open "
                                "(then 503 with Retry-After)")
    remember_ended: int = Field(65536, ge=16, description="ended episodes remembered, so their late calls are "
                                "answered `episode_ended` rather than `unknown_episode`")
    max_connections: int = Field(1024, ge=1, description="HTTP connections at once (more are answered 503)")
    max_body_bytes: int = Field(8 << 20, ge=1024, description="largest request body (413 above)")
    max_inflight: int = Field(256, ge=1, description="bus requests (announcements) handled at once before busy")
    rpc_timeout_s: float = Field(10.0, gt=0, description="deadline of one bus request to a rollout beyond its poll")
