"""Bad input at every listening port of a running cluster (the bad-input guarantee of docs/architecture.md §3).

    python -m laminar.testing.fuzz_ports CONFIG [--frames 2000] [--seed 0] [--hosts h0,h1]
                                         [--hostile] [--silent N --hold S] [--as SCOPE[.NAME] --forge]

For every role of the chosen hosts that serves request/reply (a `port`), a DEALER with the
cluster key sends garbage multipart messages (random frames, bit flips, truncated frame lists
and frames of a valid request); the broker's XSUB gets garbage events under a random topic; each
relay's data port gets raw random bytes over TCP (its chunk protocol must refuse them). Run it
from a place that reaches the hosts' addresses (inside a namespace for the netns harness).
Prints one line per target; the cluster must keep training (what the caller checks).

`--hostile` adds, to every request/reply port and the broker, messages built to cost memory or
time: a 2 MB body of empty maps (32 x 65,536), an array header claiming 4G entries, 100,000
nested arrays, 70,000 frames, and a frame one byte over `max_message_mb`. `--silent N` holds N
TCP connections that never speak open to every port (bus, relay data, metrics) for `--hold`
seconds, while the rest runs and after it.

`--as rollout` (with scoped keys, bus/auth.py) sends everything with that client key instead of
the operator's: what a compromised rollout host could do. `--forge` adds well-formed requests and
events that such a key may not send: `Shutdown` on `ctrl.all` and on every role's `ctrl.ROLE.ID`,
a heartbeat in every role's name saying it is stopping and unhealthy, and to every
request/reply port a RelayJoin (a master-relay claim) and a PutTrajectory and an AppendDeltas
for another rollout. It prints how each port answered them (a scoped cluster answers `refused`
to each when the key is a named rollout key, `--as rollout.r0`); the cluster must go on and no
role may restart or stop.
"""
from __future__ import annotations

import argparse
import random
import socket
import time

import msgpack
import numpy as np
import zmq

from laminar.bus import auth
from laminar.bus.codec import decode, encode
from laminar.config import load_config
from laminar.protocol import (
    PROTOCOL_VERSION,
    AppendDeltas,
    ErrorReply,
    Heartbeat,
    PutTrajectory,
    RelayJoin,
    Shutdown,
    TakeBatch,
    Trajectory,
    TrajectorySpec,
)


def garbage(rng: random.Random, valid: list[bytes]) -> list[bytes]:
    """One malformed message: random frames, or a valid one with a bit flipped or cut short."""
    r = rng.random()
    if r < 0.3:
        return [rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(1, 4))]
    frames = [bytearray(f) for f in valid]
    if r < 0.6:
        f = frames[rng.randrange(len(frames))]
        if f:
            f[rng.randrange(len(f))] ^= 1 << rng.randrange(8)   # bit flip
    elif r < 0.8:
        frames = frames[: rng.randint(0, len(frames))]         # truncated frame list
    else:
        i = rng.randrange(len(frames))
        frames[i] = frames[i][: rng.randint(0, len(frames[i]))]  # truncated frame
    return [bytes(f) for f in frames] or [b""]


def hostile_messages(max_msg_bytes: int) -> list[tuple[str, list[bytes]]]:
    """(name, frames) of messages built to exhaust a decoder; every one must be refused cheaply."""

    v = PROTOCOL_VERSION
    empty_maps = msgpack.packb([v, {"rid": 1}, {"seq": 1, "x": [[{}] * 65_536 for _ in range(32)]}])
    return [
        ("empty_maps_2MB", [b"ping", empty_maps]),
        ("array_header_4G", [b"ping", b"\x93\x01\x80\xdd\xff\xff\xff\xff"]),
        ("nested_100k", [b"ping", b"\x93\x01\x80\x81\xa3seq" + b"\x91" * 100_000 + b"\x01"]),
        ("frames_70k", [b"ping", msgpack.packb([v, {"rid": 2}, {"seq": 1}]), *([b""] * 70_000)]),
        ("oversized_frame", [b"ping", b"\x00" * (max_msg_bytes + 1)]),
    ]


