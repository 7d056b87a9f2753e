"""Rollout benchmark on this machine's vLLM CPU engine (tiny model unless --model-dir).

    python bench/rollout.py [--quick] [--out FILE] [--rounds R] [--ratio-only] [--trajectories N] [--max-tokens M]

1. the role against the bare engine, same work: one warm-up pass, then R rounds on one warm
   engine. In each round the rollout role (prompt pool -> generation -> token deltas streamed to
   the partial pool every 0.25 s -> scoring -> experience buffer, stats every second; an
   in-process cluster with scoped identities, so hand-outs, ownership and lineage are checked as
   in a cluster) runs one batch of N trajectories of up to M tokens, and the same trajectories
   (same prompts, same per-trajectory seeds, so the same tokens) run again straight through the
   same engine, all at once. N and M are sized so that each pass lasts ~6-10 s on a quiet 2-core
   machine (--trajectories, --max-tokens): passes of under a second let one scheduling hiccup or
   one full garbage collection move a round's ratio by 20-50%, which is what the first version of
   this bench measured. The role's time is one whole cycle of its batch loop: from the TakeBatch
   reply to its next TakeBatch, plus that request's own round trip; the bench holds the loop at
   the prompt pool's door between rounds (a gate on the role's client), so nothing else runs while
   either side is timed (a loop with early intake asks once nothing generates: its last stores,
   which a run overlaps with the next batch, then end untimed before the engine's pass starts).
   The order alternates (role first in even rounds, engine first in odd ones: the gate hands the
   batch's specs to the bench before the role starts them), so a load that drifts during the run
   reaches both sides alike; an untimed second (SETTLE_S) before each pass keeps one side's
   leftovers out of the other's window. Each round gives one ratio (role tokens/s over engine tokens/s, the
   same tokens); `role_over_engine` is the median of the R rounds' ratios, its spread
   (max - min) / median and its IQR / median say how far apart two runs may land (to tell 0.9
   from 1.0 the spread must be well under 0.1); `role_over_engine_ci95` is the distribution-free 95%
   interval of that median (order statistics: `median_ci`). Each pass also records this process's CPU per
   token and the seconds it spent in full garbage collections (`gc_s`);
2. migration: MigrateOut on one rollout + MigrateIn on another, timed until every moved
   trajectory has produced a new token on the destination; for 1 and for N trajectories;
3. weight load: a new version written into the host's shared-memory store, loaded in place
   (engine.load_relay) into the warm engine; then per model size (Qwen2 shapes of ~0.4M to
   ~100M parameters, one fresh engine each: median of 3 loads) -> seconds and GB/s.
--ratio-only: phase 1 alone (what bench/hot_paths.py runs).
"""
from __future__ import annotations

import argparse
import asyncio
import faulthandler
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import GcClock, cpu_split, exit_on_signals, free_port, median_ci, print_table, spread_of, write_json  # noqa: E402

SEED = 11
# timed rounds of role/engine pairs (after one warm-up pass). The rounds scatter with the machine's
# own speed (IQR ÷ median 0.11-0.16 here), so the median's 95% interval is narrower than 0.1 (it
# tells 0.9 from 1.0) only after ~30 rounds: the full run takes 31 (docs/benchmarks.md)
ROUNDS, ROUNDS_QUICK = 31, 7
# trajectories per batch and max tokens each. Measured on a quiet 2-core machine, a pass of 384 took
# 17-57 s (the engine's own pace varied 3x from pass to pass), so both take 192 (a pass of 6-20 s):
# --quick's 15 passes fit ~4 minutes, the full run's 63 ~10-18
BATCH, BATCH_QUICK, MAX_TOKENS = 192, 192, 640
MIGRATE_N = 100
# untimed pause before each pass, so what the last one left running (the pools' writes of the
# role's last stores, which end after its loop asks again) does not land in the next one's window
SETTLE_S = 1.0


def prompts(n: int) -> list[str]:
    return [f"{i:03d} say something long" for i in range(n)]


