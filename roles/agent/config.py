"""Settings of the agent role (`roles.agent` in the run config; roles/agent/role.py)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from laminar.envs.sandbox import SandboxConfig


def _agent_sandbox() -> SandboxConfig:
    """An agent talks to the gateway for its whole episode: more CPU and memory than a tool call."""
    return SandboxConfig(wall_s=600.0, cpu_s=300, memory_mb=1536, max_processes=32, max_output_bytes=1 << 20,
                         scratch_mb=256, max_open_files=256)


class AgentConfig(BaseModel):
    """Which agent program runs per episode, how many at once, with which budget and confinement."""
    model_config = ConfigDict(extra="forbid")
    script: str = Field("laminar.tasks.calc_agent", description="the agent program: a module name or the path "
                        "of a .py file; its source runs as the sandbox's main.py (standard library and `openai`)")
    gateway: str = Field("0", description="id of the gateway role whose API the agents call")
    gateway_url: str | None = Field(None, description="or the gateway's URL (http://HOST:PORT/v1), for a gateway "
                                    "outside this config")
    api_key_file: str | None = Field(None, description="file with the gateway's API key (default: the gateway "
                                     "role's api_key_file)")
    concurrency: int = Field(4, ge=1, description="agent programs running at once")
    budget_s: float = Field(300.0, gt=0, description="wall-clock budget of one agent run: killed at it (the "
                            "whole process group, and with it the sandbox)")
    isolation: Literal["sandbox", "process"] = Field("sandbox", description="sandbox: laminar/envs/sandbox.py "
                                                     "(namespaces, seccomp, cgroups; needs root); process: a plain "
                                                     "child process (trusted agents, machines without root)")
    sandbox: SandboxConfig = Field(default_factory=_agent_sandbox, description="limits of the agent's sandbox")
    port_inside: int = Field(8000, ge=1, le=65535, description="the port the gateway has inside the sandbox "
                             "(OPENAI_BASE_URL=http://127.0.0.1:PORT/v1)")
    env: dict[str, str] = Field(default_factory=dict, description="more environment variables for the agent "
                                "(e.g. LAMINAR_MAX_TURNS)")
    claim_wait_s: float = Field(10.0, ge=0, description="how long one claim waits for an open episode")
    max_episodes: int | None = Field(None, ge=1, description="stop (exit 0) after this many episodes; null: run "
                                     "until stopped")
    log_output_bytes: int = Field(2000, ge=0, description="tail of the agent's stdout and stderr put in its log line")
