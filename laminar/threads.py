"""Work threads a role may have to abandon at stop, and the process exit that respects them.

A role runs blocking torch work (a training step, a collective) in daemon threads so that a stop
is not held hostage by it. Such a thread still inside torch while the interpreter tears down can
crash the process, so `leave` exits with os._exit (after flushing) while one is running, and also
when the role asked for it (`exit_without_teardown`): a process that joined a torch.distributed
group keeps native state (gloo's threads, the rendezvous store's client) whose destructors at
interpreter exit can abort a cleanly stopped rank ("terminate called without an active
exception"). This module imports nothing of Laminar: the trainer role and the role shell both use it.
"""
from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable

import structlog

log = structlog.get_logger("laminar.threads")


def work_thread(target: Callable[[], None], name: str) -> threading.Thread:
    """Start a daemon thread for blocking work the role may have to abandon at stop (a training
    step, a collective). `leave` exits at once while one of these is still running."""
    t = threading.Thread(target=target, name=name, daemon=True)
    t.laminar_work = True  # type: ignore[attr-defined]
    t.start()
    return t


_no_teardown: list[str] = []


def exit_without_teardown(reason: str) -> None:
    """Make `leave` end the process with os._exit (after flushing) even with no work thread
    running: for native state whose destructors must not run at interpreter exit."""
    _no_teardown.append(reason)


def leave(code: int) -> int:
    """The role's exit: `code`, or, while a work thread is still running (a stop in the middle of
    a training step), os._exit(code) after flushing: a daemon thread inside torch when the
    interpreter tears down can crash the process (a stopped SmolLM2 trainer exited -11)."""
    busy = [t.name for t in threading.enumerate() if getattr(t, "laminar_work", False) and t.is_alive()]
    if not busy and not _no_teardown:
        return code
    if busy:
        log.warning("exit_with_work_in_flight", threads=busy, code=code)
    else:
        log.info("exit_without_teardown", why=_no_teardown, code=code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
