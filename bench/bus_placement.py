"""Where the bus's request/reply tail comes from: the RPC phase of bench/bus.py (its typed client
and echo server, and the raw DEALER/ROUTER pair beside them, scoped keys) with the two processes,
and so their ZeroMQ I/O threads, placed by sched_setaffinity: as the scheduler likes (`free`, how
bench/bus.py runs), client and server on different cores (`split`), or both on one core (`one`).
Each placement's p50 and p99 of sequential calls; a pipe ping-pong beside them for the machine's
own wake-up latency. Prints a table, writes JSON (docs/benchmarks.md, "The bus's request/reply
path").

    python bench/bus_placement.py [--calls 2000] [--rounds 2] [--out F]

Needs two cores or more (it places on cores 0 and 1).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table, write_json  # noqa: E402

import bus  # noqa: E402

PLACEMENTS = {"free": (None, None), "split": ({0}, {1}), "one": ({0}, {0})}  # client cores, server cores


def one_run(keys_dir: str, raw: bool, placement: str, calls: int) -> dict:
    """bench/bus.py's RPC phases with the two sides placed as named: p50 and p99 in ms."""
    out = bus.rpc(raw, keys_dir, calls, 16, cores=PLACEMENTS[placement])
    return {"p50_ms": out["p50_ms"], "p99_ms": out["p99_ms"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000, help="sequential calls a run (default 2000, as --quick)")
    ap.add_argument("--rounds", type=int, default=2, help="times every placement runs (default 2)")
    ap.add_argument("--out", help="write JSON here")
    a = ap.parse_args()
    if not {0, 1} <= os.sched_getaffinity(0):
        print("needs cores 0 and 1", file=sys.stderr)
        return 2
    keys_dir = bus.make_keys(True)
    runs: dict[str, list[dict]] = {}
    for r in range(a.rounds):
        for raw in (False, True):
            for placement in PLACEMENTS:
                key = f"{'raw' if raw else 'typed'}_{placement}"
                runs.setdefault(key, []).append(one_run(keys_dir, raw, placement, a.calls))
                print(f"round {r + 1}: {key:12s} p50 {runs[key][-1]['p50_ms']:.3f} ms, "
                      f"p99 {runs[key][-1]['p99_ms']:.3f} ms", flush=True)
        runs.setdefault("pingpong", []).append(bus.pingpong(a.calls))
    fmt = lambda key, q: ", ".join(f"{x[q]:.2f}" for x in runs[key])  # noqa: E731
    print_table(f"request/reply by placement ({a.calls} sequential calls, {a.rounds} rounds; ms)",
                ["placement", "typed p50", "typed p99", "raw p50", "raw p99"],
                [[pl, fmt(f"typed_{pl}", "p50_ms"), fmt(f"typed_{pl}", "p99_ms"), fmt(f"raw_{pl}", "p50_ms"),
                  fmt(f"raw_{pl}", "p99_ms")] for pl in PLACEMENTS])
    print(f"pipe ping-pong p99: {fmt('pingpong', 'p99_ms')} ms")
    res = {"calls": a.calls, "rounds": a.rounds, "runs": runs,
           **{f"{k}_p99_ms": statistics.median(x["p99_ms"] for x in v) for k, v in runs.items()}}
    write_json(a.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