def hold_silent(addresses: list[tuple[str, int]], n: int) -> list[socket.socket]:
    held = []
    for host, port in addresses:
        for _ in range(n):
            try:
                held.append(socket.create_connection((host, port), timeout=1))
            except OSError:
                pass
    return held


def forged_requests(rollout_id: str) -> list:
    """Well-formed requests a rollout key may not send (--forge)."""
    spec = TrajectorySpec("fuzz-t", "fuzz-p", "fuzz-g", 0, 1, np.arange(4, dtype=np.int32))
    traj = Trajectory(spec, np.arange(2, dtype=np.int32), np.zeros(2, dtype=np.float32), 0, rollout_id, 1.0)
    return [RelayJoin("fuzz-master", "fuzz-host", "127.0.0.1:9", "tcp://127.0.0.1:9"), PutTrajectory(traj),
            AppendDeltas(rollout_id, [])]


def forged_events(cfg, hosts: list[str]) -> list[tuple[str, object]]:
    """(topic, event) a rollout key may not publish (--forge): stop commands, heartbeats of others."""
    out: list[tuple[str, object]] = [("ctrl.all", Shutdown("fuzz: forged by a rollout key"))]
    for hid in hosts:
        for spec in cfg.cluster.hosts[hid].roles:
            out.append((f"ctrl.{spec.role}.{spec.id}", Shutdown("fuzz: forged")))
            out.append((f"hb.{spec.role}.{spec.id}", Heartbeat(spec.role, str(spec.id), hid, 1, 1 << 40, 0.0,
                                                              "stopping", {"unhealthy": "fuzz: forged"})))
    return out


def _answers(sock, n: int, wait_s: float) -> dict[str, int]:
    """Error codes (or reply kinds) of up to `n` replies arriving within `wait_s`."""

    got: dict[str, int] = {}
    deadline = time.monotonic() + wait_s
    while n and time.monotonic() < deadline:
        if not sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            break
        frames = sock.recv_multipart(zmq.NOBLOCK)
        try:
            reply, _ = decode(frames)
        except Exception:  # noqa: BLE001 - an answer to garbage: counted apart
            got["undecodable"] = got.get("undecodable", 0) + 1
            continue
        if isinstance(reply, ErrorReply):
            key = f"{reply.code}(forbidden)" if reply.message.startswith("forbidden") else reply.code
        else:
            key = type(reply).kind
        got[key] = got.get(key, 0) + 1
        n -= 1
    return got