def cluster_cfg(tmp: Path, model_dir: str, n: int, max_tokens: int, shm: Path):
    """Prompt pool 0 hands rollout 0 batches of N single-trajectory groups, for ever; prompt
    pool 1 gives rollout 1 one trajectory of its own (then room for migrants)."""
    from laminar.config import parse_config
    data = tmp / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": "x"}) + "\n" for p in prompts(n)))
    one = tmp / "one.jsonl"  # rollout 1 gets one trajectory of its own, then has room for migrants
    one.write_text(json.dumps({"prompt": "hi", "answer": "x"}) + "\n")
    roles = [
        {"role": "prompt_pool", "port": free_port()},
        {"role": "prompt_pool", "id": "1", "port": free_port(), "options": {"dataset": str(one), "max_epochs": 1}},
        {"role": "partial_pool", "port": free_port()},
        {"role": "experience_buffer", "port": free_port()},
        {"role": "rollout", "id": "0", "port": free_port()},
        {"role": "rollout", "id": "1", "port": free_port(), "options": {"max_concurrency": 2 * n, "prompt_pool": "1"}},
    ]
    return parse_config(
        {
            "run": {"workdir": str(tmp / "run")},
            "cluster": {
                "keys_dir": None,
                "shutdown_s": 30,
                "broker": {"host": "h0"},
                "hosts": {"h0": {"address": "127.0.0.1", "roles": roles}},
            },
            "roles": {
                "prompt_pool": {
                    "dataset": str(data),
                    "group_size": 1,
                    "max_tokens": max_tokens,
                },
                "rollout": {
                    "model_dir": model_dir,
                    "max_concurrency": n,
                    "max_model_len": max_tokens + 64,
                    "seed": SEED,
                    "shm_dir": str(shm),
                    "stop_when_exhausted": False,
                    "reward": "laminar.tasks.rewards:zero",
                },
            },
        }
    )


class Gate:
    """Stands in front of a rollout's prompt-pool client: each TakeBatch is fetched at once (its
    round trip timed), then held until the bench lets it through, so the role's batch loop waits
    between rounds and the bench sees each batch's specs before the role starts them."""

    def __init__(self, client):
        self.client = client
        self.arrived = asyncio.Event()  # a TakeBatch was fetched and waits to be let through
        self.go = asyncio.Event()
        self.open = False               # let everything through (after the rounds)
        self.reply, self.fetch_s, self.asked_at = None, 0.0, 0.0

    async def call(self, req, timeout: float = 5.0):
        self.asked_at = time.perf_counter()  # the loop finished its batch and asks for the next
        reply = await self.client.call(req, timeout=timeout)
        self.fetch_s = time.perf_counter() - self.asked_at
        if self.open:
            return reply
        self.reply = reply
        self.arrived.set()
        await self.go.wait()
        self.go.clear()
        return reply

    def release(self) -> None:
        self.arrived.clear()
        self.go.set()


async def engine_pass(eng, specs, tag: str) -> tuple[int, float]:
    """The specs' trajectories straight through the engine, all at once, with the seeds the role
    gives them: (tokens, seconds)."""
    async def one(spec) -> int:
        count = 0
        async for toks, _, _ in eng.generate(f"{spec.trajectory_id}#{tag}", [int(t) for t in spec.prompt_tokens],
                                             spec.max_tokens, zlib.crc32(f"{SEED}:{spec.trajectory_id}".encode())):
            count += len(toks)
        return count
    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(x) for x in specs))
    return sum(counts), time.perf_counter() - t0


async def role_pass(r0, gate: Gate) -> tuple[int, float]:
    """Let the held batch through and time the loop's whole cycle until it asks for the next one:
    (tokens generated, seconds, the held TakeBatch's round trip included)."""
    fetch, g0 = gate.fetch_s, r0.work.generated
    t0 = time.perf_counter()
    gate.release()
    await gate.arrived.wait()
    tokens, secs = r0.work.generated - g0, gate.asked_at - t0 + fetch
    while r0.active:  # untimed: the batch's last stores end before the engine's pass starts
        await asyncio.sleep(0.005)  # watching the role's own state
    return tokens, secs


GC = GcClock()


async def timed(coro) -> tuple[int, float, float, float, float]:
    """(tokens, seconds, CPU seconds here, CPU seconds in the engine's processes, seconds of full
    garbage collections here) of a pass."""
    h0, k0 = cpu_split()  # this process (the role, the pools, vLLM's client side); the engine's
    g0 = GC.total
    tokens, secs = await coro
    h1, k1 = cpu_split()
    return tokens, secs, h1 - h0, k1 - k0, GC.total - g0


