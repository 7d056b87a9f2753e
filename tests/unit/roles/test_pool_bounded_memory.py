"""Memory (and so the replay at every start) stays bounded however long a run is: the buffer
remembers only its newest removed group ids (never a leased one), the partial pool only its newest
completed ids and a bounded number of trajectories seen only through out-of-order deltas; the
store holds no more than memory does."""
from __future__ import annotations

import asyncio
import sqlite3

import pytest
from laminar.roles.experience_buffer.state import BufferBook
from laminar.roles.partial_pool.state import PartialBook

from laminar.config import parse_config
from laminar.protocol import CompletePartial, PutTrajectory, SampleGroups
from laminar.testing.inproc_cluster import InprocCluster
from tests.unit.roles.experience_buffer.test_state_properties import traj
from tests.unit.roles.test_pool_write_failures import delta

pytestmark = pytest.mark.timeout(60)


def test_buffer_forgets_old_removed_groups_but_never_a_leased_one():
    book = BufferBook(1000, remember_removed=10)
    for g in range(100):
        book.put(traj(g, 0, 1, 0))
    book.sample(30, 0, lease=True)            # leased until the trainer commits them
    book.sample(70, 0)
    assert len(book.gone) <= 11 + 30
    assert all(f"g{g}" in book.gone for g in range(30))
    assert book.put(traj(99, 0, 1, 0))[0].startswith("duplicate")   # a recent one is still refused


def test_partial_pool_forgets_old_completed_ids_and_bounds_held_only_entries():
    book = PartialBook(remember_completed=10, max_held_only=5)
    for t in range(100):
        book.apply("r", [delta(f"t{t}", 0)])
        book.complete(f"t{t}")
    assert len(book.completed) <= 11 and "t99" in book.completed
    for t in range(20):                       # deltas whose seq 0 never comes
        book.apply("r", [delta(f"h{t}", 3)])
    assert len(book.entries) <= 5


def cfg(tmp_path):
    return parse_config({"run": {"workdir": str(tmp_path)},
                         "cluster": {"keys_dir": None, "broker": {"host": "h0"},
                                     "hosts": {"h0": {"address": "127.0.0.1", "roles": [
                                         {"role": "partial_pool", "port": 6401},
                                         {"role": "experience_buffer", "port": 6402}]}}},
                         "roles": {"partial_pool": {"remember_completed": 20},
                                   "experience_buffer": {"remember_removed": 20}}})


def test_the_stores_hold_no_more_than_memory(tmp_path):
    async def go():
        cl = InprocCluster(cfg(tmp_path))
        await cl.start("partial_pool")
        await cl.start("experience_buffer")
        pp, buf = cl.client("partial_pool"), cl.client("experience_buffer")
        for t in range(200):
            await pp.call(
                __import__("laminar.protocol", fromlist=["AppendDeltas"]).AppendDeltas("r", [delta(f"t{t}", 0)])
            )
            await pp.call(CompletePartial([f"t{t}"]))
            await buf.call(PutTrajectory(traj(t, 0, 1, 0)))
            await buf.call(SampleGroups(1, 0))
        await cl.close()
    asyncio.run(go())
    with sqlite3.connect(tmp_path / "pools" / "partial_pool-0.sqlite") as c:
        assert c.execute("SELECT count(*) FROM completed").fetchone()[0] <= 22
    with sqlite3.connect(tmp_path / "pools" / "experience_buffer-0.sqlite") as c:
        assert c.execute("SELECT count(*) FROM gone").fetchone()[0] <= 22
