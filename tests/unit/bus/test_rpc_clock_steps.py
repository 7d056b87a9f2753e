"""A wall clock stepped forward or backward must not make a server refuse fresh requests as late.
A server judges lateness by `arrival - sent` against the same caller's quickest recent request;
before, `arrival` was read from the wall clock, so a server whose clock stepped forward by more
than a request's timeout + 5 s refused every caller's requests as late for about two minutes (the
floor's window), and a caller whose clock stepped backwards was refused the same way. Both ends now
read a steady wall clock (the wall time at start advanced by the monotonic clock), which a step
of the system clock does not move. The step is injected by replacing `time.time`."""
from __future__ import annotations

import time

from laminar.bus import rpc
from laminar.bus.rpc import Dispatcher

from laminar.protocol import Ping


def test_a_server_clock_stepped_forward_still_serves_fresh_requests(monkeypatch):
    d = Dispatcher("echo", "0", 8)
    caller = time.time   # another host's clock, which does not step
    assert d.late(Ping(0), {"st": caller(), "to": 5.0}, b"caller") == ""
    monkeypatch.setattr(time, "time", lambda: caller() + 300.0)   # this host's clock jumps 5 minutes
    assert d.late(Ping(0), {"st": caller(), "to": 5.0}, b"caller") == ""
    # a request that really sat past its caller's timeout is still refused
    assert d.late(Ping(0), {"st": caller() - 60.0, "to": 5.0}, b"caller").startswith("ping arrived")


def test_a_caller_clock_stepped_backwards_does_not_move_its_send_times(monkeypatch):
    before = rpc.steady_time()
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 600.0)   # the caller's clock steps back 10 minutes
    after = rpc.steady_time()
    assert 0.0 <= after - before < 5.0
