"""BatchSeq (roles/rollout/batch_seq.py) on its own: numbers are reserved on disk a block at a time
before any of the block is used, a restart starts above the reservation whatever the clock says,
a torn record falls back to the clock (and says so), and without a workdir nothing is written.
"""
from __future__ import annotations

import asyncio
import json

import pytest
import structlog
from laminar.roles.rollout import batch_seq
from laminar.roles.rollout.batch_seq import BatchSeq
from structlog.testing import capture_logs

pytestmark = pytest.mark.timeout(30)
T0 = 1_800_000_000 * 10**9  # a wall clock, ns


@pytest.fixture
def clock(monkeypatch):
    now = [T0]
    monkeypatch.setattr(batch_seq.time, "time_ns", lambda: now[0])
    return now


def seqs(path, block: int = 4) -> BatchSeq:
    s = BatchSeq(path, structlog.get_logger("test"))
    s.BLOCK = block
    s.start()
    return s


def recorded(path) -> int:
    return json.loads(path.read_text())["reserved"]


def test_a_block_is_reserved_on_disk_before_any_number_of_it_is_used(tmp_path, clock):
    path = tmp_path / "rollout-r0" / "batch_seq.json"
    s = seqs(path)
    base = T0 // 1000
    assert asyncio.run(s.at(0)) == base and recorded(path) == base + 4
    assert [asyncio.run(s.at(n)) for n in (1, 2, 3)] == [base + 1, base + 2, base + 3]
    assert recorded(path) == base + 4          # still inside the first block: no write
    assert asyncio.run(s.at(4)) == base + 4 and recorded(path) == base + 8
    assert asyncio.run(s.at(4)) == base + 4    # an empty batch is asked again under the same number


def test_a_restart_starts_above_the_reservation_when_the_clock_stepped_back(tmp_path, clock):
    path = tmp_path / "batch_seq.json"
    first = seqs(path)
    used = [asyncio.run(first.at(n)) for n in range(6)]
    clock[0] -= 10 * 10**9
    again = seqs(path)
    assert asyncio.run(again.at(0)) == recorded(tmp_path / "batch_seq.json") - 4 > max(used)


def test_a_torn_record_falls_back_to_the_clock(tmp_path, clock):
    path = tmp_path / "batch_seq.json"
    path.write_text('{"reserv')
    with capture_logs() as logs:
        s = seqs(path)
    assert s.base == T0 // 1000
    assert [e["event"] for e in logs] == ["batch_seq_record_unreadable"]


def test_without_a_workdir_numbers_come_from_the_clock_and_nothing_is_written(tmp_path, clock):
    s = seqs(None)
    assert asyncio.run(s.at(2)) == T0 // 1000 + 2 and s.reserved == T0 // 1000 + 6
    assert list(tmp_path.iterdir()) == []
