"""The bus's retry policies written once (bus/retry.py): Backoff doubles a wait up to a cap and starts
over on reset, call_acked asks an idempotent request again with it; production code has no doubling
of its own left, and every retry site's cap is still its own."""
from __future__ import annotations

import asyncio
import re

import pytest
import structlog
from laminar.bus.errors import PeerUnavailable, RemoteError
from laminar.bus.retry import INTERNAL_TRIES, Backoff, call_acked

from laminar.protocol import Ack, ReassignPartial
from tests.support import ROOT

pytestmark = pytest.mark.timeout(30)


def test_backoff_doubles_to_its_cap_and_starts_over_on_reset():
    b = Backoff(0.1, 1.0)
    assert [b.next() for _ in range(6)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    assert b.delay == 1.0  # the next wait, looked at without taking it
    b.reset()
    assert b.next() == 0.1 and b.delay == pytest.approx(0.2)
    above = Backoff(3.0, 2.0)
    assert [above.next() for _ in range(2)] == [3.0, 2.0]  # a first wait above the cap is taken once


def test_backoff_sleep_waits_the_next_delay(monkeypatch):
    waited: list[float] = []

    async def fake_sleep(d):
        waited.append(d)
    monkeypatch.setattr("laminar.bus.retry.asyncio.sleep", fake_sleep)
    b = Backoff(0.05, 0.15)

    async def three():
        return [await b.sleep() for _ in range(3)]
    assert asyncio.run(three()) == waited == pytest.approx([0.05, 0.1, 0.15])


class Peer:
    def __init__(self, *failures):
        self.failures, self.requests = list(failures), []

    async def call(self, req, timeout: float):
        self.requests.append(req)
        if self.failures:
            raise self.failures.pop(0)
        return Ack("ok")


LOG = structlog.get_logger("test")


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


def test_call_acked_lives_on_the_bus_and_backs_off_between_tries(monkeypatch):
    waited: list[float] = []

    async def fake_sleep(d):
        waited.append(d)
    monkeypatch.setattr("laminar.bus.retry.asyncio.sleep", fake_sleep)
    peer = Peer(*[PeerUnavailable("down")] * 7)
    assert asyncio.run(call_acked(peer, ReassignPartial("t", "r0"), 1.0, LOG)).detail == "ok"
    assert waited == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0])  # the bus's own cap: 2 s
    peer = Peer(*[RemoteError("internal", "bug")] * INTERNAL_TRIES)
    with pytest.raises(RemoteError, match="bug"):
        asyncio.run(call_acked(peer, ReassignPartial("t", "r0"), 1.0, LOG))
    assert len(peer.requests) == INTERNAL_TRIES


DOUBLING = re.compile(r"min\([^()]*\*\s*2\b|\*\s*2,\s*[A-Za-z0-9_.]+\)")


def test_no_production_code_doubles_a_wait_of_its_own():
    """Every retry-with-backoff goes through Backoff: a `min(delay * 2, cap)` outside bus/retry.py is
    a second copy of the policy (the simulator's cost models multiply by 2 for other reasons)."""
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
             for top in ("roles", "laminar", "bus") for p in sorted((ROOT / top).rglob("*.py"))
             if p.name != "retry.py" and "laminar/sim/" not in str(p)
             for i, line in enumerate(p.read_text().splitlines(), 1) if DOUBLING.search(line)]
    assert found == [], "\n".join(found)