def round_row(k: int, role: tuple, eng: tuple) -> dict:
    return {"role_tokens": role[0], "role_s": role[1], "engine_tokens": eng[0], "engine_s": eng[1],
            "role_first": k % 2 == 0, "ratio": (role[0] / role[1]) / (eng[0] / eng[1]),
            "role_cpu_us_per_token": {"here": 1e6 * role[2] / role[0], "engine": 1e6 * role[3] / role[0]},
            "engine_cpu_us_per_token": {"here": 1e6 * eng[2] / eng[0], "engine": 1e6 * eng[3] / eng[0]},
            "gc_s": {"role": role[4], "engine": eng[4]}}


def watchdog() -> None:
    """(Re)arm the hang guard: every thread's stack dumped and an exit once BENCH_HANG_S (default
    900) seconds pass without progress — counted from the start, then from each round's start. (It
    was armed once for the whole run: the default 31 rounds take 10–25 minutes with the machine's
    state, and a slow run was killed mid-way at 15, its engine's processes left running.)"""
    faulthandler.dump_traceback_later(float(os.environ.get("BENCH_HANG_S", "900")), exit=True)


async def ratio_rounds(r0, gate: Gate, rounds: int) -> dict:
    """One warm-up pass of the role (untimed), then `rounds` timed rounds, role and engine in
    alternating order."""
    await gate.arrived.wait()
    await role_pass(r0, gate)  # warm-up: the engine, the pools' tables, the role's loop
    rows = []
    for k in range(1, rounds + 1):
        watchdog()
        await gate.arrived.wait()
        specs = list(gate.reply.trajectories)
        await asyncio.sleep(SETTLE_S)
        if k % 2:  # engine first
            eng = await timed(engine_pass(r0.engine, specs, f"bare{k}"))
            await asyncio.sleep(SETTLE_S)
            role = await timed(role_pass(r0, gate))
        else:
            role = await timed(role_pass(r0, gate))
            await asyncio.sleep(SETTLE_S)
            eng = await timed(engine_pass(r0.engine, specs, f"bare{k}"))
        rows.append(round_row(k, role, eng))
        print(f"  round {k}: role {role[0] / role[1]:,.0f} tokens/s ({role[1]:.1f} s), engine "
              f"{eng[0] / eng[1]:,.0f} tokens/s ({eng[1]:.1f} s), ratio {rows[-1]['ratio']:.3f}", flush=True)
    ratios = spread_of([r["ratio"] for r in rows])
    lo, hi = median_ci([r["ratio"] for r in rows])
    return {"rounds": rows, "role_over_engine": ratios["median"], "role_over_engine_runs": [r["ratio"] for r in rows],
            "role_over_engine_ci95": [lo, hi],
            "role_over_engine_spread": ratios["spread"], "role_over_engine_iqr": ratios["iqr"],
            "role_over_engine_min": ratios["min"], "role_over_engine_max": ratios["max"],
            "pass_s": statistics.median(s for r in rows for s in (r["role_s"], r["engine_s"])),
            "role_tokens_per_s": statistics.median(r["role_tokens"] / r["role_s"] for r in rows),
            "engine_tokens_per_s": statistics.median(r["engine_tokens"] / r["engine_s"] for r in rows),
            "same_tokens": all(r["role_tokens"] == r["engine_tokens"] for r in rows),
            # CPU per token in this process (role, pools, vLLM's client side): what the role adds
            "role_cpu_us_per_token": statistics.median(r["role_cpu_us_per_token"]["here"] for r in rows),
            "engine_cpu_us_per_token": statistics.median(r["engine_cpu_us_per_token"]["here"] for r in rows),
            "gc_s": {"role": sum(r["gc_s"]["role"] for r in rows), "engine": sum(r["gc_s"]["engine"] for r in rows)}}


async def run_bench(cfg, n: int, migrate_n: int, model_dir: str, rounds: int, ratio_only: bool) -> dict:
    """Phases on one warm engine: role vs engine rounds -> migrations -> weight load."""
    from laminar.testing.inproc_cluster import InprocCluster
    c = InprocCluster(cfg, scoped=True)  # every role acts as its key would: hand-outs and owners checked
    for r, i in (("prompt_pool", "0"), ("partial_pool", "0"), ("experience_buffer", "0")):
        await c.start(r, i)
    r0 = await c.start("rollout", "0")
    gc.freeze()  # what each role's own process does once its setup is done (laminar/shell.py when_ready)
    gate = r0.prompts = Gate(r0.prompts)  # its first batch may pass before this: it warms the engine
    try:
        res = await ratio_rounds(r0, gate, rounds)
        gate.open = True
        gate.release()
        if not ratio_only:
            await c.start("prompt_pool", "1")
            r1 = await c.start("rollout", "1")
            watchdog()
            res.update(await migrations(c, r0, r1, sorted({1, migrate_n})))
            watchdog()
            res.update(await weight_load(r0.engine, model_dir))
    finally:
        gate.open = True
        gate.release()
        await c.close()
    return res


