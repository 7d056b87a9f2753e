"""What authenticating the chunk links costs (part of bench/broadcast.py; runnable alone).

A publisher and two relays in one process on loopback (unshaped, so the CPU work shows: on a
real link of a few hundred Mbit/s to a few GB/s the hashing hides behind the wire), publisher ->
relay A -> relay B, the real data-plane code. One version of S bytes at a time; the time is from
publish() until B has made it visible (verified and committed), and the process's CPU time over
the same span (every thread: the publisher's copy and sender, both relays), which is what a busy
machine distorts least; medians of `reps`. Three modes,
each in a fresh process, run in turn twice (A B C A B C) so that load from other work on the
machine falls on all of them:

  none      no digests, no message MACs, no signatures: the transfer and the protocol alone (the
            crypto functions are replaced by no-ops in that process; nothing in production can
            switch them off);
  digests   every chunk's BLAKE3 digest computed by the publisher and checked by each relay, but
            no message MACs and unsigned seals: the per-byte work protocol 2 did (one keyed
            BLAKE3 pass per chunk per hop), i.e. about what the chain cost before;
  full      what runs now: digests, a MAC on every message under the link's keys, Ed25519 seals
            signed by the publisher and checked by both relays, trainer handshakes.

Also measured in the `full` process: Ed25519 sign and verify, and one relay's seal check of a
whole version given its chunk digests (the comparison it does at the end) and from the bytes (what
a rollout's pull does).

    python bench/broadcast_auth.py --mib 256 --reps 5 --out runs/bench/broadcast_auth.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]
MODES = ("none", "digests", "full")


def _disable(mode: str) -> None:
    """Replace what `mode` leaves out by no-ops, in this process only."""
    from laminar.weights import wire
    if mode in ("none", "digests"):
        wire.Channel._mac = staticmethod(lambda key, seq, body, payload: bytes(wire.MAC_BYTES))
    if mode == "none":
        wire.content_digest = lambda data: wire.NO_DIGEST


def one_mode(mode: str, nbytes: int, chunk_bytes: int, reps: int) -> dict:
    """Run in a process of its own: the chain's time per version in `mode` (seconds, median)."""
    import torch
    _disable(mode)
    from laminar.weights import seal, wire
    from laminar.weights.node import RelayNode
    from laminar.weights.publisher import WeightPublisher
    from laminar.weights.transport import get_transport
    key = wire.derive_key(b"bench-auth")
    signer = seal.Signer(os.urandom(32)) if mode == "full" else None
    verifier = signer.public if signer is not None else None
    shm = [f"/dev/shm/laminar-bench-auth-{uuid.uuid4().hex[:8]}-{i}" for i in range(2)]
    nodes = [RelayNode(f"r{i}", d, get_transport("tcp"), key, verifier=verifier) for i, d in enumerate(shm)]
    for n in nodes:
        n.start()
    nodes[0].set_downstream(nodes[1].address, "r1")
    pub = WeightPublisher(chunk_bytes=chunk_bytes, key=key, signer=signer)
    pub.run_id, pub.lineage = "bench", 1
    last = nodes[-1]
    try:
        pub.set_target(nodes[0].address, "r0")
        sd = {f"layer.{i}.weight": torch.randn(nbytes // 8 // 4) for i in range(8)}
        times, cpu = [], []
        for v in range(reps + 1):  # the first is untimed: buffers are allocated once, then reused
            t0, c0 = time.perf_counter(), time.process_time()
            pub.publish(sd, version=v)
            with last.store.cond:
                ok = last.store.cond.wait_for(lambda v=v: last.store.current is not None
                                              and last.store.current.version == v, 300)
            if not ok:
                raise RuntimeError(f"{mode}: v{v} did not reach the second relay")
            if v:
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
        out = {"seconds": statistics.median(times), "gbps": nbytes / statistics.median(times) / 1e9,
               "cpu_s_per_gb": statistics.median(cpu) / (nbytes / 1e9)}
        if mode == "full":
            out.update(crypto_costs(last, signer))
        return out
    finally:
        pub.close()
        for n in nodes:
            n.stop()
        for d in shm:
            shutil.rmtree(d, ignore_errors=True)


def crypto_costs(node, signer) -> dict:
    """Ed25519 sign/verify (µs) and a relay's seal check of its current version (ms): from the
    chunk digests it already holds, and from the bytes (a rollout's pull)."""
    from laminar.weights import seal, wire
    msg = os.urandom(200)
    t0 = time.perf_counter()
    for _ in range(200):
        sig = signer.sign(msg)
    sign_us = (time.perf_counter() - t0) / 200 * 1e6
    t0 = time.perf_counter()
    for _ in range(200):
        signer.public.verify(sig, msg)
    verify_us = (time.perf_counter() - t0) / 200 * 1e6
    vb = node.store.current
    m, md = vb.manifest, wire.manifest_digest(vb.manifest)
    t0 = time.perf_counter()
    assert seal.check(m, vb.seals, vb.view, signer.public, md, vb.known_digests()) == []
    known_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    assert seal.check(m, vb.seals, vb.view, signer.public, md) == []
    bytes_s = time.perf_counter() - t0
    return {"ed25519_sign_us": sign_us, "ed25519_verify_us": verify_us, "seal_check_known_ms": known_ms,
            "seal_check_from_bytes_s": bytes_s, "seal_check_from_bytes_gbps": m.total_bytes / bytes_s / 1e9}


def run(nbytes: int, chunk_bytes: int, reps: int = 5, rounds: int = 2) -> dict:
    """Every mode, each in a fresh process, `rounds` times in turn; medians and ratios."""
    got: dict[str, list[dict]] = {m: [] for m in MODES}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for _ in range(rounds):
        for mode in MODES:
            p = subprocess.run([sys.executable, __file__, "--child", mode, "--bytes", str(nbytes),
                                "--chunk-bytes", str(chunk_bytes), "--reps", str(reps)],
                               capture_output=True, text=True, env=env, timeout=1800)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
            if p.returncode != 0 or not lines:
                raise RuntimeError(f"mode {mode} failed (exit {p.returncode}): {p.stderr[-2000:]}")
            got[mode].append(json.loads(lines[-1]))
    out: dict = {"size_mib": nbytes // MiB, "chunk_mib": chunk_bytes / MiB, "reps": reps, "rounds": rounds,
                 "hops": 2}
    for mode in MODES:
        out[f"{mode}_s"] = statistics.median(r["seconds"] for r in got[mode])
        out[f"{mode}_gbps"] = nbytes / out[f"{mode}_s"] / 1e9
        out[f"{mode}_runs_s"] = [r["seconds"] for r in got[mode]]
        out[f"{mode}_cpu_s_per_gb"] = statistics.median(r["cpu_s_per_gb"] for r in got[mode])
    for k in ("ed25519_sign_us", "ed25519_verify_us", "seal_check_known_ms", "seal_check_from_bytes_s",
              "seal_check_from_bytes_gbps"):
        out[k] = statistics.median(r[k] for r in got["full"])
    out["full_over_none"] = out["full_gbps"] / out["none_gbps"]        # throughput ratios (< 1: slower)
    out["full_over_digests"] = out["full_gbps"] / out["digests_gbps"]
    out["digests_over_none"] = out["digests_gbps"] / out["none_gbps"]
    out["cpu_full_over_none"] = out["full_cpu_s_per_gb"] / out["none_cpu_s_per_gb"]  # CPU per byte (> 1: more)
    out["cpu_full_over_digests"] = out["full_cpu_s_per_gb"] / out["digests_cpu_s_per_gb"]
    out["load_average"] = os.getloadavg()[0]
    return out


def table_rows(res: dict) -> list[list]:
    return [[mode, res[f"{mode}_s"], res[f"{mode}_gbps"], res[f"{mode}_gbps"] / res["none_gbps"],
             res[f"{mode}_cpu_s_per_gb"], res[f"{mode}_cpu_s_per_gb"] / res["none_cpu_s_per_gb"]] for mode in MODES]


TABLE = ["mode", "seconds", "GB/s", "x none", "CPU s/GB", "CPU x none"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256, help="version size S (MiB)")
    p.add_argument("--chunk-mib", type=float, default=16, help="chunk size (MiB)")
    p.add_argument("--reps", type=int, default=5, help="timed versions per process")
    p.add_argument("--rounds", type=int, default=2, help="processes per mode (modes run in turn)")
    p.add_argument("--out", default=None, help="JSON output file")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    p.add_argument("--chunk-bytes", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(one_mode(a.child, a.bytes, a.chunk_bytes, a.reps)))
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import print_table, write_json
    res = run(a.mib * MiB, int(a.chunk_mib * MiB), a.reps, a.rounds)
    print_table(f"chunk links on loopback, publisher -> relay -> relay, S = {a.mib} MiB",
                TABLE, table_rows(res))
    print_table("costs", ["measure", "value"], [[k, res[k]] for k in (
        "full_over_none", "full_over_digests", "digests_over_none", "cpu_full_over_none", "cpu_full_over_digests",
        "ed25519_sign_us", "ed25519_verify_us", "seal_check_known_ms", "seal_check_from_bytes_gbps",
        "load_average")])
    write_json(a.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
