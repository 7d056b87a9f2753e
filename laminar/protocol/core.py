"""Core kinds every role speaks: handshake, typed errors, echo, heartbeats, logs, metrics, control.

Topics on the pub/sub bus (docs/architecture.md §3): `hb.<role>.<id>`, `log.<role>`, `metrics.<role>`,
`ctrl.<role>.<id>`. Pub/sub only carries what a later message supersedes; anything that must
arrive goes by request/reply.
"""
from __future__ import annotations

from dataclasses import field
from typing import Any

import numpy as np

from laminar.protocol.registry import event

__all__ = [
    "Hello", "Welcome", "ErrorReply", "Ping", "Pong", "Heartbeat", "LogEvent", "Metrics",
    "Shutdown", "Ack", "ERROR_CODES",
]

# Codes an ErrorReply may carry; the client maps each to one exception type (bus/errors.py).
ERROR_CODES = (
    "protocol_mismatch",  # peer speaks another PROTOCOL_VERSION
    "bad_request",        # malformed body / wrong field types
    "unknown_kind",       # no handler for this kind on this server
    "deadline",           # request arrived after its deadline
    "busy",               # server at its in-flight limit (backpressure); retry later
    "refused",            # semantically refused (e.g. wrong weight version)
    "internal",           # handler raised
    "unavailable",        # server shutting down
    "not_here",           # an agent episode this rollout does not hold (moved or ended): ask where it is
    "rewritten",          # an agent call whose context does not extend its episode's recorded tokens
    "ended",              # an agent episode that is over
)


@event("hello")
class Hello:
    """First call on a new connection: the client states its protocol and identity."""
    protocol: int
    role: str
    id: str


@event("welcome")
class Welcome:
    protocol: int
    role: str
    id: str


@event("error")
class ErrorReply:
    code: str
    message: str


@event("ack")
class Ack:
    """Generic acknowledgement; `detail` says what happened (e.g. 'duplicate')."""
    detail: str = ""


@event("ping")
class Ping:
    seq: int
    payload: bytes = b""
    array: np.ndarray | None = None


@event("pong")
class Pong:
    seq: int
    payload: bytes = b""
    array: np.ndarray | None = None
    server: str = ""


@event("heartbeat")
class Heartbeat:
    """Published every `heartbeat_s` on `hb.<role>.<id>`; carries the role's full current state."""
    role: str
    id: str
    host: str
    pid: int
    seq: int
    uptime_s: float
    state: str  # starting | ready | stopping
    status: dict[str, Any] = field(default_factory=dict)
    dropped_frames: int = 0


@event("log")
class LogEvent:
    """One structlog event, mirrored onto `log.<role>` so `laminar-node tail` can follow it."""
    role: str
    id: str
    level: str
    event: str
    ts: float
    fields: dict[str, Any] = field(default_factory=dict)


@event("metrics")
class Metrics:
    role: str
    id: str
    ts: float
    values: dict[str, float] = field(default_factory=dict)


@event("shutdown")
class Shutdown:
    """Published on `ctrl.<role>.<id>` (or `ctrl.all`): stop gracefully."""
    reason: str = ""
