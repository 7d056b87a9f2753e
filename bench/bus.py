"""Bus benchmark: typed events through the broker and typed request/reply, next to raw pyzmq
moving the same bytes over the same sockets in the same run (ratios, not absolute numbers, are
what this noisy 2-core machine can support).

    python bench/bus.py [--quick] [--out FILE] [--curve | --scoped] [--repeats R]

--scoped: scoped keys, as a cluster made with `laminar-node keygen --scopes` runs (CURVE on every
socket; the broker checks every published message's key and topic, the subscriber every event's
body against its topic, the server every request's key against the request table), typed and raw
alike through the same sockets and broker. --repeats: each phase R times, typed and raw in
alternating order; the ratio and the p99 are medians over the repeats, with their spread.

Phases (each side of a pair runs in its own process; the broker runs in the parent):
  pub/sub rate     N events published as fast as possible; the subscriber times first..last and
                   counts what arrived (PUB drops at its HWM, so received/s is the honest rate);
  pub/sub latency  events paced at a low rate, one-way latency from CLOCK_MONOTONIC stamps;
  rpc latency      sequential calls to an echo server (typed Ping/Pong vs raw DEALER/ROUTER);
  rpc rate         calls/s with `--concurrency` calls in flight;
  ping-pong        one byte back and forth over two pipes between two processes (no ZeroMQ, no
                   Python work to speak of): the machine's own wake-up latency at that moment, the
                   floor under any round trip's p99.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import free_port, percentile, print_table, write_json  # noqa: E402

PAYLOAD = 64  # bytes of payload per event: a small control message


def _event(seq: int):
    from laminar.protocol import Ping
    return Ping(seq=seq, payload=b"x" * PAYLOAD)


# -- pub/sub --------------------------------------------------------------------------------
def _keys(keys_dir, identity: str | None):
    """The keys of `identity` ("scope" or "scope.name") with scoped keys, else the cluster key."""
    from laminar.bus import auth
    if not keys_dir:
        return None
    if identity and (Path(keys_dir) / auth.CLIENTS).is_dir():
        scope, _, name = identity.partition(".")
        return auth.load_keys(keys_dir, scope, name or None)
    return auth.load_keys(keys_dir)


def _subscriber(sub_addr: str, n: int, raw: bool, keys_dir, ready, primed, out) -> None:
    import zmq
    from laminar.bus import auth
    from laminar.bus.codec import decode
    keys = _keys(keys_dir, "manager")
    check = keys is not None and keys.scoped  # what ZmqSubscriber does with scoped keys: the body names its topic
    ctx = zmq.Context()
    s = ctx.socket(zmq.SUB)
    s.rcvhwm = 1_000_000
    auth.make_client(s, keys)
    s.setsockopt(zmq.SUBSCRIBE, b"bench.")
    s.connect(sub_addr)
    ready.set()
    got, lat, t0, c0 = 0, [], None, 0.0
    s.rcvtimeo = 3000
    try:
        while got < n:
            frames = s.recv_multipart()
            if frames[0] == b"bench.warmup":
                primed.set()  # our subscription has reached the publisher through the broker
                continue
            if t0 is None:
                t0, c0 = time.perf_counter(), time.process_time()
            if raw:
                stamp = int.from_bytes(frames[-1][:8], "little") if len(frames) > 3 else None
            else:
                ev, _ = decode(frames[1:])
                if check and auth.body_refusal(frames[0].decode(), ev):
                    continue
                stamp = int.from_bytes(ev.payload[:8], "little")
            if stamp:
                lat.append((time.monotonic_ns() - stamp) / 1e6)
            got += 1
    except zmq.Again:
        pass
    out.put((got, time.perf_counter() - (t0 or time.perf_counter()), lat, time.process_time() - c0 if t0 else 0.0))


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used so far."""
    f = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def _broker(keys_dir, scoped: bool, conn) -> None:
    """The broker in a process of its own, as a cluster runs it (a scoped one forwards in Python)."""
    from laminar.bus.auth import load_keys
    from laminar.bus.broker import Broker
    keys = None if keys_dir is None else load_keys(keys_dir, "broker") if scoped else load_keys(keys_dir)
    b = Broker(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", keys, hwm=1_000_000)
    b.start()
    conn.send((b.pub_address, b.sub_address))
    conn.recv()  # until told to stop
    b.stop()


def pubsub(broker, n: int, raw: bool, keys_dir, paced_hz: float = 0) -> dict:
    import zmq
    from laminar.bus.codec import encode
    from laminar.bus.pubsub import ZmqPublisher
    keys = _keys(keys_dir, "rollout.r0")
    ready, primed, out = mp.Event(), mp.Event(), mp.Queue()
    p = mp.Process(target=_subscriber, args=(broker.sub_address, n, raw, keys_dir, ready, primed, out), daemon=True)
    p.start()
    ready.wait(10)
    ctx = zmq.Context()
    pub = ZmqPublisher(ctx, broker.pub_address, keys, hwm=1_000_000)
    from laminar.protocol import Ping
    # handshake: publish warm-ups until the subscriber has seen one (its subscription is live)
    deadline = time.monotonic() + 10
    while not primed.wait(0.01) and time.monotonic() < deadline:
        pub.publish("bench.warmup", Ping(seq=0))
    template = encode(_event(0))
    period = 1.0 / paced_hz if paced_hz else 0
    b0, c0 = cpu_s(broker.pid), time.process_time()
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
    got, recv_s, lat, sub_cpu = out.get(timeout=60)
    cpu = {"publisher": time.process_time() - c0, "broker": cpu_s(broker.pid) - b0, "subscriber": sub_cpu}
    p.join(5)
    pub.close()
    ctx.term()
    rate = got / recv_s if recv_s > 0 else 0.0
    return {"sent": n, "received": got, "send_s": send_s, "recv_s": recv_s, "events_per_s": rate,
            "lat_p50_ms": percentile(lat, 50), "lat_p99_ms": percentile(lat, 99),
            "cpu_us_per_event": {k: 1e6 * v / max(got, 1) for k, v in cpu.items()},
            "total_cpu_us_per_event": 1e6 * sum(cpu.values()) / max(got, 1)}


# -- request/reply ----------------------------------------------------------------------------
def _rpc_server(addr: str, raw: bool, keys_dir, ready, cores: set[int] | None = None) -> None:
    if cores is not None:
        os.sched_setaffinity(0, cores)  # before the context is made: its I/O thread inherits it
    import zmq
    from laminar.bus import auth
    keys = _keys(keys_dir, "node")
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
    keys = _keys(keys_dir, "rollout.r0")
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


def rpc(raw: bool, keys_dir, n: int, concurrency: int, cores: tuple = (None, None)) -> dict:
    """The RPC phases against an echo server in another process; `cores` = (client's, server's)
    CPU sets, None: where the scheduler likes (bench/bus_placement.py places them)."""
    addr = f"tcp://127.0.0.1:{free_port()}"
    ready = mp.Event()
    p = mp.Process(target=_rpc_server, args=(addr, raw, keys_dir, ready, cores[1]), daemon=True)
    p.start()
    everything = os.sched_getaffinity(0)
    try:
        if not ready.wait(30):
            raise RuntimeError("the echo server did not start within 30 s")
        import uvloop
        os.sched_setaffinity(0, cores[0] or everything)  # the client's context is made after this
        s0, c0 = cpu_s(p.pid), time.process_time()
        out = uvloop.run(_rpc_client(addr, raw, keys_dir, n, concurrency))
        # client + server CPU (their ZeroMQ threads too) per call, over every phase of the run
        out["cpu_us_per_call"] = 1e6 * (cpu_s(p.pid) - s0 + time.process_time() - c0) / (2 * n + 200)
        return out
    finally:
        os.sched_setaffinity(0, everything)
        p.kill()
        p.join(5)


# -- the machine's wake-up floor -------------------------------------------------------------------
def _pong(r: int, w: int) -> None:
    while os.read(r, 1):
        os.write(w, b"x")


def pingpong(n: int) -> dict:
    """`n` one-byte round trips over two pipes to another process: p50 and p99 in ms."""
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    p = mp.Process(target=_pong, args=(r1, w2), daemon=True)
    p.start()
    lat = []
    try:
        for i in range(n + 200):  # the first 200: warm-up
            t = time.perf_counter()
            os.write(w1, b"x")
            os.read(r2, 1)
            if i >= 200:
                lat.append((time.perf_counter() - t) * 1e3)
    finally:
        p.kill()
        p.join(5)
        for fd in (r1, w1, r2, w2):
            os.close(fd)
    return {"p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99)}


def make_keys(scoped: bool) -> str:
    """A keys folder: the cluster key, and with `scoped` a client key per scope and rollout.r0."""
    import tempfile

    from laminar.bus.auth import SCOPES, generate_client_key, generate_keys
    keys_dir = tempfile.mkdtemp(prefix="laminar-bench-keys-")
    generate_keys(keys_dir)
    for identity in [*SCOPES, "rollout.r0"] if scoped else []:
        generate_client_key(keys_dir, identity)
    return keys_dir


def spread(xs: list[float]) -> float:
    """(max - min) / median of repeated measurements (0 for fewer than two)."""
    return (max(xs) - min(xs)) / statistics.median(xs) if len(xs) > 1 and statistics.median(xs) else 0.0


def measure(broker, keys_dir, a, n_rate: int, n_lat: int, n_rpc: int) -> dict:
    """Every phase `a.repeats` times, typed and raw in alternating order (ABBA...)."""
    runs: dict[str, list] = {k: [] for k in ("typed", "raw", "typed_lat", "raw_lat", "rpc_typed", "rpc_raw",
                                             "pingpong")}
    for r in range(a.repeats):
        for raw in (False, True) if r % 2 == 0 else (True, False):
            runs["raw" if raw else "typed"].append(pubsub(broker, n_rate, raw, keys_dir))
        for raw in (False, True) if r % 2 == 0 else (True, False):
            runs["raw_lat" if raw else "typed_lat"].append(pubsub(broker, n_lat, raw, keys_dir, paced_hz=2000))
        for raw in (False, True) if r % 2 == 0 else (True, False):
            runs["rpc_raw" if raw else "rpc_typed"].append(rpc(raw, keys_dir, n_rpc, a.concurrency))
        runs["pingpong"].append(pingpong(n_rpc))
    return runs


def main() -> int:
    import faulthandler
    faulthandler.dump_traceback_later(float(os.environ.get("BENCH_HANG_S", "300")), exit=True)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer events (finishes in well under 60 s)")
    ap.add_argument("--out", default=None, help="write JSON results here")
    ap.add_argument("--curve", action="store_true", help="CURVE-encrypt every socket with one cluster key")
    ap.add_argument("--scoped", action="store_true", help="scoped keys: CURVE, and every check of a scoped "
                    "cluster (broker, subscriber, server)")
    ap.add_argument("--repeats", type=int, default=1, help="times each phase runs (median and spread)")
    ap.add_argument("--concurrency", type=int, default=32, help="calls in flight in the rpc rate phase")
    a = ap.parse_args()
    n_rate = 50_000 if a.quick else 300_000
    n_lat = 2_000 if a.quick else 10_000
    n_rpc = 2_000 if a.quick else 20_000

    keys_dir = make_keys(a.scoped) if a.curve or a.scoped else None
    here, there = mp.Pipe()
    broker = mp.Process(target=_broker, args=(keys_dir, a.scoped, there), daemon=True)
    broker.start()
    broker.pub_address, broker.sub_address = here.recv()
    res: dict = {"quick": a.quick, "curve": a.curve or a.scoped, "scoped": a.scoped, "payload_bytes": PAYLOAD,
                 "repeats": a.repeats}
    try:
        runs = measure(broker, keys_dir, a, n_rate, n_lat, n_rpc)
    finally:
        here.send("stop")
        broker.join(10)
    ratios = [t["events_per_s"] / r["events_per_s"] if r["events_per_s"] else 0.0
              for t, r in zip(runs["typed"], runs["raw"], strict=True)]
    med = lambda rs, k: statistics.median(x[k] for x in rs)  # noqa: E731
    typed, raw = runs["typed"][0], runs["raw"][0]
    mode = "scoped keys" if a.scoped else "CURVE, one key" if a.curve else "no keys"
    print_table(f"pub/sub through the broker (events of 64-byte payload; {mode}; medians of {a.repeats})",
                ["path", "events/s", "received", "p50 ms (paced 2k/s)", "p99 ms (paced 2k/s)"],
                [["typed events", med(runs["typed"], "events_per_s"), f"{typed['received']}/{typed['sent']}",
                  med(runs["typed_lat"], "lat_p50_ms"), med(runs["typed_lat"], "lat_p99_ms")],
                 ["raw pyzmq, same bytes", med(runs["raw"], "events_per_s"), f"{raw['received']}/{raw['sent']}",
                  med(runs["raw_lat"], "lat_p50_ms"), med(runs["raw_lat"], "lat_p99_ms")]])
    print_table(f"request/reply (echo server in another process; medians of {a.repeats})",
                ["path", "p50 ms", "p99 ms", f"calls/s ({a.concurrency} in flight)"],
                [["typed rpc", med(runs["rpc_typed"], "p50_ms"), med(runs["rpc_typed"], "p99_ms"),
                  med(runs["rpc_typed"], "calls_per_s")],
                 ["raw DEALER/ROUTER", med(runs["rpc_raw"], "p50_ms"), med(runs["rpc_raw"], "p99_ms"),
                  med(runs["rpc_raw"], "calls_per_s")],
                 ["pipe ping-pong (the machine)", med(runs["pingpong"], "p50_ms"), med(runs["pingpong"], "p99_ms"),
                  "-"]])
    ratio, p99s = statistics.median(ratios), [x["p99_ms"] for x in runs["rpc_typed"]]
    cpu = {k: med(runs[k], "total_cpu_us_per_event") for k in ("typed", "raw")}
    rpc_cpu = {k: med(runs[k], "cpu_us_per_call") for k in ("rpc_typed", "rpc_raw")}
    print(f"CPU per event (publisher + broker + subscriber): typed {cpu['typed']:.1f} us, raw {cpu['raw']:.1f} us; "
          f"per call (client + server): typed {rpc_cpu['rpc_typed']:.1f} us, raw {rpc_cpu['rpc_raw']:.1f} us")
    print(f"\ntyped/raw pub/sub rate: {ratio:.2f} (runs {', '.join(f'{x:.2f}' for x in ratios)}; goal >= 0.7); "
          f"rpc p99 {statistics.median(p99s):.3f} ms (runs {', '.join(f'{x:.3f}' for x in p99s)}; goal <= 1 ms)")
    res.update({
        "pubsub_events_per_s": med(runs["typed"], "events_per_s"),
        "raw_zmq_msgs_per_s": med(runs["raw"], "events_per_s"),
        "pubsub_ratio_to_raw": ratio, "pubsub_ratio_to_raw_runs": ratios, "pubsub_ratio_spread": spread(ratios),
        "pubsub_lat_p50_ms": med(runs["typed_lat"], "lat_p50_ms"),
        "pubsub_lat_p99_ms": med(runs["typed_lat"], "lat_p99_ms"),
        "raw_lat_p50_ms": med(runs["raw_lat"], "lat_p50_ms"), "raw_lat_p99_ms": med(runs["raw_lat"], "lat_p99_ms"),
        "rpc_p50_ms": med(runs["rpc_typed"], "p50_ms"), "rpc_p99_ms": statistics.median(p99s), "rpc_p99_ms_runs": p99s,
        "rpc_p99_spread": spread(p99s), "rpc_calls_per_s": med(runs["rpc_typed"], "calls_per_s"),
        "raw_rpc_p50_ms": med(runs["rpc_raw"], "p50_ms"), "raw_rpc_p99_ms": med(runs["rpc_raw"], "p99_ms"),
        "raw_rpc_calls_per_s": med(runs["rpc_raw"], "calls_per_s"),
        "pingpong_p50_ms": med(runs["pingpong"], "p50_ms"), "pingpong_p99_ms": med(runs["pingpong"], "p99_ms"),
        "pubsub_cpu_us_per_event": cpu["typed"], "raw_cpu_us_per_event": cpu["raw"],
        "pubsub_cpu_ratio": cpu["raw"] / cpu["typed"] if cpu["typed"] else 0.0,
        "rpc_cpu_us_per_call": rpc_cpu["rpc_typed"], "raw_rpc_cpu_us_per_call": rpc_cpu["rpc_raw"],
        "detail": runs,
    })
    write_json(a.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
