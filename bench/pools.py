"""Data-pool benchmark: acknowledged (durable) writes through the real pool processes, next to
SQLite inserting the same rows directly in this process (same synchronous=FULL WAL settings).

    python bench/pools.py [--quick] [--out FILE]

- partial pool: AppendDeltas batches of `--batch` deltas (one per trajectory, like a rollout's
  flush), `--callers` rollouts at once; deltas/s acknowledged, against the rate 1,024 concurrent
  trajectories streaming every 0.5 s need (2,048 deltas/s);
- experience buffer: PutTrajectory (128-token responses) acknowledged/s, then SampleGroups
  samples/s (trajectories handed out per second);
- direct: the same delta rows inserted by one SQLite connection, one transaction per row and
  batched 64 rows per transaction.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import free_port, print_table, write_json  # noqa: E402

REQUIRED = 1024 / 0.5
TOK = 8  # tokens per delta: ~0.5 s of decode at ~16 tokens/s per trajectory


def make_cluster(tmp: Path) -> tuple[Path, dict]:
    from laminar.bus.auth import generate_keys
    generate_keys(tmp / "keys")
    (tmp / "d.jsonl").write_text(json.dumps({"prompt": "x", "answer": "1"}) + "\n")
    ports = {r: free_port() for r in ("partial_pool", "experience_buffer")}
    cfg = {"run": {"workdir": str(tmp / "run")},
           "cluster": {"keys_dir": str(tmp / "keys"), "broker": {"host": "h0", "pub_port": free_port(),
                                                                 "sub_port": free_port()},
                       "hosts": {"h0": {"address": "127.0.0.1", "bind": "127.0.0.1",
                                        "roles": [{"role": r, "port": p} for r, p in ports.items()]}}},
           "roles": {"experience_buffer": {"capacity": 1_000_000}}}
    (tmp / "c.yaml").write_text(yaml.safe_dump(cfg))
    return tmp / "c.yaml", ports


def spec(tid: str, gid: str, i: int, n: int):
    from laminar.protocol import TrajectorySpec
    return TrajectorySpec(trajectory_id=tid, prompt_id=gid, group_id=gid, sample_index=i, group_size=n,
                          prompt_tokens=np.arange(64, dtype=np.int32))


async def bench_deltas(client, seconds: float, batch: int, callers: int) -> float:
    from laminar.protocol import AppendDeltas, TokenDelta
    toks, lps = np.arange(TOK, dtype=np.int32), np.zeros(TOK, np.float32)
    done = 0
    stop = time.perf_counter() + seconds

    async def caller(c: int) -> None:
        nonlocal done
        seq = 0
        specs = [spec(f"c{c}t{t}", f"c{c}t{t}", 0, 1) for t in range(batch)]
        while time.perf_counter() < stop:
            ds = [TokenDelta(s.trajectory_id, seq, toks, lps, 0, s if seq == 0 else None) for s in specs]
            await client.call(AppendDeltas(f"r{c}", ds), timeout=30)
            done += batch
            seq += 1
    t0 = time.perf_counter()
    await asyncio.gather(*(caller(c) for c in range(callers)))
    return done / (time.perf_counter() - t0)


async def bench_buffer(client, n: int, group: int, callers: int) -> tuple[float, float]:
    from laminar.protocol import PutTrajectory, SampleGroups, Trajectory
    resp, lps = np.arange(128, dtype=np.int32), np.zeros(128, np.float32)
    it = iter(range(n))

    async def caller() -> None:
        for i in it:
            s = spec(f"g{i // group}/{i % group}", f"g{i // group}", i % group, group)
            await client.call(PutTrajectory(Trajectory(s, resp, lps, 0, "r", 1.0)), timeout=30)
    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(callers)))
    put_rate = n / (time.perf_counter() - t0)
    got, t0 = 0, time.perf_counter()
    while got < n:
        s = await client.call(SampleGroups(32, 1), timeout=30)
        if not s.groups:
            break
        got += sum(len(g) for g in s.groups)
    return put_rate, got / (time.perf_counter() - t0)


def direct_sqlite(path: Path, rows: int, per_txn: int) -> float:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("CREATE TABLE d (tid TEXT, seq INTEGER, owner TEXT, version INTEGER, spec BLOB, tokens BLOB, "
                 "logprobs BLOB, PRIMARY KEY (tid, seq))")
    toks, lps = np.arange(TOK, dtype=np.int32).tobytes(), np.zeros(TOK, np.float32).tobytes()
    t0 = time.perf_counter()
    for start in range(0, rows, per_txn):
        conn.execute("BEGIN")
        for i in range(start, min(rows, start + per_txn)):
            conn.execute("INSERT INTO d VALUES (?, ?, 'r', 0, NULL, ?, ?)", (f"t{i % 1024}", i // 1024, toks, lps))
        conn.execute("COMMIT")
    conn.close()
    return rows / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short phases (well under 60 s)")
    ap.add_argument("--out", default=None, help="write JSON results here")
    ap.add_argument("--batch", type=int, default=64, help="deltas per AppendDeltas call")
    ap.add_argument("--callers", type=int, default=8, help="concurrent rollouts calling")
    a = ap.parse_args()
    secs, n_traj = (4.0, 2000) if a.quick else (15.0, 10000)
    from laminar.bus.auth import load_keys
    from laminar.bus.zmq_transport import ZmqTransport
    from laminar.testing.procs import RoleProc
    tmp = Path(tempfile.mkdtemp(prefix="laminar-bench-pools-"))
    cfg, ports = make_cluster(tmp)
    procs = [RoleProc(r, "0", cfg, tmp).start() for r in ports]
    for p in procs:
        p.wait_ready(60)

    async def run() -> tuple[float, float, float]:
        t = ZmqTransport("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", load_keys(tmp / "keys"))
        deltas = await bench_deltas(t.client(f"tcp://127.0.0.1:{ports['partial_pool']}"), secs, a.batch, a.callers)
        puts, samples = await bench_buffer(t.client(f"tcp://127.0.0.1:{ports['experience_buffer']}"),
                                           n_traj, 16, a.callers)
        await t.close()
        return deltas, puts, samples
    try:
        deltas, puts, samples = asyncio.run(run())
    finally:
        for p in procs:
            p.stop()
    rows = int(deltas * min(secs, 4.0))
    direct_1 = direct_sqlite(tmp / "direct1.sqlite", min(rows, 3000), 1)
    direct_64 = direct_sqlite(tmp / "direct64.sqlite", rows, 64)
    print_table("data pools, durability on (WAL, synchronous=FULL), acknowledged writes",
                ["measure", "per second", "note"],
                [["partial pool: token deltas", deltas, f"{a.callers} callers x {a.batch} deltas/call, {TOK} tokens each"],
                 ["  required by 1,024 trajectories / 0.5 s", REQUIRED, f"headroom {deltas / REQUIRED:.1f}x"],
                 ["experience buffer: trajectory puts", puts, "128-token responses, groups of 16"],
                 ["experience buffer: samples out", samples, "SampleGroups(32 groups)"],
                 ["direct SQLite, 1 row per commit", direct_1, "same rows, this process"],
                 ["direct SQLite, 64 rows per commit", direct_64, "same rows, this process"]])
    write_json(a.out, {"quick": a.quick, "deltas_per_s": deltas, "required_deltas_per_s": REQUIRED,
                       "trajectory_writes_per_s": puts, "samples_per_s": samples,
                       "sqlite_direct_rows_per_s": direct_64, "sqlite_direct_rows_per_s_1_per_commit": direct_1,
                       "deltas_over_required": deltas / REQUIRED})
    return 0


if __name__ == "__main__":
    sys.exit(main())
