"""PartialBook.live_entry: one trajectory's entry if it is live (its seq 0 applied), looked up
directly. The partial pool answers every ReassignPartial and GetPartial with it; it used to build
the whole `live()` map for each (a scan of every in-flight trajectory per request: at 1,024
simulated GPUs, 32K trajectories for each of a repack's releases and claims)."""
from __future__ import annotations

from laminar.roles.partial_pool.state import PartialBook

from tests.unit.roles.partial_pool.test_state_exactly_once import stream


def _book() -> PartialBook:
    book = PartialBook()
    book.apply("r0", stream("live", [3, 2]))       # seq 0 and 1: live
    book.apply("r0", stream("held", [2, 2])[1:])    # only seq 1: held, no spec yet
    book.apply("r0", stream("done", [1]))
    book.complete("done")
    return book


def test_live_entry_is_live_get_for_every_id():
    book = _book()
    for tid in ("live", "held", "done", "never"):
        assert book.live_entry(tid) is book.live().get(tid)
    assert book.live_entry("live") is not None and book.live_entry("held") is None


def test_live_entry_does_not_scan_the_book():
    book = _book()
    for i in range(2000):
        book.apply("r1", stream(f"t{i}", [1]))

    class NoScan(dict):
        def items(self):
            raise AssertionError("live_entry scanned every entry")

        def values(self):
            raise AssertionError("live_entry scanned every entry")

    book.entries = NoScan(book.entries)
    assert book.live_entry("t1999").spec.trajectory_id == "t1999"
