"""Throughput of the weight chunk digest (laminar/weights/wire.py content_digest: BLAKE3) next to the
xxh3 checksum, on one thread, over chunks of the default size (16 MiB).

    python bench/weights_mac.py [--chunk-mib 16] [--chunks 16] [--repeat 5]

Prints MiB/s of each, the best of `--repeat` passes over `--chunks` chunks. A relay computes one
digest per chunk it receives (and forwards the verified one without computing it again); a rollout
computes one per piece of every version it loads (its seal check).
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
    digest = rate(wire.content_digest, chunk, a.chunks, a.repeat)
    print(f"content_digest (BLAKE3): {digest:.0f} MiB/s;  xxh3: {rate(checksum, chunk, a.chunks, a.repeat):.0f} MiB/s  "
          f"({a.chunk_mib} MiB chunks, one thread, best of {a.repeat}; load average {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
