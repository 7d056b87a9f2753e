"""Work (roles/rollout/work.py): a trajectory leaving frees room and the last one ends the batch
(only if it is still the one held under its id; work handed over by a MigrateOut frees no room
until none is left). call_acked, which the rollout's writes go through, is tested with the bus
(tests/unit/bus/test_retry.py).
"""
from __future__ import annotations

import numpy as np
import pytest
import structlog
from laminar.roles.rollout.trajectory import Active
from laminar.roles.rollout.work import Work

from laminar.protocol import TrajectorySpec

pytestmark = pytest.mark.timeout(30)
LOG = structlog.get_logger("test")


def active(tid: str) -> Active:
    return Active(spec=TrajectorySpec(trajectory_id=tid, prompt_id="p", group_id="g", sample_index=0, group_size=1,
                                      prompt_tokens=np.asarray([1], dtype=np.int32), answer="x", max_tokens=4),
                  version=0)


def test_leaving_frees_room_and_the_last_one_ends_the_batch():
    w = Work()
    a, b = active("a"), active("b")
    w.add(a)
    w.add(b)
    w.left(active("a"))                      # another object under a's id: a stays
    assert set(w.active) == {"a", "b"} and w.room_freed.is_set() and not w.batch_done.is_set()
    w.room_freed.clear()
    w.left(a)
    assert set(w.active) == {"b"} and w.room_freed.is_set() and not w.batch_done.is_set()
    w.left(b)
    assert not w.active and w.batch_done.is_set()
    w.add(a)
    assert not w.batch_done.is_set()


def test_work_handed_over_frees_no_room_until_the_last_one_leaves():
    w = Work()
    a, b, c = active("a"), active("b"), active("c")
    for x in (a, b, c):
        w.add(x)
    w.left(a, b, make_room=False)            # a MigrateOut of two: the manager's room, not ours
    assert set(w.active) == {"c"} and not w.room_freed.is_set() and not w.batch_done.is_set()
    w.left(c, make_room=False)               # the last one: the batch is over, and there is room
    assert not w.active and w.room_freed.is_set() and w.batch_done.is_set()