def main() -> int:

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--frames", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hosts", default=None, help="comma-separated host ids (default: all)")
    ap.add_argument("--hostile", action="store_true", help="also send decoder-exhausting messages")
    ap.add_argument("--silent", type=int, default=0, help="silent TCP connections held open per port")
    ap.add_argument("--hold", type=float, default=5.0, help="seconds the silent connections stay open after the rest")
    ap.add_argument("--as", dest="as_", default=None, metavar="SCOPE[.NAME]",
                    help="use this client key (scoped keys), e.g. rollout: what a compromised rollout host could do")
    ap.add_argument("--forge", action="store_true",
                    help="also send well-formed control commands, heartbeats and requests a rollout key may not send")
    a = ap.parse_args()
    cfg = load_config(a.config)
    scope, _, name = (a.as_ or "").partition(".")
    keys = auth.load_keys(cfg.cluster.keys_dir, scope or None, name or None) if cfg.cluster.keys_dir else None
    forged_rpc = forged_requests("fuzz-not-mine") if a.forge else []
    hosts = a.hosts.split(",") if a.hosts else list(cfg.cluster.hosts)
    rng = random.Random(a.seed)
    valid = [bytes(f) for f in encode(TakeBatch("fuzz", 4, 1, 0), {"rid": 7, "dl": 2e9})]
    hostile = hostile_messages(cfg.cluster.bus.max_message_mb << 20) if a.hostile else []
    held: list[socket.socket] = []
    if a.silent:
        ports: list[tuple[str, int]] = []
        for hid in hosts:
            host = cfg.cluster.hosts[hid]
            ports += [(host.address, s.port) for s in host.roles if s.port]
            ports += [(host.address, p) for p in (host.metrics_port,) if p]
            ports += [(host.address, cfg.relay_settings(s.id).data_port)
                      for s in host.roles if s.role == "relay" and cfg.relay_settings(s.id).data_port]
            if hid == cfg.cluster.broker.host:
                ports += [(host.address, cfg.cluster.broker.pub_port), (host.address, cfg.cluster.broker.sub_port)]
        held = hold_silent(ports, a.silent)
        print(f"{'silent':<22} {len(held)} connections held open on {len(ports)} ports", flush=True)
    ctx = zmq.Context()
    for hid in hosts:
        host = cfg.cluster.hosts[hid]
        targets = [(f"{s.role}.{s.id}", f"tcp://{host.address}:{s.port}") for s in host.roles if s.port]
        for name, addr in targets:
            s = ctx.socket(zmq.DEALER)
            s.sndhwm, s.linger = 0, 0
            if keys:
                auth.make_client(s, keys)
            s.connect(addr)
            for _ in range(a.frames):
                s.send_multipart(garbage(rng, valid))
            for _, frames in hostile:
                s.send_multipart(frames)
            answers = {}
            if forged_rpc:
                s.close(linger=2000)  # a fresh connection: its replies are the forged requests' only
                s = ctx.socket(zmq.DEALER)
                s.linger = 0
                if keys:
                    auth.make_client(s, keys)
                s.connect(addr)
                for i, req in enumerate(forged_rpc):
                    s.send_multipart(encode(req, {"rid": 1000 + i, "st": time.time(), "to": 10.0}))
                answers = _answers(s, len(forged_rpc), 10.0)
            s.close(linger=2000)
            print(f"{name:<22} {addr:<28} {a.frames} garbage requests"
                  + (f", {len(hostile)} hostile" if hostile else "")
                  + (f", {len(forged_rpc)} forged: {answers}" if forged_rpc else ""), flush=True)
        if hid == cfg.cluster.broker.host:
            pub = ctx.socket(zmq.PUB)
            pub.sndhwm, pub.linger = 0, 0
            if keys:
                auth.make_client(pub, keys)
            pub.connect(f"tcp://{host.address}:{cfg.cluster.broker.pub_port}")
            for _ in range(a.frames):
                pub.send_multipart([b"fuzz." + rng.randbytes(4), *garbage(rng, valid)])
            for _, frames in hostile:  # under topics a role subscribes to: they reach decoders
                for topic in (b"hb.fuzz.0", b"metrics.fuzz", b"ctrl.all"):
                    pub.send_multipart([topic, *frames])
            events = forged_events(cfg, hosts) if a.forge else []
            if events:
                time.sleep(0.5)  # a fresh PUB drops what it sends before the subscriptions reach it
                for _ in range(3):
                    for topic, ev in events:
                        pub.send_multipart([topic.encode(), *encode(ev)])
                    time.sleep(0.2)
            pub.close(linger=2000)
            print(f"{'broker.xsub':<22} {host.address}:{cfg.cluster.broker.pub_port:<17} {a.frames} garbage events"
                  + (f", {3 * len(events)} forged control commands and heartbeats" if events else ""), flush=True)
        for spec in host.roles:
            if spec.role != "relay":
                continue
            port = cfg.relay_settings(spec.id).data_port
            if not port:
                continue
            for _ in range(20):
                try:
                    with socket.create_connection((host.address, port), timeout=2) as c:
                        c.sendall(rng.randbytes(rng.randint(1, 4096)) + np.random.bytes(16))
                except OSError:
                    pass
            print(f"relay.{spec.id} data{'':<11} {host.address}:{port:<17} 20 garbage connections", flush=True)
    ctx.term()
    if held:
        time.sleep(a.hold)  # the silent clients' duration: the cluster must work meanwhile
        for c in held:
            c.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
