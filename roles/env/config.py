"""Settings of an env role (`roles.env` in the run config)."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from laminar.envs.sandbox import SandboxConfig


class EnvRoleConfig(BaseModel):
    """Settings of the env role: the environment class it serves, sessions, deadlines, sandbox."""
    model_config = ConfigDict(extra="forbid")
    environment: str = Field("laminar.envs.python_tool:PythonToolEnv",
                             description="environment class 'package.module:Class' (one instance per episode)")
    options: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the environment class")
    tokenizer_dir: str | None = Field(None, description="model folder whose tokenizer decodes actions and encodes "
                                                        "observations (default: the byte tokenizer)")
    max_sessions: int = Field(1024, ge=1, description="episodes held at once; a reset beyond answers busy")
    idle_timeout_s: float = Field(600.0, gt=0, description="an episode untouched this long is closed")
    step_timeout_s: float = Field(60.0, gt=0, description="deadline of one reset/step inside the role "
                                                          "(keep the callers' rpc deadline above it)")
    max_inflight: int = Field(256, ge=1, description="requests handled at once before answering busy")
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig,
                                   description="limits of the code sandbox (for environments that need one)")
