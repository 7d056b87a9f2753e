"""The end-to-end liveness alarm: `weights_stalled` when the rollouts' weights fall behind the trainer's.

Whatever freezes the weights on their way (a relay chain wedged on a dead link, a master that
refuses every part, a lineage no relay accepts, a rollout that cannot load), training goes on
and each piece may look healthy on its own. So the manager compares the two ends: the trainer's
newest published (lineage, version), from its heartbeats, with the newest version any live
rollout serves *of that lineage* (a rollout still on a discarded lineage serves nothing the
trainer published since its fork, so it counts as holding nothing). When the lag exceeds
`lag_versions` (K) for `after_s` (T) seconds the alarm is raised, once, logged as
`weights_stalled` (a warning); it clears, logged as `weights_stall_cleared`, as soon as the lag
is back within K. The manager's status carries it (`weights_stalled` 0/1, `weights_lag`,
`weights_stalled_total`), so its heartbeat takes it to every node's /healthz (503 while raised on
the manager's node) and to Prometheus (`laminar_manager_weights_stalled`,
`laminar_manager_weights_lag_versions`, `laminar_manager_weights_stalled_total`).

Nothing is compared before both ends have reported: no trainer heartbeat, or no rollout ever
seen, means no lag (a cluster starting up, or one without rollouts).
"""
from __future__ import annotations

import time
from collections.abc import Callable


class StallAlarm:
    """Raised when the trainer's version leads the rollouts' newest by more than K for T seconds."""

    def __init__(self, log, lag_versions: int, after_s: float, clock: Callable[[], float] = time.monotonic):
        self.log, self.k, self.after_s, self.clock = log, lag_versions, after_s, clock
        self.trainer: tuple[int, int] | None = None  # (lineage, version) last published
        self.lag = 0
        self.raised = False
        self.raised_total = 0
        self._over_since: float | None = None  # when the lag first exceeded K (this episode)

    def on_trainer(self, lineage: int, version: int) -> None:
        self.trainer = (int(lineage), int(version))

    def update(self, rollouts: list[tuple[int, int]]) -> None:
        """Re-evaluate with the live rollouts' (lineage, version); call it every tick."""
        if self.trainer is None or not rollouts:
            lag = 0
        else:
            lineage, version = self.trainer
            same = [v for lin, v in rollouts if lin == lineage]
            lag = max(0, version - max(same)) if same else max(0, version)
        self.lag = lag
        now = self.clock()
        if lag <= self.k:
            self._over_since = None
            if self.raised:
                self.raised = False
                self.log.info("weights_stall_cleared", lag=lag, trainer=self.trainer)
            return
        if self._over_since is None:
            self._over_since = now
        if not self.raised and now - self._over_since >= self.after_s:
            self.raised = True
            self.raised_total += 1
            self.log.warning("weights_stalled", lag=lag, trainer_lineage=self.trainer[0],
                             trainer_version=self.trainer[1], rollouts_newest=self.trainer[1] - lag,
                             for_s=round(now - self._over_since, 1), lag_versions=self.k, after_s=self.after_s)

    def status(self) -> dict:
        return {"weights_stalled": int(self.raised), "weights_lag": self.lag,
                "weights_stalled_total": self.raised_total}
