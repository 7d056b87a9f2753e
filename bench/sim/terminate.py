"""SIGTERM in the sweep's processes (bench/scale.py and its children): each one removes the
/dev/shm folders it made, promptly, whether the signal reaches it alone or the whole process
tree at once (`pkill -f bench/scale.py`, a systemd, Slurm or docker stop, which SIGKILL what still
runs after their stop timeout).

- Outside a sim cluster (`exit_on_sigterm`), SIGTERM ends the process as Ctrl-C does: SystemExit
  through its finally blocks (the sweep stops its children, then removes its work folder).
- While a sim cluster runs in this process (inside `deferred()`), SIGTERM only asks it to stop:
  the run's `stop_when` sees `asked()` within a second, the cluster stops in order (rollouts
  before the pools they flush to, as at a run's normal end) and its weight folders are removed;
  on leaving the block the process exits with 143 and writes no result. A SystemExit raised
  inside the event loop instead made asyncio.run cancel every role at once: the rollouts then
  waited out their `shutdown_s` on pools already gone, and the child outlived its parent's grace.
- A second SIGTERM (a tree-wide one reaches a child directly and again through its parent's
  stop) is ignored: it cannot break off the clean-up the first one started.
"""
from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

EXIT_CODE = 128 + signal.SIGTERM


class _State:
    deferring = 0    # > 0 inside deferred(): a sim cluster is running in this process
    asked = False    # a SIGTERM came while deferring


def exit_on_sigterm() -> None:
    """Install this process's SIGTERM handling (module docstring)."""
    def once(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if _State.deferring:
            _State.asked = True
            return
        sys.exit(128 + signum)
    signal.signal(signal.SIGTERM, once)


def asked() -> str | None:
    """The reason to stop the running cluster now, if a SIGTERM asked for it (a `stop_when`)."""
    return "stopped by SIGTERM" if _State.asked else None


@contextmanager
def deferred() -> Iterator[None]:
    """Run a sim cluster: a SIGTERM inside the block asks it to stop (`asked`) and the process
    exits with 143 when the block is left, after the cluster's own clean-up."""
    _State.deferring += 1
    try:
        yield
    finally:
        _State.deferring -= 1
        if _State.asked and not _State.deferring:
            sys.exit(EXIT_CODE)
