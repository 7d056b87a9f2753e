"""Rollout benchmark on this machine's vLLM CPU engine (tiny model unless --model-dir).

    python bench/rollout.py [--quick] [--out FILE] [--rounds R] [--ratio-only] [--trajectories N] [--max-tokens M]

1. the role against the bare engine, same work, at the same time: the role's process (the role
   and, in-process, its pools) and its engine on one core, a twin engine (the same vLLM arguments,
   in a process of its own: bench/_twin.py) on the other; one warm-up pass, then R rounds. In each
   round the rollout role (prompt pool -> generation -> token deltas streamed to the partial pool
   every 0.25 s -> scoring -> experience buffer, stats every second; an in-process cluster with
   scoped identities, so hand-outs, ownership and lineage are checked as in a cluster) runs one
   batch of N trajectories of up to M tokens while the twin runs the same trajectories (same
   prompts, same per-trajectory seeds, so the same tokens), all at once. Why at the same time:
   this machine's speed moves by 10-25% from one ~5 s pass to the next, on both cores together,
   so passes taken one after the other (this bench's first design) gave rounds from 0.80 to 1.21
   and could not tell 0.9 from 1.0; side by side, two bare twins agree within a few percent. The
   sides swap cores every round (the role on core 0 in even rounds), so a faster core favours
   neither. The role's time is one whole cycle of its batch loop: from the TakeBatch reply to its
   next TakeBatch, plus that request's own round trip; the bench holds the loop at the prompt
   pool's door between rounds (a gate on the role's client), so the round starts both sides at
   once, and the role's last stores end, untimed, before the next round (SETTLE_S). Each round
   gives one ratio (role tokens/s over twin tokens/s, the same tokens); `role_over_engine` is the
   median of the R rounds' ratios, `role_over_engine_ci95` the distribution-free 95% interval of
   that median (order statistics), `role_over_engine_spread` its width over the median: under 0.1
   tells 0.9 from 1.0. Each pass also records the CPU per token of each side (the role's process,
   its engine; the twin's client, its engine) and the seconds of full garbage collections in the
   role's process (`gc_s`);
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
from _common import cpu_s, descendants, exit_on_signals, free_port, median_ci, print_table, spread_of, write_json  # noqa: E402
from _twin import TwinEngine, pin_tree  # noqa: E402

SEED = 11
ROUNDS, ROUNDS_QUICK = 15, 12  # timed rounds, both sides at once (after one warm-up pass)
# trajectories per batch and max tokens each; on one core each side, a batch of 96 takes ~6 s on
# a quiet 2-core machine, one of 192 ~11 s, so --quick (the guard's) fits ~2 minutes
BATCH, BATCH_QUICK, MAX_TOKENS = 192, 96, 640
MIGRATE_N = 100
# untimed pause before each pass, so what the last one left running (the pools' writes of the
# role's last stores, which end after its loop asks again) does not land in the next one's window
SETTLE_S = 1.0


def prompts(n: int) -> list[str]:
    return [f"{i:03d} say something long" for i in range(n)]


def cluster_cfg(tmp: Path, model_dir: str, n: int, max_tokens: int, shm: Path, core: int = 0):
    """Prompt pool 0 hands rollout 0 (its engine's threads on `core`) batches of N single-trajectory
    groups, for ever; prompt pool 1 gives rollout 1 one trajectory of its own (then room for
    migrants)."""
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
        {"role": "rollout", "id": "0", "port": free_port(), "cores": [core]},
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


def bare_batch(specs) -> list[tuple[str, list[int], int, int]]:
    """The specs as the twin runs them: (trajectory id, prompt tokens, max tokens, the seed the role
    gives that trajectory)."""
    return [(x.trajectory_id, [int(t) for t in x.prompt_tokens], x.max_tokens,
             zlib.crc32(f"{SEED}:{x.trajectory_id}".encode())) for x in specs]


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


class GcClock:
    """Seconds this process has spent in full (generation 2) garbage collections so far."""

    def __init__(self):
        self.total, self._t0 = 0.0, None
        gc.callbacks.append(self._event)

    def _event(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.total += time.perf_counter() - self._t0
            self._t0 = None


GC = GcClock()


def round_row(k: int, role: tuple, bare: tuple) -> dict:
    """One round: role (tokens, seconds, CPU of its process, of its engine, full-GC seconds) and
    twin (tokens, seconds, CPU of its client, of its engine); the role on core k % 2."""
    return {"role_tokens": role[0], "role_s": role[1], "engine_tokens": bare[0], "engine_s": bare[1],
            "role_core": k % 2, "ratio": (role[0] / role[1]) / (bare[0] / bare[1]),
            "role_cpu_us_per_token": {"here": 1e6 * role[2] / role[0], "engine": 1e6 * role[3] / role[0]},
            "engine_cpu_us_per_token": {"here": 1e6 * bare[2] / bare[0], "engine": 1e6 * bare[3] / bare[0]},
            "gc_s": role[4]}


def round_summary(rows: list[dict]) -> dict:
    """The median of the rounds' ratios, its 95% interval and spread, and the sides' medians."""
    ratios = [r["ratio"] for r in rows]
    s, (lo, hi) = spread_of(ratios), median_ci(ratios)
    by_core = {f"role_on_core_{c}": statistics.median(r["ratio"] for r in rows if r["role_core"] == c)
               for c in (0, 1) if any(r["role_core"] == c for r in rows)}
    med = lambda key, side: statistics.median(r[key][side] for r in rows)  # noqa: E731
    return {"role_over_engine": s["median"], "role_over_engine_runs": ratios,
            "role_over_engine_ci95": [lo, hi], "role_over_engine_spread": (hi - lo) / s["median"],
            "role_over_engine_range": s["spread"], "role_over_engine_iqr": s["iqr"],
            "role_over_engine_min": s["min"], "role_over_engine_max": s["max"], "by_core": by_core,
            "pass_s": statistics.median(x for r in rows for x in (r["role_s"], r["engine_s"])),
            "role_tokens_per_s": statistics.median(r["role_tokens"] / r["role_s"] for r in rows),
            "engine_tokens_per_s": statistics.median(r["engine_tokens"] / r["engine_s"] for r in rows),
            "same_tokens": all(r["role_tokens"] == r["engine_tokens"] for r in rows),
            # CPU per token of each side: the role's process (role, pools, vLLM's client side) and
            # its engine; the twin's client side and its engine
            "role_cpu_us_per_token": {"process": med("role_cpu_us_per_token", "here"),
                                      "engine": med("role_cpu_us_per_token", "engine")},
            "engine_cpu_us_per_token": {"client": med("engine_cpu_us_per_token", "here"),
                                        "engine": med("engine_cpu_us_per_token", "engine")},
            "gc_s": sum(r["gc_s"] for r in rows)}


class Sides:
    """The two sides' processes, pinned one core each, and their CPU clocks."""

    def __init__(self, twin: TwinEngine, cores: tuple[int, int]):
        self.twin, self.cores = twin, cores

    def role_pids(self) -> list[int]:
        theirs = set(self.twin.pids())
        return [os.getpid(), *(p for p in descendants(os.getpid()) if p not in theirs)]

    def pin(self, k: int) -> None:
        """Round k: the role on cores[k % 2], the twin on the other."""
        pin_tree(self.role_pids(), {self.cores[k % 2]})
        pin_tree(self.twin.pids(), {self.cores[1 - k % 2]})

    def unpin(self, cores: set[int]) -> None:
        """The role's side back on `cores` (the phases after the rounds)."""
        pin_tree(self.role_pids(), cores)

    def cpu(self) -> tuple[float, float, float, float]:
        """CPU seconds so far: the role's process, its engine, the twin's client, its engine."""
        engine = sum(cpu_s(p) for p in self.role_pids()[1:])
        return (time.process_time(), engine, *self.twin.cpu())


async def one_round(r0, gate: Gate, sides: Sides, k: int) -> dict:
    """Both sides at once on the held batch: the twin started, then the role let through."""
    sides.pin(k)
    await asyncio.sleep(SETTLE_S)
    c0, g0 = sides.cpu(), GC.total
    sides.twin.send(f"bare{k}", bare_batch(gate.reply.trajectories))
    tokens, secs = await role_pass(r0, gate)
    bare = await sides.twin.result()
    c = [x - y for x, y in zip(sides.cpu(), c0, strict=True)]
    return round_row(k, (tokens, secs, c[0], c[1], GC.total - g0), (*bare, c[2], c[3]))


async def ratio_rounds(r0, gate: Gate, sides: Sides, rounds: int) -> dict:
    """One warm-up round (untimed), then `rounds` timed rounds, the sides swapping cores."""
    await gate.arrived.wait()
    await one_round(r0, gate, sides, 0)  # warm-up: both engines, the pools' tables, the role's loop
    rows = []
    for k in range(1, rounds + 1):
        await gate.arrived.wait()
        rows.append(await one_round(r0, gate, sides, k))
        r = rows[-1]
        print(f"  round {k} (role on core {sides.cores[k % 2]}): role {r['role_tokens'] / r['role_s']:,.0f} "
              f"tokens/s ({r['role_s']:.1f} s), engine {r['engine_tokens'] / r['engine_s']:,.0f} tokens/s "
              f"({r['engine_s']:.1f} s), ratio {r['ratio']:.3f}", flush=True)
    return {"rounds": rows, **round_summary(rows)}


def two_cores() -> tuple[int, int]:
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        raise SystemExit(f"bench/rollout.py runs the role and a bare twin on a core each: this process may use {mine}")
    return mine[0], mine[1]


async def run_bench(cfg, n: int, migrate_n: int, model_dir: str, rounds: int, ratio_only: bool) -> dict:
    """Phases on warm engines: role vs twin rounds -> migrations -> weight load."""
    from laminar.testing.inproc_cluster import InprocCluster
    cores, everywhere = two_cores(), os.sched_getaffinity(0)
    twin = TwinEngine(cfg.settings_of("rollout", "0"), cores[1])
    c = InprocCluster(cfg, scoped=True)  # every role acts as its key would: hand-outs and owners checked
    gate = None
    try:
        await twin.start()
        for r, i in (("prompt_pool", "0"), ("partial_pool", "0"), ("experience_buffer", "0")):
            await c.start(r, i)
        r0 = await c.start("rollout", "0")
        gc.freeze()  # what each role's own process does once its setup is done (laminar/shell.py when_ready)
        gate = r0.prompts = Gate(r0.prompts)  # its first batch may pass before this: it warms the engine
        sides = Sides(twin, cores)
        res = await ratio_rounds(r0, gate, sides, rounds)
        twin.close()
        sides.unpin(everywhere)
        gate.open = True
        gate.release()
        if not ratio_only:
            await c.start("prompt_pool", "1")
            r1 = await c.start("rollout", "1")
            res.update(await migrations(c, r0, r1, sorted({1, migrate_n})))
            res.update(await weight_load(r0.engine, model_dir))
    finally:
        if gate is not None:
            gate.open = True
            gate.release()
        twin.close()
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
    import faulthandler
    faulthandler.dump_traceback_later(float(os.environ.get("BENCH_HANG_S", "900")), exit=True)
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
    print_table(f"rollout role vs a bare twin of its engine, same work at the same time, a core each ({n} "
                f"trajectories of up to {max_tokens} tokens a round, temperature 1; every check on)",
                ["round", "role on core", "role tokens/s", "engine tokens/s", "role / engine"],
                [[i + 1, r["role_core"], r["role_tokens"] / r["role_s"], r["engine_tokens"] / r["engine_s"],
                  r["ratio"]] for i, r in enumerate(res["rounds"])])
    lo, hi = res["role_over_engine_ci95"]
    cpu_r, cpu_e = res["role_cpu_us_per_token"], res["engine_cpu_us_per_token"]
    print(f"\nrole / engine: median {res['role_over_engine']:.3f} of {rounds} rounds (passes of "
          f"{res['pass_s']:.1f} s), 95% interval of the median [{lo:.3f}, {hi:.3f}] (spread "
          f"{res['role_over_engine_spread']:.3f}: under 0.1 tells 0.9 from 1.0; goal >= 0.95); rounds "
          f"{res['role_over_engine_min']:.3f}-{res['role_over_engine_max']:.3f} (IQR "
          f"{res['role_over_engine_iqr']:.3f}); by the role's core "
          + ", ".join(f"{k[-1]}: {v:.3f}" for k, v in res["by_core"].items())
          + f"; same tokens both sides: {res['same_tokens']}; full GCs in the role's process: {res['gc_s']:.2f} s; "
          f"CPU per token: role process {cpu_r['process']:.1f} us + engine {cpu_r['engine']:.1f} us, twin client "
          f"{cpu_e['client']:.1f} us + engine {cpu_e['engine']:.1f} us")
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
