"""Data-pool benchmark: acknowledged (durable) writes through the real pool processes, next to
SQLite inserting the same rows directly in this process (same synchronous=FULL WAL settings).

    python bench/pools.py [--quick] [--out FILE]

- partial pool: one columnar AppendDeltaBatch of `--flush` deltas per call (a rollout's whole
  flush, one delta per trajectory), `--callers` rollouts at once: deltas/s acknowledged
  (`deltas_per_s`, the median of `--windows` timed windows, with their spread), against the
  paper's largest fleets (64 replicas x 1,024 trajectories streaming every 0.5 s: 131,072
  deltas/s) and one replica's 2,048; next to it the same through AppendDeltas, one event per
  delta, `--batch` per call (how rollouts sent them before). Every check a cluster runs with is
  on: scoped keys (each caller is rollout r<c> with its own key), every trajectory created by a
  seq 0 whose spec carries the prompt pool's hand-out for that rollout, ownership and epoch of
  every later delta, lineage named on every delta, durable (fsynced) before the acknowledgement.
  `pool_cpu_us_per_delta`: the pool process's CPU time (user + system) over the timed windows per
  delta acknowledged, a count of work that a loaded machine moves far less than a rate;
- experience buffer: PutTrajectory (128-token responses) acknowledged/s, then SampleGroups
  samples/s (trajectories handed out per second);
- direct: the same delta rows inserted by one SQLite connection, one transaction per row and
  batched 64 rows per transaction;
- start-up: each pool process restarted on the store a run of `--startup-trajectories` (1M)
  synthetic trajectories leaves (groups of 8; 1,024 in flight), as the bounded memory keeps it
  (the newest 200k ids remembered) and as an unbounded one would (every id replayed).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import free_port, print_table, write_json  # noqa: E402

REQUIRED = 1024 / 0.5
PAPER_SCALE = 131_072  # 64 replicas x 1,024 trajectories in flight, a delta each every 0.5 s
TOK = 8  # tokens per delta: ~0.5 s of decode at ~16 tokens/s per trajectory


def make_cluster(tmp: Path, callers: int = 0) -> tuple[Path, dict]:
    """A config for the two pools; with `callers`, scoped keys: one per scope and rollout.r<c>."""
    from laminar.bus.auth import SCOPES, generate_client_key, generate_keys
    generate_keys(tmp / "keys")
    for identity in (list(SCOPES) + [f"rollout.r{c}" for c in range(callers)]) if callers else []:
        generate_client_key(tmp / "keys", identity)
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


def handed_out(cfg_path: Path, specs: list, rollout: str) -> list:
    """The specs as the prompt pool hands them to `rollout`: signed with the pools' hand-out key."""
    from laminar.roles.handout import Handouts  # the benches import the project when they run

    from laminar.config import load_config
    from laminar.handout_key import handout_key
    h = Handouts(handout_key(load_config(str(cfg_path))))
    return [h.sign(s, rollout) for s in specs]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used so far."""
    f = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


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


async def bench_columnar(clients: list, cfg_path: Path, seconds: float, windows: int, flush: int,
                         pid: int) -> tuple[list[float], float]:
    """Each client is rollout r<c> (its own key), flushing one delta for each of its `flush`
    trajectories per call, the first call creating them (seq 0, signed hand-outs). Untimed until
    every trajectory exists, then `windows` timed windows of `seconds`: (deltas/s of each window,
    the pool's CPU microseconds per delta over all of them)."""
    from laminar.protocol import AppendDeltaBatch
    toks, lps = np.arange(TOK, dtype=np.int32), np.zeros(TOK, np.float32)
    tokens, logprobs = np.tile(toks, flush), np.tile(lps, flush)
    offsets, versions = np.arange(flush + 1, dtype=np.int64) * TOK, np.zeros(flush, np.int64)
    lineages = np.ones(flush, np.int64)
    done, stop, created = 0, 0.0, asyncio.Event()
    made = [0]

    async def caller(c: int) -> None:
        nonlocal done
        specs = handed_out(cfg_path, [spec(f"e0-p{c}_{t}/0", f"e0-p{c}_{t}", 0, 1) for t in range(flush)], f"r{c}")
        ids = [s.trajectory_id for s in specs]
        seq = 0
        while seq == 0 or time.perf_counter() < stop:
            req = AppendDeltaBatch(f"r{c}", ids, np.full(flush, seq, np.int64), versions, offsets, tokens, logprobs,
                                   specs if seq == 0 else [], lineages=lineages)
            res = await clients[c].call(req, timeout=60)
            assert res.applied == flush, res
            if seq == 0:
                made[0] += 1
                if made[0] == len(clients):
                    created.set()
                await created.wait()  # the timed windows start with every trajectory in flight
            else:
                done += flush
            seq += 1

    rates, cpu = [], 0.0
    stop = float("inf")
    tasks = [asyncio.ensure_future(caller(c)) for c in range(len(clients))]
    await created.wait()
    for _ in range(windows):
        d0, c0, t0 = done, cpu_s(pid), time.perf_counter()
        await asyncio.sleep(seconds)  # the timed window: the callers run meanwhile
        rates.append((done - d0) / (time.perf_counter() - t0))
        cpu += (cpu_s(pid) - c0) / max(1, done - d0)
    stop = 0.0
    await asyncio.gather(*tasks)
    return rates, 1e6 * cpu / windows


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


def synthesize(tmp: Path, cfg: Path, trajectories: int, group: int = 8, in_flight: int = 1024) -> None:
    """Fill the partial pool's and the buffer's stores (made by a first start) with what a run of
    `trajectories` leaves: every trajectory completed (partial pool) and every group handed out
    (buffer), plus `in_flight` trajectories streaming, 20 deltas each."""
    pools = tmp / "run" / "pools"
    with sqlite3.connect(pools / "partial_pool-0.sqlite") as c:
        c.executemany("INSERT OR IGNORE INTO completed VALUES (?)", ((f"s{i}",) for i in range(trajectories)))
        from laminar.roles.sqlite_store import pack
        toks, lps = np.arange(TOK, dtype=np.int32).tobytes(), np.zeros(TOK, np.float32).tobytes()
        c.executemany(
            "INSERT INTO deltas (tid, seq, owner, version, spec, tokens, logprobs) VALUES (?, ?, 'r', 0, ?, ?, ?)",
            (
                (f"f{t}", q, pack(spec(f"f{t}", f"f{t // group}", t % group, group)) if q == 0 else None, toks, lps)
                for t in range(in_flight)
                for q in range(20)
            ),
        )
    with sqlite3.connect(pools / "experience_buffer-0.sqlite") as c:
        c.executemany(
            "INSERT OR IGNORE INTO gone VALUES (?, 'handed')", ((f"sg{g}",) for g in range(trajectories // group))
        )


def startup_times(tmp: Path, cfg_path: Path, unbounded: bool) -> dict[str, float]:
    """Seconds from process start to READY of each pool on its synthesized store."""
    import yaml as _yaml

    from laminar.testing.procs import RoleProc
    if unbounded:
        c = _yaml.safe_load(cfg_path.read_text())
        c["roles"]["partial_pool"] = {"remember_completed": 1 << 40}
        c["roles"]["experience_buffer"] = {**c["roles"]["experience_buffer"], "remember_removed": 1 << 40}
        cfg_path = cfg_path.with_name("unbounded.yaml")
        cfg_path.write_text(_yaml.safe_dump(c))
    out = {}
    for role in ("partial_pool", "experience_buffer"):
        t0 = time.perf_counter()
        p = RoleProc(role, "0", cfg_path, tmp).start()
        try:
            p.wait_ready(600)
            out[role] = time.perf_counter() - t0
        finally:
            p.stop()
    return out


CHECKS = "scoped keys (rollout.r<c>), hand-outs on seq 0, ownership and epoch, lineage, fsync before ack"


def spread(xs: list[float]) -> float:
    """(max - min) / median of repeated measurements (0 for fewer than two)."""
    return (max(xs) - min(xs)) / statistics.median(xs) if len(xs) > 1 and statistics.median(xs) else 0.0


def deltas_only(a, windows: int) -> int:
    """The columnar phase alone, on a partial pool of its own (bench/hot_paths.py)."""
    from laminar.bus.auth import load_keys
    from laminar.bus.zmq_transport import ZmqTransport

    from laminar.testing.procs import RoleProc
    tmp = Path(tempfile.mkdtemp(prefix="laminar-bench-pools-"))
    cfg, ports = make_cluster(tmp, a.callers)
    proc = RoleProc("partial_pool", "0", cfg, tmp).start()
    try:
        proc.wait_ready(60)

        async def run() -> tuple[list[float], float]:
            rollouts = [ZmqTransport("tcp://127.0.0.1:1", "tcp://127.0.0.1:2",
                                     load_keys(tmp / "keys", "rollout", f"r{c}")) for c in range(a.callers)]
            try:
                return await bench_columnar([t.client(f"tcp://127.0.0.1:{ports['partial_pool']}") for t in rollouts],
                                            cfg, 2.0 if a.quick else 4.0, windows, a.flush, proc.proc.pid)
            finally:
                for t in rollouts:
                    await t.close()
        runs, cpu = asyncio.run(run())
    finally:
        proc.stop()
    out = {"quick": a.quick, "deltas_per_s": statistics.median(runs), "deltas_per_s_runs": runs,
           "deltas_per_s_spread": spread(runs), "pool_cpu_us_per_delta": cpu, "checks": CHECKS,
           "paper_scale_required_deltas_per_s": PAPER_SCALE}
    print_table("partial pool, acknowledged deltas (columnar, every check on)", ["measure", "value"],
                [[k, v] for k, v in out.items() if k != "deltas_per_s_runs"])
    write_json(a.out, out)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short phases (well under 60 s)")
    ap.add_argument("--out", default=None, help="write JSON results here")
    ap.add_argument("--batch", type=int, default=64, help="deltas per AppendDeltas call")
    ap.add_argument("--callers", type=int, default=8, help="concurrent rollouts calling")
    ap.add_argument("--flush", type=int, default=1024, help="deltas per AppendDeltaBatch call (a rollout's flush)")
    ap.add_argument("--windows", type=int, default=None, help="timed windows of the columnar phase (default 5, "
                    "quick 3): the median and spread are reported")
    ap.add_argument("--deltas-only", action="store_true", help="only the columnar delta phase (what "
                    "bench/hot_paths.py runs)")
    ap.add_argument("--startup-trajectories", type=int, default=1_000_000,
                    help="synthetic run length for the start-up measure (0: skip it)")
    a = ap.parse_args()
    secs, n_traj = (4.0, 2000) if a.quick else (15.0, 10000)
    windows = a.windows or (3 if a.quick else 5)
    if a.deltas_only:
        return deltas_only(a, windows)
    from laminar.bus.auth import load_keys
    from laminar.bus.zmq_transport import ZmqTransport

    from laminar.testing.procs import RoleProc
    tmp = Path(tempfile.mkdtemp(prefix="laminar-bench-pools-"))
    cfg, ports = make_cluster(tmp, a.callers)
    procs = [RoleProc(r, "0", cfg, tmp).start() for r in ports]
    for p in procs:
        p.wait_ready(60)

    async def run() -> tuple[list[float], float, float, float, float]:
        keys = tmp / "keys"
        rollouts = [ZmqTransport("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", load_keys(keys, "rollout", f"r{c}"))
                    for c in range(a.callers)]
        pool = f"tcp://127.0.0.1:{ports['partial_pool']}"
        columnar, cpu = await bench_columnar([t.client(pool) for t in rollouts], cfg, secs / windows * 2, windows,
                                             a.flush, procs[0].proc.pid)
        t = ZmqTransport("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", load_keys(keys, "operator"))
        per_event = await bench_deltas(t.client(pool), secs, a.batch, a.callers)
        puts, samples = await bench_buffer(t.client(f"tcp://127.0.0.1:{ports['experience_buffer']}"),
                                           n_traj, 16, a.callers)
        for x in [t, *rollouts]:
            await x.close()
        return columnar, cpu, per_event, puts, samples
    try:
        runs, cpu_per_delta, per_event, puts, samples = asyncio.run(run())
    finally:
        for p in procs:
            p.stop()
    deltas = statistics.median(runs)
    startup: dict[str, dict[str, float]] = {}
    if a.startup_trajectories:  # a cluster of its own: the throughput phases' stores stay out of it
        stmp = tmp / "startup"
        stmp.mkdir()
        scfg, _ = make_cluster(stmp)
        startup_times(stmp, scfg, unbounded=False)                         # makes the empty stores
        synthesize(stmp, scfg, a.startup_trajectories)
        startup["unbounded"] = startup_times(stmp, scfg, unbounded=True)   # replays every id (as before the bound)
        startup["bounded"] = startup_times(stmp, scfg, unbounded=False)    # forgets down to the newest 200k, once
        startup["bounded_again"] = startup_times(stmp, scfg, unbounded=False)  # what every later start costs
    rows = int(per_event * min(secs, 4.0))
    direct_1 = direct_sqlite(tmp / "direct1.sqlite", min(rows, 3000), 1)
    direct_64 = direct_sqlite(tmp / "direct64.sqlite", rows, 64)
    print_table(
        "data pools, durability on (WAL, synchronous=FULL), acknowledged writes",
        ["measure", "per second", "note"],
        [
            [
                "partial pool: token deltas (columnar)",
                deltas,
                f"{a.callers} rollout keys x {a.flush} deltas/AppendDeltaBatch, {TOK} tokens each; median of "
                f"{len(runs)} windows, spread {spread(runs):.0%}; {cpu_per_delta:.2f} us CPU/delta in the pool",
            ],
            ["  required at paper scale (64 x 1,024 / 0.5 s)", PAPER_SCALE, f"headroom {deltas / PAPER_SCALE:.2f}x"],
            ["  required by 1,024 trajectories / 0.5 s", REQUIRED, f"headroom {deltas / REQUIRED:.1f}x"],
            [
                "partial pool: token deltas (one event each)",
                per_event,
                f"{a.callers} callers x {a.batch} deltas/AppendDeltas",
            ],
            ["experience buffer: trajectory puts", puts, "128-token responses, groups of 16"],
            ["experience buffer: samples out", samples, "SampleGroups(32 groups)"],
            ["direct SQLite, 1 row per commit", direct_1, "same rows, this process"],
            ["direct SQLite, 64 rows per commit", direct_64, "same rows, this process"],
        ],
    )
    if startup:
        print_table(f"pool start-up (s) on the store of {a.startup_trajectories:,} synthetic trajectories",
                    ["pool", "bounded memory", "same, later starts", "unbounded replay"],
                    [[r, startup["bounded"][r], startup["bounded_again"][r], startup["unbounded"][r]]
                     for r in ("partial_pool", "experience_buffer")])
    write_json(a.out, {"quick": a.quick, "deltas_per_s": deltas, "deltas_per_s_runs": runs,
                       "deltas_per_s_spread": spread(runs), "pool_cpu_us_per_delta": cpu_per_delta,
                       "checks": CHECKS, "paper_scale_required_deltas_per_s": PAPER_SCALE,
                       "deltas_over_paper_scale": deltas / PAPER_SCALE, "deltas_per_s_one_event_each": per_event,
                       "flush_deltas_per_call": a.flush, "startup_s": startup,
                       "startup_trajectories": a.startup_trajectories, "required_deltas_per_s": REQUIRED,
                       "trajectory_writes_per_s": puts, "samples_per_s": samples,
                       "sqlite_direct_rows_per_s": direct_64, "sqlite_direct_rows_per_s_1_per_commit": direct_1,
                       "deltas_over_required": deltas / REQUIRED})
    return 0


if __name__ == "__main__":
    sys.exit(main())
