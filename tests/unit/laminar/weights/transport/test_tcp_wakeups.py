"""A TCP chunk connection wakes its receiving thread once per payload, not once per segment, and
never holds a message back.

A chunk's payload that arrives in many pieces (a shaped link delivers it a 1500-byte packet at a
time) used to wake the thread blocked in recv for every piece: a context switch and a partial copy
each, the relay's largest share of kernel time. With SO_RCVLOWAT raised to the bytes the receive
waits for, the thread wakes when they are all there. What must not change: every message still
arrives whole and in order, a small message right after a large one is not held back waiting for
bytes that never come, and neither is the tail of a payload larger than WAKE_MAX with nothing
behind it, nor the rest of a payload partly queued before its receive began.

Real loopback sockets; the wake-ups are the receiving thread's voluntary context switches
(getrusage RUSAGE_THREAD).
"""
from __future__ import annotations

import os
import resource
import threading
import time

import pytest

from laminar.weights.transport import get_transport
from laminar.weights.transport.tcp import WAKE_MAX, WAKE_MIN

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pair():
    t = get_transport("tcp")
    lst = t.listen("127.0.0.1")
    got = {}
    th = threading.Thread(target=lambda: got.setdefault("conn", lst.accept(timeout=5.0)))
    th.start()
    client = t.connect(lst.address, 5.0)
    th.join()
    server = got["conn"]
    server.set_idle_timeout(10.0)  # a receive held back for good fails the test instead of hanging it
    yield client, server
    client.close()
    server.close()
    lst.close()


def _dribble(conn, data: bytes, pieces: int, pause_s: float) -> threading.Thread:
    """Send `data` in `pieces` sends, `pause_s` apart (each lands in the receiver's socket on its own)."""
    step = -(-len(data) // pieces)

    def run():
        for off in range(0, len(data), step):
            time.sleep(pause_s)
            conn.send(data[off:off + step])
    th = threading.Thread(target=run)
    th.start()
    return th


def test_a_payload_arriving_in_pieces_wakes_the_receiver_a_few_times_not_per_piece(pair):
    client, server = pair
    data, pieces = os.urandom(256 << 10), 32
    for _ in range(2):  # the second round is the one measured: the socket's settings are in place
        view = memoryview(bytearray(len(data)))
        th = _dribble(client, data, pieces, 0.003)
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
        server.recv_into(view)
        wakeups = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw - before
        th.join()
        assert bytes(view) == data
    # one wake-up when the last piece lands (and perhaps one for the GIL); per piece it was ~32
    assert wakeups <= 6, f"{wakeups} wake-ups for one payload sent in {pieces} pieces"


def test_a_small_message_after_a_large_one_is_not_held_back(pair):
    client, server = pair
    big, small = os.urandom(300 << 10), os.urandom(88)
    for _ in range(3):
        client.send(big)
        view = memoryview(bytearray(len(big)))
        server.recv_into(view)
        assert bytes(view) == big
        th = _dribble(client, small, 1, 0.2)  # the receive below is blocked by then
        t0 = time.monotonic()
        assert server.recv_header(len(small)) == small
        assert time.monotonic() - t0 < 2.0
        th.join()


@pytest.mark.parametrize("extra", [100, WAKE_MIN + 1000])
def test_a_payload_beyond_wake_max_arrives_whole_with_nothing_behind_it(pair, extra):
    """Its tail (smaller than WAKE_MAX, larger or smaller than WAKE_MIN) is the last thing sent:
    the receive asking for it must wake on its bytes alone."""
    client, server = pair
    data = os.urandom(2 * WAKE_MAX + extra)
    th = _dribble(client, data, 5, 0.05)
    view = memoryview(bytearray(len(data)))
    t0 = time.monotonic()
    server.recv_into(view)
    assert time.monotonic() - t0 < 5.0
    th.join()
    assert bytes(view) == data


def test_a_payload_partly_queued_before_the_receive_starts_arrives_without_waiting_for_more(pair):
    """Some of it is queued when the receive begins and the rest comes later, with nothing behind
    it: the receive must wake on the rest alone (a blocking recv under the raised mark would take
    the queued part, then wait for the whole size again and sleep until the idle timeout)."""
    client, server = pair
    data = os.urandom(200 << 10)
    client.send(data[:50 << 10])
    time.sleep(0.1)  # queued on the receiving socket by now
    th = _dribble(client, data[50 << 10:], 3, 0.1)
    view = memoryview(bytearray(len(data)))
    t0 = time.monotonic()
    server.recv_into(view)
    assert time.monotonic() - t0 < 3.0
    th.join()
    assert bytes(view) == data
