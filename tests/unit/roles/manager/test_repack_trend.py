"""The repack's trend test in a long tail: a draining replica's KV usage creeps up between finishes
(each running sequence adds a token's KV every step) and drops at each finish, so 'below the
previous report' (the paper's listing) holds only at the reports right after a finish, and a plan,
which needs source and destination to be candidates in the same snapshot, rarely finds a pair. The
manager's default trend is the peak since the replica last admitted work: a replica past its peak
(no new work since) is draining, whatever the last report did. New work (more running, any
waiting, a new version) starts a new peak."""
from __future__ import annotations

import structlog
from laminar.roles.manager.fleet import Fleet, FleetSettings
from laminar.roles.manager.repack import plan_repack

from laminar.protocol.rollout import RolloutStats


def report(rid: str, kv: float, running: int, waiting: int = 0, version: int = 3) -> RolloutStats:
    return RolloutStats(rid, "h", version, kv, running, waiting, running + waiting, 0.0, "generating")


# two replicas in the tail of the same batch: a finish (KV drops) then a creeping step (KV rises)
TAIL = {"a": [(0.90, 64), (0.30, 12), (0.31, 12), (0.25, 10), (0.27, 10)],
        "b": [(0.85, 60), (0.20, 8), (0.22, 8), (0.23, 8), (0.18, 7)]}


def fleet(trend: str) -> Fleet:
    return Fleet(None, structlog.get_logger("test"), FleetSettings(batch_bound=32, repack_trend=trend),
                 lambda r: "", None)


def plans(trend: str) -> list[int]:
    f = fleet(trend)
    out = []
    for i in range(len(TAIL["a"])):
        for rid, seq in TAIL.items():
            f.on_stats(report(rid, *seq[i]))
        out.append(len(plan_repack(f._trusted_loads(), 0.99, 32)))
    return out


def test_past_its_peak_a_replica_is_a_candidate_at_every_report():
    assert plans("peak") == [0, 1, 1, 1, 1]
    # the paper's previous-report test: a pair only where both fell in the same interval
    assert plans("previous") == [0, 1, 0, 0, 0]


def test_new_work_starts_a_new_peak():
    f = fleet("peak")
    for kv, running, waiting in [(0.9, 64, 0), (0.3, 10, 0), (0.35, 20, 0), (0.34, 20, 0), (0.33, 20, 4),
                                 (0.32, 20, 0)]:
        f.on_stats(report("a", kv, running, waiting))
    # 0.35 (more running: new work) was the new peak; 0.34 fell below it; the waiting report at
    # 0.33 started another, and 0.32 is below that one
    assert f.views["a"].kv_peak == 0.33 and f._trusted_loads()[0].kv_prev == 0.33
    f.on_stats(report("a", 0.30, 20, version=4))   # new weights: a new batch
    assert f.views["a"].kv_peak == 0.30
