"""structlog set-up: one JSON event per line on stderr, tagged with the process's component, and
mirrored onto the bus as LogEvent on `log.<role>` (info and above) so `laminar-node tail` can
follow a whole cluster. The mirror never blocks: beyond the publisher's HWM an event is dropped.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any

import structlog

from laminar.protocol import LogEvent

_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}


class BusMirror:
    """structlog processor that republishes each event on the bus (from the loop thread only)."""

    def __init__(self, role: str, id: str, min_level: str = "info"):
        self.role, self.id, self.min = role, id, _LEVELS[min_level]
        self.publisher = None
        self.thread = threading.get_ident()

    def __call__(self, logger: Any, method: str, ev: dict) -> dict:
        pub = self.publisher
        if pub is not None and _LEVELS.get(method, 20) >= self.min and threading.get_ident() == self.thread:
            fields = {k: v if isinstance(v, (int, float, str, bool, type(None))) else repr(v)
                      for k, v in ev.items() if k not in ("event", "level", "timestamp")}
            pub.publish(f"log.{self.role}", LogEvent(role=self.role, id=self.id, level=method,
                                                     event=str(ev.get("event")), ts=time.time(), fields=fields))
        return ev


def configure(component: str, level: str = "info", mirror: BusMirror | None = None, stream=None) -> None:
    processors: list = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        lambda _l, _m, ev: {**ev, "component": component},
    ]
    if mirror is not None:
        processors.append(mirror)
    processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(stream or sys.stderr),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=max(_LEVELS[level], logging.WARNING), stream=stream or sys.stderr)
