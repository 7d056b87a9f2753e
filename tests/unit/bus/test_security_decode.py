"""Hostile bodies and frame lists are refused before they cost memory or time.

A msgpack body can describe far more Python objects than it has bytes to pay for (one byte, 0x80,
is an empty map: 64 bytes of dict). The decoder bounds every container's length, the number of
containers in one message and the nesting depth while unpacking, so a refusal costs at most the
budget, not the body's worth of objects. The heavy cases run in a fresh interpreter so their peak
RSS growth can be measured (printed with the time taken; the assertions are on memory and types).
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import msgpack
import pytest
import zmq
from laminar.bus import codec
from laminar.bus.codec import decode
from laminar.bus.errors import CodecError, MalformedFrame, OversizedFrame

from laminar.protocol import PROTOCOL_VERSION, Ping

PROBE = textwrap.dedent("""
    import json, resource, sys, time, tracemalloc
    import msgpack
    from laminar.bus.codec import decode
    from laminar.protocol import PROTOCOL_VERSION
    shape, kind, inner = sys.argv[1], b"ping", None
    if shape == "one_list":          # 2 MB: one array of 2M empty maps
        fields = {"seq": 1, "x": [{}] * 2_000_000}
    elif shape == "many_lists":      # 2 MB: 32 arrays of 65,536 empty maps each
        fields = {"seq": 1, "x": [[{}] * 65_536 for _ in range(32)]}
    else:                            # 2 MB: 31 nested events of 65,536 empty maps each (dict
        kind = b"data.buffer_stats"  # values are not type-checked, so each one builds)
        inner = msgpack.packb(["data.buffer_stats", {"counts": {"k": [{}] * 65_536}}])
        fields = {"counts": {"k": [msgpack.ExtType(2, inner)] * 31}}
    body = msgpack.packb([PROTOCOL_VERSION, {}, fields])
    del fields, inner
    import gc; gc.collect()

    def hwm_kb():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:"))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")              # reset the peak RSS to the current RSS
    rss0 = hwm_kb()
    t0 = time.perf_counter()
    tracemalloc.start()
    try:
        decode([kind, body])
        error = None
    except Exception as exc:
        error = [type(exc).__name__, str(exc)[:160]]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(json.dumps({"body_bytes": len(body), "error": error, "traced_peak_mb": peak / 1e6,
                      "peak_rss_growth_mb": (hwm_kb() - rss0) / 1024,
                      "seconds_with_tracemalloc": time.perf_counter() - t0}))
