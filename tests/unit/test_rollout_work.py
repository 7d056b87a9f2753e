"""Work (roles/rollout/work.py) and the bus's call_acked as the rollout uses it: a trajectory leaving
frees room and the last one ends the batch (only if it is still the one held under its id; work
handed over by a MigrateOut frees no room until none is left); a request that must arrive is
asked again while the peer is down, busy, failing inside or past a deadline, and any other
refusal reaches the caller at once.
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import structlog
from laminar.bus.errors import PeerUnavailable, RemoteError
from laminar.bus.retry import call_acked
from laminar.roles.rollout.trajectory import Active
from laminar.roles.rollout.work import Work

from laminar.protocol import Ack, ReassignPartial, TrajectorySpec

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


class Peer:
    def __init__(self, *failures):
        self.failures, self.requests = list(failures), []

    async def call(self, req, timeout: float):
        self.requests.append(req)
        if self.failures:
            raise self.failures.pop(0)
        return Ack("ok")


def test_call_acked_retries_what_may_pass_and_raises_the_rest():
    for failure in (PeerUnavailable("down"), RemoteError("busy", "full"), RemoteError("deadline", "late"),
                    RemoteError("internal", "oops"), RemoteError("unavailable", "restarting")):
        peer = Peer(failure)
        assert asyncio.run(call_acked(peer, ReassignPartial("t", "r0"), 1.0, LOG)).detail == "ok"
        assert len(peer.requests) == 2
    peer = Peer(RemoteError("not_found", "no such trajectory"))
    with pytest.raises(RemoteError, match="no such trajectory"):
        asyncio.run(call_acked(peer, ReassignPartial("t", "r0"), 1.0, LOG))
    assert len(peer.requests) == 1
