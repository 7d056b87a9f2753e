"""Bus benchmark: typed events through the broker and typed request/reply, next to raw pyzmq
moving the same bytes over the same sockets in the same run (ratios, not absolute numbers, are
what this noisy 2-core machine can support).

    python bench/bus.py [--quick] [--out FILE] [--curve]

Phases (each side of a pair runs in its own process; the broker runs in the parent):
  pub/sub rate     N events published as fast as possible; the subscriber times first..last and
                   counts what arrived (PUB drops at its HWM, so received/s is the honest rate);
  pub/sub latency  events paced at a low rate, one-way latency from CLOCK_MONOTONIC stamps;
  rpc latency      sequential calls to an echo server (typed Ping/Pong vs raw DEALER/ROUTER);
  rpc rate         calls/s with `--concurrency` calls in flight.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import free_port, percentile, print_table, write_json  # noqa: E402

PAYLOAD = 64  # bytes of payload per event: a small control message


def _event(seq: int):
    from laminar.protocol import Ping
    return Ping(seq=seq, payload=b"x" * PAYLOAD)


# -- pub/sub --------------------------------------------------------------------------------
def _subscriber(sub_addr: str, n: int, raw: bool, keys_dir, ready, primed, out) -> None:
    import zmq
    from laminar.bus import auth
    from laminar.bus.codec import decode
    keys = auth.load_keys(keys_dir) if keys_dir else None
    ctx = zmq.Context()
    s = ctx.socket(zmq.SUB)
    s.rcvhwm = 1_000_000
    auth.make_client(s, keys)
    s.setsockopt(zmq.SUBSCRIBE, b"bench.")
    s.connect(sub_addr)
    ready.set()
    got, lat, t0 = 0, [], None
    s.rcvtimeo = 3000
    try:
        while got < n:
            frames = s.recv_multipart()
            if frames[0] == b"bench.warmup":
                primed.set()  # our subscription has reached the publisher through the broker
                continue
            if t0 is None:
                t0 = time.perf_counter()
            if raw:
                stamp = int.from_bytes(frames[-1][:8], "little") if len(frames) > 3 else None
            else:
                ev, _ = decode(frames[1:])
                stamp = int.from_bytes(ev.payload[:8], "little")
            if stamp:
                lat.append((time.monotonic_ns() - stamp) / 1e6)
            got += 1
    except zmq.Again:
        pass
    out.put((got, time.perf_counter() - (t0 or time.perf_counter()), lat))


def pubsub(pub_addr: str, sub_addr: str, n: int, raw: bool, keys_dir, paced_hz: float = 0) -> dict:
    import zmq
    from laminar.bus import auth
    from laminar.bus.codec import encode
    from laminar.bus.pubsub import ZmqPublisher
    keys = auth.load_keys(keys_dir) if keys_dir else None
    ready, primed, out = mp.Event(), mp.Event(), mp.Queue()
    p = mp.Process(target=_subscriber, args=(sub_addr, n, raw, keys_dir, ready, primed, out), daemon=True)
    p.start()
    ready.wait(10)
    ctx = zmq.Context()
    pub = ZmqPublisher(ctx, pub_addr, keys, hwm=1_000_000)
    from laminar.protocol import Ping
    # handshake: publish warm-ups until the subscriber has seen one (its subscription is live)
    deadline = time.monotonic() + 10
    while not primed.wait(0.01) and time.monotonic() < deadline:
        pub.publish("bench.warmup", Ping(seq=0))
    template = encode(_event(0))
    period = 1.0 / paced_hz if paced_hz else 0
    t0 = time.perf_counter()
    for i in range(n):
        stamp = time.monotonic_ns().to_bytes(8, "little")
        if raw:
            pub.sock.send_multipart([b"bench.x", template[0], template[1], stamp])
        else:
            pub.publish("bench.x", Ping(seq=i, payload=stamp + b"x" * (PAYLOAD - 8)))
        if period:
            target = t0 + (i + 1) * period
            while time.perf_counter() < target:
                pass
    send_s = time.perf_counter() - t0
    got, recv_s, lat = out.get(timeout=60)
    p.join(5)
    pub.close()
    ctx.term()
    rate = got / recv_s if recv_s > 0 else 0.0
    return {"sent": n, "received": got, "send_s": send_s, "recv_s": recv_s, "events_per_s": rate,
            "lat_p50_ms": percentile(lat, 50), "lat_p99_ms": percentile(lat, 99)}


# -- request/reply ----------------------------------------------------------------------------
def _rpc_server(addr: str, raw: bool, keys_dir, ready) -> None:
    import zmq
    from laminar.bus import auth
    keys = auth.load_keys(keys_dir) if keys_dir else None
    if raw:
        ctx = zmq.Context()
        auth.start_authenticator(ctx, keys, threaded=True)
        s = ctx.socket(zmq.ROUTER)
        auth.make_server(s, keys)
        s.bind(addr)
        ready.set()
        while True:
            s.send_multipart(s.recv_multipart())
    from laminar.bus.zmq_transport import ZmqTransport

    from laminar.protocol import Ping, Pong

    async def main() -> None:
        t = ZmqTransport("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", keys)
        srv = t.server(addr, "echo", "bench")

        async def on_ping(req: Ping) -> Pong:
            return Pong(seq=req.seq, payload=req.payload)

        srv.route(Ping, on_ping)
        await srv.start()
        ready.set()
        await asyncio.Event().wait()

    import uvloop
    uvloop.run(main())


async def _rpc_client(addr: str, raw: bool, keys_dir, n: int, concurrency: int) -> dict:
    import zmq
    import zmq.asyncio
    from laminar.bus import auth
    from laminar.bus.codec import encode
    keys = auth.load_keys(keys_dir) if keys_dir else None
    lat: list[float] = []
    if raw:
        ctx = zmq.asyncio.Context()
        s = ctx.socket(zmq.DEALER)
        auth.make_client(s, keys)
        s.connect(addr)
        frames = encode(_event(0), {"rid": 1})

        async def one() -> None:
            t = time.perf_counter()
            await s.send_multipart(frames)
            await s.recv_multipart()
            lat.append((time.perf_counter() - t) * 1e3)
        close = lambda: ctx.destroy(linger=0)  # noqa: E731
    else:
        from laminar.bus.zmq_transport import ZmqTransport
        tr = ZmqTransport("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", keys)
        c = tr.client(addr)
        await c.hello("bench", "client")

        async def one() -> None:
            t = time.perf_counter()
            await c.call(_event(1), timeout=5)
            lat.append((time.perf_counter() - t) * 1e3)
        close = None
    for _ in range(200):  # warm-up
        await one()
    lat.clear()
    for _ in range(n):
        await one()
    seq = {"p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99)}
    if raw:  # a raw DEALER has no request ids: pipelined replies are matched by count
        t0 = time.perf_counter()
        for _batch in range(0, n, concurrency):
            for _ in range(concurrency):
                await s.send_multipart(frames)
            for _ in range(concurrency):
                await s.recv_multipart()
        rate = n / (time.perf_counter() - t0)
    else:
        t0 = time.perf_counter()
        for _batch in range(0, n, concurrency):
            await asyncio.gather(*(c.call(_event(j), timeout=5) for j in range(concurrency)))
        rate = n / (time.perf_counter() - t0)
    if close:
        close()
    else:
        await tr.close()
    return {**seq, "calls_per_s": rate}


def rpc(raw: bool, keys_dir, n: int, concurrency: int) -> dict:
    addr = f"tcp://127.0.0.1:{free_port()}"
    ready = mp.Event()
    p = mp.Process(target=_rpc_server, args=(addr, raw, keys_dir, ready), daemon=True)
    p.start()
    ready.wait(10)
    try:
        import uvloop
        return uvloop.run(_rpc_client(addr, raw, keys_dir, n, concurrency))
    finally:
        p.kill()
        p.join(5)


def main() -> int:
    import faulthandler
    faulthandler.dump_traceback_later(float(os.environ.get("BENCH_HANG_S", "300")), exit=True)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer events (finishes in well under 60 s)")
    ap.add_argument("--out", default=None, help="write JSON results here")
    ap.add_argument("--curve", action="store_true", help="CURVE-encrypt every socket (as clusters run)")
    ap.add_argument("--concurrency", type=int, default=32, help="calls in flight in the rpc rate phase")
    a = ap.parse_args()
    n_rate = 50_000 if a.quick else 300_000
    n_lat = 2_000 if a.quick else 10_000
    n_rpc = 2_000 if a.quick else 20_000

    from laminar.bus.broker import Broker
    keys_dir = None
    if a.curve:
        import tempfile

        from laminar.bus.auth import generate_keys, load_keys
        keys_dir = tempfile.mkdtemp(prefix="laminar-bench-keys-")
        generate_keys(keys_dir)
    broker = Broker(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}",
                    load_keys(keys_dir) if keys_dir else None, hwm=1_000_000)
    broker.start()
    res: dict = {"quick": a.quick, "curve": a.curve, "payload_bytes": PAYLOAD}
    try:
        typed = pubsub(broker.pub_address, broker.sub_address, n_rate, False, keys_dir)
        raw = pubsub(broker.pub_address, broker.sub_address, n_rate, True, keys_dir)
        typed_lat = pubsub(broker.pub_address, broker.sub_address, n_lat, False, keys_dir, paced_hz=2000)
        raw_lat = pubsub(broker.pub_address, broker.sub_address, n_lat, True, keys_dir, paced_hz=2000)
        rpc_typed = rpc(False, keys_dir, n_rpc, a.concurrency)
        rpc_raw = rpc(True, keys_dir, n_rpc, a.concurrency)
    finally:
        broker.stop()
    print_table("pub/sub through the broker (events of 64-byte payload)",
                ["path", "events/s", "received", "p50 ms (paced 2k/s)", "p99 ms (paced 2k/s)"],
                [["typed events", typed["events_per_s"], f"{typed['received']}/{typed['sent']}",
                  typed_lat["lat_p50_ms"], typed_lat["lat_p99_ms"]],
                 ["raw pyzmq, same bytes", raw["events_per_s"], f"{raw['received']}/{raw['sent']}",
                  raw_lat["lat_p50_ms"], raw_lat["lat_p99_ms"]]])
    print_table("request/reply (echo server in another process)",
                ["path", "p50 ms", "p99 ms", f"calls/s ({a.concurrency} in flight)"],
                [["typed rpc", rpc_typed["p50_ms"], rpc_typed["p99_ms"], rpc_typed["calls_per_s"]],
                 ["raw DEALER/ROUTER", rpc_raw["p50_ms"], rpc_raw["p99_ms"], rpc_raw["calls_per_s"]]])
    ratio = typed["events_per_s"] / raw["events_per_s"] if raw["events_per_s"] else 0.0
    print(
        f"\ntyped/raw pub/sub rate: {ratio:.2f} (target >= 0.30); rpc p99 {rpc_typed['p99_ms']:.3f} ms (target < 2 ms)"
    )
    res.update({
        "pubsub_events_per_s": typed["events_per_s"], "raw_zmq_msgs_per_s": raw["events_per_s"],
        "pubsub_ratio_to_raw": ratio, "pubsub_lat_p50_ms": typed_lat["lat_p50_ms"],
        "pubsub_lat_p99_ms": typed_lat["lat_p99_ms"], "raw_lat_p50_ms": raw_lat["lat_p50_ms"],
        "raw_lat_p99_ms": raw_lat["lat_p99_ms"], "rpc_p50_ms": rpc_typed["p50_ms"],
        "rpc_p99_ms": rpc_typed["p99_ms"], "rpc_calls_per_s": rpc_typed["calls_per_s"],
        "raw_rpc_p50_ms": rpc_raw["p50_ms"], "raw_rpc_p99_ms": rpc_raw["p99_ms"],
        "raw_rpc_calls_per_s": rpc_raw["calls_per_s"],
        "detail": {"typed": typed, "raw": raw, "typed_lat": typed_lat, "raw_lat": raw_lat},
    })
    write_json(a.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