async def migrations(c, r0, r1, sizes: list[int]) -> dict:
    """MigrateOut k trajectories of rollout 0's running batch, MigrateIn on rollout 1: seconds until
    every moved one generated a token there."""
    from laminar.protocol import MigrateIn, MigrateOut
    res = {}
    for k in sizes:
        deadline = time.monotonic() + 60
        while len(r0.active) < k or min(len(a.tokens) for a in r0.active.values()) < 4:
            if time.monotonic() > deadline:  # n must leave k trajectories on r0 after the earlier moves
                raise TimeoutError(f"rollout 0 never held {k} trajectories to migrate ({len(r0.active)} active)")
            await asyncio.sleep(0.002)     # watching the role's own state
        ids = list(r0.active)[:k]
        t = time.perf_counter()
        moved = await c.client("rollout", "0").call(MigrateOut(ids), timeout=60)
        await c.client("rollout", "1").call(MigrateIn(list(moved.partials)), timeout=60)
        base = {p.spec.trajectory_id: len(p.tokens) for p in moved.partials}
        while any(tid in r1.active and len(r1.active[tid].tokens) <= base[tid] for tid in base):
            await asyncio.sleep(0.001)     # watching the role's own state
        res[f"migration_s_{k}"] = time.perf_counter() - t
    return res


async def weight_load(eng, model_dir: str) -> dict:
    """A new version written into a host store, loaded in place into the warm engine."""
    import torch
    import transformers

    from laminar.weights.local_write import write_version
    from laminar.weights.store import ShmStore
    store = ShmStore(Path(tempfile.mkdtemp(prefix="laminar-bench-shm-")))
    store.open()
    sd = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    write_version(store, sd, 1)
    t = time.perf_counter()
    assert await eng.load_relay(str(store.dir), 0) == 1
    return {"weight_load_s": time.perf_counter() - t, "params": sum(x.numel() for x in sd.values())}


# (hidden, layers) of the Qwen2 models whose in-place weight load is timed (params include the
# 259-token embedding; float32 as the CPU engine runs them)
LOAD_SIZES_QUICK = [(128, 2), (512, 8)]
LOAD_SIZES = [(128, 2), (512, 8), (1024, 8)]


