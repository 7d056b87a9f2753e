"""Throughput of the weight chunk MAC (laminar/weights/wire.py chunk_mac: keyed BLAKE3) next to the
xxh3 checksum, on one thread, over chunks of the default size (16 MiB).

    python bench/weights_mac.py [--chunk-mib 16] [--chunks 16] [--repeat 5]

Prints MiB/s of each, the best of `--repeat` passes over `--chunks` chunks. A relay computes one
MAC per chunk it receives (and forwards the verified one without computing it again); a rollout
computes one per chunk of every version it loads.
"""
from __future__ import annotations

import argparse
import os
import time

from laminar.weights import wire
from laminar.weights.manifest import checksum


def rate(fn, chunk: bytes, chunks: int, repeat: int) -> float:
    best = 0.0
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(chunks):
            fn(chunk)
        best = max(best, chunks * len(chunk) / (1 << 20) / (time.perf_counter() - t))
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunk-mib", type=int, default=16)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    chunk = os.urandom(a.chunk_mib << 20)
    key, digest = wire.mac_key(wire.derive_key(os.urandom(32))), os.urandom(32)
    mac = rate(lambda b: wire.chunk_mac(key, digest, 0, b), chunk, a.chunks, a.repeat)
    print(f"chunk_mac (keyed BLAKE3): {mac:.0f} MiB/s;  xxh3: {rate(checksum, chunk, a.chunks, a.repeat):.0f} MiB/s  "
          f"({a.chunk_mib} MiB chunks, one thread, best of {a.repeat}; load average {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
