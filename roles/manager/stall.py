"""The end-to-end liveness alarm: `weights_stalled` when the rollouts' weights fall behind the trainer's.

Whatever freezes the weights on their way (a relay chain wedged on a dead link, a master that
refuses every part, a lineage no relay accepts, a rollout that cannot load), training goes on
and each piece may look healthy on its own. So the manager compares the two ends: the trainer's
newest published (lineage, version), from its heartbeats, with the versions the live rollouts
serve *of that lineage* (a rollout still on a discarded lineage, or on another run, serves nothing
the trainer published since, so it counts as holding nothing). The lag is measured at the
`quantile` of the rollouts' versions: 0 (the default) is the slowest rollout, so one host whose
chain tail was frozen raises it (before, the newest rollout was compared, and three of four
rollouts 53 versions behind read as no lag); 1 is the newest. When the lag exceeds
`lag_versions` (K) for `after_s` (T) seconds the alarm is raised, once, logged as
`weights_stalled` (a warning) naming the lagging rollouts and their hosts; it clears, logged as
`weights_stall_cleared`, as soon as the lag is back within K. The manager's status carries it
(`weights_stalled` 0/1, `weights_lag`, `weights_stalled_total`), so its heartbeat takes it to
every node's /healthz (503 while raised on the manager's node) and to Prometheus (`laminar_manager_weights_stalled`,
`laminar_manager_weights_lag_versions`, `laminar_manager_weights_stalled_total`).

Nothing is compared before both ends have reported: no trainer heartbeat, or no rollout ever
seen, means no lag (a cluster starting up, or one without rollouts).
"""
from __future__ import annotations

import time
from collections.abc import Callable


def lag_at(version: int, held: list[int], quantile: float) -> int:
    """The trainer's lead over the rollouts' versions at `quantile` (0: the slowest, 1: the newest)."""
    ordered = sorted(held)
    return max(0, version - ordered[round(quantile * (len(ordered) - 1))])


class StallAlarm:
    """Raised when the trainer's version leads the rollouts' (at a quantile) by more than K for T seconds."""

    def __init__(self, log, lag_versions: int, after_s: float, clock: Callable[[], float] = time.monotonic,
                 quantile: float = 0.0):
        self.log, self.k, self.after_s, self.clock = log, lag_versions, after_s, clock
        self.quantile = quantile
        self.lagging: list[str] = []  # the rollouts (id@host) behind by more than K, at the last update
        self.trainer: tuple[int, int] | None = None  # (lineage, version) last published
        self.lag = 0
        self.raised = False
        self.raised_total = 0
        self._over_since: float | None = None  # when the lag first exceeded K (this episode)

    def on_trainer(self, lineage: int, version: int) -> None:
        self.trainer = (int(lineage), int(version))

    def update(self, rollouts: list[tuple]) -> None:
        """Re-evaluate with the live rollouts' (lineage, version[, who]) (who: "id@host"; a
        rollout on another lineage holds nothing of the trainer's); call it every tick."""
        if self.trainer is None or not rollouts:
            lag, self.lagging = 0, []
        else:
            lineage, version = self.trainer
            held = [r[1] if r[0] == lineage else 0 for r in rollouts]
            lag = lag_at(version, held, self.quantile)
            self.lagging = [str(r[2]) if len(r) > 2 else "?" for r, v in zip(rollouts, held, strict=True)
                            if version - v > self.k]
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
                             trainer_version=self.trainer[1], rollouts_at_quantile=self.trainer[1] - lag,
                             quantile=self.quantile, lagging=self.lagging[:32], lagging_count=len(self.lagging),
                             for_s=round(now - self._over_since, 1), lag_versions=self.k, after_s=self.after_s)

    def status(self) -> dict:
        return {"weights_stalled": int(self.raised), "weights_lag": self.lag,
                "weights_stalled_total": self.raised_total}