""")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("shape", ["one_list", "many_lists", "nested_events"])
def test_hostile_body_of_empty_maps_is_refused_cheaply(shape):
    out = subprocess.run([sys.executable, "-c", PROBE, shape], capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    print(f"\n{shape}: {r}")
    assert r["body_bytes"] >= 2_000_000
    assert r["error"] is not None and r["error"][0] == "OversizedFrame", r
    # The budget, not the body, bounds what a refusal allocates: far below the ~290 MB that
    # building every map (and copying it once more) costs.
    assert r["traced_peak_mb"] < 32, r


def test_decoder_limits_bound_allocation():
    """Every limit handed to msgpack is finite and the products stay within a small budget."""
    lim = codec.UNPACK_LIMITS
    for name in ("max_array_len", "max_map_len", "max_str_len", "max_bin_len", "max_ext_len"):
        assert 0 < lim[name] <= codec.MAX_BODY_BYTES, name
    assert lim["max_array_len"] <= codec.MAX_CONTAINERS and lim["max_map_len"] <= codec.MAX_CONTAINERS
    # Worst case held at refusal: the container budget as empty dicts plus one maximal list.
    assert codec.MAX_CONTAINERS * 64 + lim["max_array_len"] * 8 <= 32 << 20
    assert 8 <= codec.MAX_DEPTH <= 64


def test_container_budget_is_exact():
    ok = msgpack.packb([PROTOCOL_VERSION, {}, {"seq": 1, "payload": b""}])
    decode([b"ping", ok])   # 3 containers: far below the budget
    n = codec.MAX_CONTAINERS  # plus the 3 containers of the envelope: one over
    hostile = msgpack.packb([PROTOCOL_VERSION, {}, {"seq": 1, "x": [[{}] * (n // 4)] * 4}])
    with pytest.raises(OversizedFrame, match="containers"):
        decode([b"ping", hostile])


def test_nesting_is_bounded_across_nested_events():
    v = {"seq": 1}
    for _ in range(codec.MAX_DEPTH + 2):
        v = {"seq": 1, "x": [msgpack.ExtType(2, msgpack.packb(["ping", v]))]}
    with pytest.raises(MalformedFrame, match="nests deeper"):
        decode([b"ping", msgpack.packb([PROTOCOL_VERSION, {}, v])])
    with pytest.raises(CodecError):
        decode([b"ping", b"\x93\x01\x80\x81\xa3seq" + b"\x91" * 100_000 + b"\x01"])


def test_frame_count_is_checked_before_the_body():
    """Too many frames are refused on the count alone: the body is never unpacked."""
    with pytest.raises(OversizedFrame, match="frames"):
        decode([b"ping", b"\xc1 not msgpack", *([b""] * codec.MAX_FRAMES)])


def test_legit_large_message_still_decodes():
    """A reply of 4,096 trajectories (a large training batch) stays within every limit."""
    import numpy as np

    from laminar.protocol import Samples, Trajectory, TrajectorySpec
    spec = TrajectorySpec("t", "p", "g", 0, 16, np.arange(8, dtype=np.int32))
    traj = Trajectory(spec, np.arange(4, dtype=np.int32), np.zeros(4, np.float32), 1, "r", 0.5,
                      timings={"a": 1.0, "b_s": 2.0})
    ev = Samples(groups=[[traj] * 16 for _ in range(256)], cursor=0)
    back, _ = decode([bytes(f) for f in codec.encode(ev)], max_frames=1 << 15)
    assert len(back.groups) == 256 and back.groups[-1][-1].timings == {"a": 1.0, "b_s": 2.0}


def test_every_bus_socket_has_a_size_limit(tmp_path):
    """Subscriber, publisher, RPC and both broker sockets refuse frames above the limit."""
    import asyncio

    from laminar.bus import auth
    from laminar.bus.broker import MAX_SUBSCRIPTION_BYTES, Broker
    from laminar.bus.zmq_transport import ZmqTransport
    auth.generate_keys(tmp_path / "k")
    keys = auth.load_keys(tmp_path / "k")
    limit = 3 << 20
    broker = Broker("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", keys, max_msg=limit)
    broker.start()

    async def main():
        t = ZmqTransport(broker.pub_address, broker.sub_address, keys, max_msg=limit)
        try:
            sub, pub = t.subscriber(["x."]), t.publisher()
            srv = t.server("tcp://127.0.0.1:0", "echo", "0")
            await srv.start()
            cli = t.client(srv.address)
            for s in (sub.sock, srv.sock, cli.sock):
                assert s.getsockopt(zmq.MAXMSGSIZE) == limit, s.socket_type
            assert pub.sock.getsockopt(zmq.MAXMSGSIZE) == MAX_SUBSCRIPTION_BYTES  # it receives subscriptions only
        finally:
            await t.close()
    try:
        asyncio.run(main())
        assert broker.max_msg == limit
        # read back from the sockets before the proxy thread took them over
        assert broker.socket_limits == {"xsub": limit, "xpub": MAX_SUBSCRIPTION_BYTES}
    finally:
        broker.stop()


def test_ping_still_round_trips():
    back, _ = decode([bytes(f) for f in codec.encode(Ping(seq=3))])
    assert back.seq == 3


def test_rpc_server_drops_oversized_messages_and_keeps_serving(tmp_path):
    """Real sockets: 70,000 empty frames, then a frame above the size limit; the server counts
    the first as bad, libzmq drops the second sender's connection, and a real call still works."""
    import asyncio

    from laminar.bus import auth

    from tests.support import curve_echo_server
    auth.generate_keys(tmp_path / "k")
    keys = auth.load_keys(tmp_path / "k")

    async def main():
        async with curve_echo_server(keys, dealers=2, max_msg=1 << 20) as (t, srv, (many, big)):
            many.send_multipart([b"ping", msgpack.packb([PROTOCOL_VERSION, {"rid": 1}, {"seq": 1}]),
                                 *([b""] * 70_000)])
            big.send_multipart([b"ping", b"\x00" * (2 << 20)])
            cli = t.client(srv.address)
            for _ in range(50):
                if srv.stats.get("bad_frames"):
                    break
                await asyncio.sleep(0.05)
            assert (await cli.call(Ping(seq=5), timeout=5)).seq == 5
            assert srv.stats.get("bad_frames") == 1, srv.stats   # the 70,000-frame message, unread
            assert srv.stats.get("requests") == 1, srv.stats      # the 2 MiB frame never reached Python
    asyncio.run(main())


def test_each_fuzz_message_is_refused_quickly_with_a_typed_error():
    """The fuzz's hostile messages (laminar.testing.fuzz_ports), decoded as a receive loop would on
    its event loop: each is refused with a CodecError; the time each holds the loop is printed."""
    import time

    from laminar.testing.fuzz_ports import hostile_messages
    rows = []
    for name, frames in hostile_messages(1 << 20):
        t0 = time.perf_counter()
        with pytest.raises(CodecError) as e:
            decode(frames)
        rows.append(f"{name:<16} {type(e.value).__name__:<15} {1e3 * (time.perf_counter() - t0):7.1f} ms")
    print("\n" + "\n".join(rows))
