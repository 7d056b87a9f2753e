"""bench/agent_gateway.py's wait for its agents' process (`Agents._recv`), with a real child process:
a message on the pipe is returned when it comes, a process that exits without sending is an error
naming its exit code, and the wait never polls (the gateway side's CPU is measured while it waits,
and the direct side has no such wait: a poll's wake-ups would be charged to the gateway alone)."""
from __future__ import annotations

import asyncio
import multiprocessing
import time

import pytest

from tests import support

pytestmark = pytest.mark.timeout(60)


def _send_later(conn, delay: float) -> None:
    time.sleep(delay)
    conn.send("claimed")


def _exit(conn, code: int) -> None:
    raise SystemExit(code)


def agents(target, *args):
    """An Agents of the bench around a child process running `target(conn, *args)`."""
    bench = support.load_bench("agent_gateway")
    ctx = multiprocessing.get_context("fork")  # (the bench spawns; the wait is the same on either)
    a = bench.Agents.__new__(bench.Agents)
    a.mine, theirs = ctx.Pipe()
    a.p = ctx.Process(target=target, args=(theirs, *args), daemon=True)
    a.p.start()
    return a


@pytest.fixture
def no_polling(monkeypatch):
    async def polled(*args, **kwargs):
        raise AssertionError("the wait polled with asyncio.sleep")
    monkeypatch.setattr(asyncio, "sleep", polled)


def test_the_wait_returns_the_message_when_it_comes_without_polling(no_polling):
    a = agents(_send_later, 0.3)
    try:
        t0 = time.monotonic()
        assert asyncio.run(a._recv()) == "claimed"
        assert time.monotonic() - t0 >= 0.25
    finally:
        a.p.join(10)


def test_a_process_that_exits_without_a_message_is_an_error_naming_its_exit(no_polling):
    a = agents(_exit, 3)
    with pytest.raises(RuntimeError, match=r"exited \(3\)"):
        asyncio.run(a._recv())
    a.p.join(10)
