"""Broker throughput with one key (zmq.proxy, in C) and with scoped keys (a Python loop that checks
every message's publisher key and topic, bus/broker.py), on loopback, in one run.

    python bench/broker_scopes.py [--messages 100000]

One publisher and one subscriber (sync sockets, in this process) send and count small messages
(3 frames, 100-byte body) through a fresh broker in each mode; prints messages per second. The
publisher and subscriber share this process, so the numbers are a floor for the broker.

Then the per-message cost of the default-deny checks, against the decoding every message gets
anyway, in the same run: a request/reply server's `auth.request_refusal` (table lookup plus the
named-rollout check) per request, and a subscriber's `auth.body_refusal` (the body names the
topic's role) per event, each as a fraction of `codec.decode` of that message.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path

import zmq
from laminar.bus import auth
from laminar.bus.broker import Broker
from laminar.bus.codec import decode, encode

from laminar.protocol import Heartbeat, TakeBatch
from laminar.testing.procs import free_port


def socket(ctx: zmq.Context, kind: int, keys, address: str) -> zmq.Socket:
    s = ctx.socket(kind)
    s.sndhwm = s.rcvhwm = 0
    auth.make_client(s, keys)
    if kind == zmq.SUB:
        s.setsockopt(zmq.SUBSCRIBE, b"m")
    s.connect(address)
    return s


def run(keys_dir: Path, scoped: bool, n: int) -> tuple[int, float]:
    keys = auth.load_keys(keys_dir, "broker") if scoped else auth.load_keys(keys_dir)
    client = auth.load_keys(keys_dir, "rollout", "r0") if scoped else keys
    pp, sp = free_port(), free_port()
    broker = Broker(f"tcp://127.0.0.1:{pp}", f"tcp://127.0.0.1:{sp}", keys)
    broker.start()
    ctx = zmq.Context()
    sub = socket(ctx, zmq.SUB, client, f"tcp://127.0.0.1:{sp}")
    pub = socket(ctx, zmq.PUB, client, f"tcp://127.0.0.1:{pp}")
    while True:  # until the subscription reached the publisher
        pub.send_multipart([b"m.warm", b"x"])
        if sub.poll(100):
            break
    while sub.poll(200):
        sub.recv_multipart()
    got = [0]

    def count() -> None:
        while got[0] < n and sub.poll(5000):
            sub.recv_multipart()
            got[0] += 1
    t = threading.Thread(target=count)
    t.start()
    t0 = time.perf_counter()
    body = b"y" * 100
    for _ in range(n):
        pub.send_multipart([b"m.x", b"kind", body])
    t.join()
    dt = time.perf_counter() - t0
    pub.close(0)
    sub.close(0)
    ctx.term()
    broker.stop()
    return got[0], dt


def per_call_us(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def check_costs(n: int) -> list[tuple[str, float, float]]:
    """(check, µs per check, µs per decode of the same message)."""
    req = TakeBatch("r0", 8, batch_seq=3, version=7, pid=1234)
    hb = Heartbeat("rollout", "r0", "h1", 1234, 7, 12.5, "ready", {"version": 7, "active": 3})
    out = []
    for name, ev, check in (("request_refusal (server, per request)", req,
                             lambda: auth.request_refusal("rollout.r0", req)),
                            ("body_refusal (subscriber, per event)", hb,
                             lambda: auth.body_refusal("hb.rollout.r0", hb))):
        frames = [bytes(f) for f in encode(ev)]
        out.append((name, per_call_us(check, n), per_call_us(lambda frames=frames: decode(frames), n)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=100_000)
    a = ap.parse_args()
    d = Path(tempfile.mkdtemp()) / "keys"
    auth.generate_keys(d)
    one = run(d, False, a.messages)
    for ident in ("broker", "rollout.r0"):
        auth.generate_client_key(d, ident)
    scoped = run(d, True, a.messages)
    print(f"one key (zmq.proxy): {one[0]} messages in {one[1]:.2f} s = {one[0] / one[1]:.0f}/s; "
          f"scoped (Python filter): {scoped[0]} in {scoped[1]:.2f} s = {scoped[0] / scoped[1]:.0f}/s; "
          f"load average {os.getloadavg()[0]:.1f}")
    for name, check, dec in check_costs(a.messages):
        print(f"{name}: {check:.2f} µs per message, {dec:.2f} µs to decode it: x{check / dec:.3f} of decoding")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
