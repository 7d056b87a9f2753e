"""A logger that takes keyword fields with or without structlog.

The weight publisher runs on the trainer, and also on a bare GPU box where bench/gpu.py measures the
copy path with nothing but torch installed. There structlog may be missing, so `kw_logger(name)`
returns structlog's logger when it is importable and otherwise a small stand-in that writes the
event and its fields through the standard `logging` module (warning and error, the levels the
publisher uses).
"""
from __future__ import annotations

import logging


class _KwLog:
    """`log.warning("event", field=value)` over the standard logging module."""

    def __init__(self, name: str):
        self._log = logging.getLogger(name)

    def warning(self, event: str, **kw) -> None:
        self._log.warning("%s %s", event, kw)

    def error(self, event: str, **kw) -> None:
        self._log.error("%s %s", event, kw)


def kw_logger(name: str):
    """structlog's logger `name`, or a stand-in over `logging` where structlog is not installed."""
    try:
        import structlog  # optional on a bare GPU box (bench/gpu.py)
    except ImportError:
        return _KwLog(name)
    return structlog.get_logger(name)
