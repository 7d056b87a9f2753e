"""RunPin: the one run whose weights a relay or a rollout takes (docs/weights.md, "Pinned to one run").

Why: every run of a key folder seals its versions with the same weights key, so a seal proves
"some trainer of this cluster", not "this run". A relay folder recorded from an earlier run of the
same model is a pile of genuinely sealed versions; compared by `manifest.supersedes` alone
(another run replaces whatever is held) any of them would roll every host's weights back.

The rule (`accepts`):
- once the trainer has announced its run (its heartbeat names it; a master relay also takes the
  run that the trainer's own PUBLISH or PART link offers, proven by the trainer's key), only that
  run is taken;
- before any announcement, the run of the weights held is the pin (nothing held, or weights of no
  run: the first run offered is taken).

A new run's first version can reach a relay behind the master before the new trainer's heartbeat
does, so a relay waits (`wait`, bounded) for the announcement before it refuses; a rollout just
checks again at its next load. Announcements are thread-safe: the relay's receiver threads wait
on the condition that the role's event loop notifies.
"""
from __future__ import annotations

import threading


class RunPin:
    """The run announced by the trainer ("" = none yet) and the rule that decides an offered run."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.announced = ""

    def announce(self, run_id: str) -> bool:
        """The trainer names its run; True when that changes the pin ("" announces nothing)."""
        if not run_id:
            return False
        with self.cond:
            if run_id == self.announced:
                return False
            self.announced = run_id
            self.cond.notify_all()
            return True

    def accepts(self, offered: str, held: str) -> bool:
        """Whether weights of run `offered` may replace weights of run `held` ("" = no run)."""
        announced = self.announced
        if announced:
            return offered == announced
        return offered == held or not held

    def wait(self, offered: str, held: str, timeout_s: float) -> bool:
        """`accepts`, waiting up to `timeout_s` for an announcement that makes it true."""
        with self.cond:
            return self.cond.wait_for(lambda: self.accepts(offered, held), timeout_s)

    def pinned(self, held: str) -> str:
        """The run that is taken now: the announced one, else the one held."""
        return self.announced or held
