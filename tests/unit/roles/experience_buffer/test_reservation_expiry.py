"""With `reject` eviction a group's first member reserves room for the whole group. Without
`max_staleness` (the default) nothing ever freed the room of a group whose last members never came:
enough such groups and every new group is refused for good while the trainer has nothing complete
to sample (the deadlock `reject` exists to avoid). Now a reservation times out
(`reserve_timeout_s`, on a monotonic clock, injected here): the incomplete group is dropped, its
prompt requeued as a whole (nothing skipped), and only the requeued attempt's members are taken
for it afterwards."""
from __future__ import annotations

import numpy as np
from laminar.roles.experience_buffer.state import BufferBook

from laminar.protocol import Trajectory, TrajectorySpec


def traj(gid: str, idx: int, size: int = 2, attempt: int = 0) -> Trajectory:
    tid = f"{gid}/{idx}" + (f"~a{attempt}" if attempt else "")
    spec = TrajectorySpec(tid, "p", gid, idx, size, np.zeros(1, np.int32))
    return Trajectory(spec=spec, response_tokens=np.zeros(1, np.int32), logprobs=np.zeros(1, np.float32),
                      version=0, rollout_id="r0", reward=0.0, finish_reason="stop")


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_an_incomplete_groups_reservation_times_out_and_its_prompt_is_requeued():
    clock = Clock()
    book = BufferBook(4, eviction="reject", reserve_timeout_s=60.0, clock=clock)
    assert book.put(traj("e0-p1", 0))[0] == "stored"
    assert book.put(traj("e0-p2", 0))[0] == "stored"           # 2 stored + 2 reserved: full for new groups
    clock.t += 30
    assert book.put(traj("e0-p3", 0))[0].startswith("full")    # within the timeout: refused, as before
    clock.t += 31
    status, ch = book.put(traj("e0-p3", 0))                     # past it: p1's and p2's rooms are freed
    assert status == "stored"
    assert sorted(ch.requeue) == ["e0-p1", "e0-p2"] and book.counts["expired_incomplete"] == 2
    assert (book.stored, book.reserved) == (1, 1)
    assert book.put(traj("e0-p1", 1))[0].startswith("duplicate")   # the expired attempt's late member
    assert book.put(traj("e0-p1", 0, attempt=1))[0] == "stored"    # the requeued attempt's members
    assert book.put(traj("e0-p1", 1, attempt=1))[0] == "stored"
    groups, _, _ = book.sample(4, 0)
    assert [g[0].spec.group_id for g in groups] == ["e0-p1"]


def test_a_sample_expires_reservations_too_and_complete_groups_never_expire():
    clock = Clock()
    book = BufferBook(10, eviction="reject", reserve_timeout_s=60.0, clock=clock)
    book.put(traj("e0-p1", 0))
    book.put(traj("e0-p2", 0))
    book.put(traj("e0-p2", 1))
    clock.t += 61
    groups, _, ch = book.sample(4, 0)
    assert [g[0].spec.group_id for g in groups] == ["e0-p2"] and ch.requeue == ["e0-p1"]
    assert ("e0-p1", "expired:0") in ch.removed_groups