async def load_by_size(tmp: Path, sizes: list[tuple[int, int]]) -> list[dict]:
    """For each model shape: a fresh engine, then 3 new versions written to a shared-memory store
    and loaded in place (what a rollout does between batches); the median load."""
    import statistics

    import torch
    from laminar.roles.rollout.engine import VllmEngine

    from laminar.models.tiny import build_tiny_model
    from laminar.weights.local_write import write_version
    from laminar.weights.store import ShmStore
    rows = []
    for hidden, layers in sizes:
        d = build_tiny_model(tmp / f"m{hidden}x{layers}", hidden=hidden, layers=layers, intermediate=2 * hidden,
                             heads=max(4, hidden // 64), kv_heads=2)
        sd = __import__("transformers").AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).state_dict()
        nbytes = sum(t.numel() * t.element_size() for t in sd.values())
        eng = VllmEngine(str(d), max_model_len=256, max_num_seqs=8, kv_cache_gib=1, temperature=1.0, top_p=1.0)
        await eng.start()
        store = ShmStore(Path(tempfile.mkdtemp(prefix="laminar-bench-shm-", dir="/dev/shm")))
        store.open()
        times = []
        try:
            for v in range(1, 4):
                write_version(store, sd, v)
                t = time.perf_counter()
                assert await eng.load_relay(str(store.dir), v - 1) == v
                times.append(time.perf_counter() - t)
        finally:
            await eng.close()
            __import__("shutil").rmtree(store.dir, ignore_errors=True)
        s = statistics.median(times)
        rows.append({"hidden": hidden, "layers": layers, "params": sum(t.numel() for t in sd.values()),
                     "bytes": nbytes, "load_s": s, "load_gb_per_s": nbytes / s / 1e9})
    return rows


def main() -> int:
    watchdog()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds, smaller models in the weight-load phase")
    ap.add_argument("--out", default=None)
    ap.add_argument("--model-dir", default=None, help="HF model folder (default: build the tiny model)")
    ap.add_argument("--rounds", type=int, default=None, help=f"timed role/engine rounds (default {ROUNDS}, "
                    f"quick {ROUNDS_QUICK})")
    ap.add_argument("--ratio-only", action="store_true", help="only the role/engine rounds")
    ap.add_argument("--trajectories", type=int, default=None, help=f"trajectories per batch (default {BATCH}, "
                    f"quick {BATCH_QUICK})")
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help=f"tokens per trajectory at most (default "
                    f"{MAX_TOKENS})")
    a = ap.parse_args()
    exit_on_signals()  # SIGTERM/SIGHUP unwind like Ctrl-C: engines closed, the /dev/shm store removed
    n = a.trajectories or (BATCH_QUICK if a.quick else BATCH)
    max_tokens, migrate_n = a.max_tokens, min(MIGRATE_N, n // 2)
    rounds = a.rounds or (ROUNDS_QUICK if a.quick else ROUNDS)
    from laminar.models.tiny import build_tiny_model
    tmp = Path(tempfile.mkdtemp(prefix="laminar-bench-rollout-"))
    model_dir = a.model_dir or str(build_tiny_model(tmp / "tiny", init_std=0.1))
    res = asyncio.run(run_bench(cluster_cfg(tmp, model_dir, n, max_tokens, tmp / "shm"), n, migrate_n, model_dir,
                                rounds, a.ratio_only))
    print_table(f"rollout role vs the bare vLLM CPU engine, same work ({n} trajectories of up to {max_tokens} "
                f"tokens a round, temperature 1; every check on)",
                ["round", "first", "role tokens/s", "engine tokens/s", "role / engine"],
                [[i + 1, "role" if r["role_first"] else "engine", r["role_tokens"] / r["role_s"],
                  r["engine_tokens"] / r["engine_s"], r["ratio"]] for i, r in enumerate(res["rounds"])])
    lo, hi = res["role_over_engine_ci95"]
    print(f"\nrole / engine: median {res['role_over_engine']:.3f} of {rounds} rounds (passes of "
          f"{res['pass_s']:.1f} s; 95% interval of the median [{lo:.3f}, {hi:.3f}]: it tells 0.9 from 1.0 "
          f"when narrower than 0.1), spread {res['role_over_engine_spread']:.3f} "
          f"(min {res['role_over_engine_min']:.3f}, max {res['role_over_engine_max']:.3f}, "
          f"IQR {res['role_over_engine_iqr']:.3f}; goal >= 0.95); same "
          f"tokens both ways: {res['same_tokens']}; full GCs here: {res['gc_s']['role']:.2f} s in the role's "
          f"passes, {res['gc_s']['engine']:.2f} s in the engine's; "
          f"CPU per token in this process: role {res['role_cpu_us_per_token']:.1f} us, engine alone "
          f"{res['engine_cpu_us_per_token']:.1f} us")
    out = {"quick": a.quick, "trajectories": n, "max_tokens": max_tokens,
           **{k: v for k, v in res.items() if k != "rounds"}, "rounds": res["rounds"]}
    if not a.ratio_only:
        by_size = asyncio.run(load_by_size(tmp, LOAD_SIZES_QUICK if a.quick else LOAD_SIZES))
        print_table("migration and in-place weight load",
                    ["measure", "value", "note"],
                    [["weight load (in place), s", res["weight_load_s"], f"{res['params'] / 1e6:.2f} M parameters"],
                     ["migration, 1 trajectory, s", res["migration_s_1"], "command -> generating on the destination"],
                     [f"migration, {migrate_n} trajectories, s", res[f"migration_s_{migrate_n}"], ""]])
        print_table("in-place weight load vs model size (fresh engine each, median of 3 versions)",
                    ["params", "MB (fp32)", "load s", "GB/s"],
                    [[f"{r['params'] / 1e6:.2f} M", r["bytes"] / 1e6, r["load_s"], r["load_gb_per_s"]]
                     for r in by_size])
        out.update({"weight_load_s": res["weight_load_s"], "weight_params": res["params"],
                    "migration_s_per_trajectory": res["migration_s_1"],
                    f"migration_s_{migrate_n}_trajectories": res[f"migration_s_{migrate_n}"],
                    "migration_s_per_trajectory_batched": res[f"migration_s_{migrate_n}"] / migrate_n,
                    "weight_load_by_size": by_size})
    write_json(a.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
