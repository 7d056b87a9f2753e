"""Rollout benchmark on this machine's vLLM CPU engine (tiny model unless --model-dir).

    python bench/rollout.py [--quick] [--out FILE]

1. inside the rollout role (prompt pool -> generation -> token deltas streamed to the partial
   pool every 0.25 s -> scoring -> experience buffer, stats reported every second) -> tokens/s
   of each of TIMED_EPOCHS batches, after a warm-up batch;
2. engine alone: the first timed batch's trajectories (same prompts, same per-trajectory seeds,
   so the same tokens) generated again straight through the same warm engine, all at once,
   TIMED_EPOCHS times -> tokens/s; the ratio of the medians is the role's overhead (a batch
   lasts well under a second here, so single passes are noisy);
3. weight load: a new version written into the host's shared-memory store, loaded in place
   (engine.load_relay) into the warm engine; then per model size (Qwen2 shapes of ~0.4M to
   ~100M parameters, one fresh engine each: median of 3 loads) -> seconds and GB/s;
4. migration: MigrateOut on one rollout + MigrateIn on another, timed until every moved
   trajectory has produced a new token on the destination; for 1 and for N trajectories.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import zlib
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import exit_on_signals, free_port, print_table, write_json  # noqa: E402

SEED = 11
TIMED_EPOCHS = 3


def prompts(n: int) -> list[str]:
    return [f"{i:03d} say something long" for i in range(n)]


def cluster_cfg(tmp: Path, model_dir: str, n: int, max_tokens: int, shm: Path):
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
                    "max_epochs": 2 + TIMED_EPOCHS,
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


async def run_bench(cfg, n: int, migrate_n: int, model_dir: str) -> dict:
    """Phases on one warm engine: role batch (timed) -> migrations -> same tokens bare -> load."""
    import torch
    import transformers

    from laminar.datasets import ByteTokenizer
    from laminar.protocol import MigrateIn, MigrateOut, SampleGroups
    from laminar.testing.inproc_cluster import InprocCluster
    from laminar.weights.local_write import write_version
    from laminar.weights.store import ShmStore
    c = InprocCluster(cfg)
    for r, i in (("prompt_pool", "0"), ("prompt_pool", "1"), ("partial_pool", "0"), ("experience_buffer", "0")):
        await c.start(r, i)
    r0 = await c.start("rollout", "0")
    r1 = await c.start("rollout", "1")
    buf, got = c.client("experience_buffer"), []

    async def wait_done(total: int) -> None:
        deadline = time.monotonic() + 120
        while len(got) < total:
            if time.monotonic() > deadline:
                stats = await c.client("experience_buffer").call(
                    __import__("laminar.protocol", fromlist=["x"]).BufferStatsRequest()
                )
                raise TimeoutError(f"{len(got)}/{total} trajectories; buffer {stats}; r0 {r0.status()} "
                                   f"r1 {r1.status()} r0 active {list(r0.active)[:5]} r1 active {list(r1.active)[:5]}")
            s = await buf.call(SampleGroups(total, 0))
            got.extend(t for g in s.groups for t in g)
            if not s.groups:
                await asyncio.sleep(0.02)  # polling the buffer for finished work
    await wait_done(n + 1)                 # epoch 0 on r0 (engine warm-up) and r1's warm-up
    t0 = time.perf_counter()
    role_rates = []
    for e in range(1, TIMED_EPOCHS + 1):   # epochs 1..TIMED_EPOCHS on r0: the timed batches
        await wait_done((e + 1) * n + 1)
        role_s = time.perf_counter() - t0
        tokens = sum(len(t.response_tokens) for t in got if t.spec.group_id.startswith(f"e{e}-"))
        role_rates.append(tokens / role_s)
        t0 = time.perf_counter()
    timed = [t for t in got if t.spec.group_id.startswith("e1-")]
    res = {"role_rates": role_rates, "role_tokens": sum(len(t.response_tokens) for t in timed)}
    for k in sorted({1, migrate_n}):       # the next epoch on r0: move k trajectories to r1
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
    await wait_done((TIMED_EPOCHS + 2) * n + 1)
    while r0.active or r1.active:
        await asyncio.sleep(0.01)
    # the same epoch-1 trajectories (same seeds, so the same tokens) straight through the engine
    tok, eng = ByteTokenizer(), r0.engine

    async def one(t, rep: int) -> int:
        tid, count = t.spec.trajectory_id, 0
        async for toks, _, _ in eng.generate(f"{tid}#bare{rep}", tok.encode(cfg_prompt(t)), t.spec.max_tokens,
                                             zlib.crc32(f"{SEED}:{tid}".encode())):
            count += len(toks)
        return count
    res["engine_rates"] = []
    for rep in range(TIMED_EPOCHS):
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(t, rep) for t in timed))
        res["engine_rates"].append(sum(counts) / (time.perf_counter() - t0))
        res["engine_tokens"] = sum(counts)
    # weight load: a new version written into the host store, loaded in place
    store = ShmStore(Path(tempfile.mkdtemp(prefix="laminar-bench-shm-")))
    store.open()
    sd = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    write_version(store, sd, 1)
    t = time.perf_counter()
    assert await eng.load_relay(str(store.dir), 0) == 1
    res.update(weight_load_s=time.perf_counter() - t, params=sum(x.numel() for x in sd.values()))
    await c.close()
    return res


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


def cfg_prompt(t) -> str:
    from laminar.datasets import ByteTokenizer
    return ByteTokenizer().decode([int(x) for x in t.spec.prompt_tokens[1:]])


def main() -> int:
    import faulthandler
    faulthandler.dump_traceback_later(float(os.environ.get("BENCH_HANG_S", "600")), exit=True)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer trajectories (under 90 s)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--model-dir", default=None, help="HF model folder (default: build the tiny model)")
    a = ap.parse_args()
    exit_on_signals()  # SIGTERM/SIGHUP unwind like Ctrl-C: engines closed, the /dev/shm store removed
    n, max_tokens, migrate_n = (32, 64, 16) if a.quick else (128, 192, 100)
    from laminar.models.tiny import build_tiny_model
    tmp = Path(tempfile.mkdtemp(prefix="laminar-bench-rollout-"))
    model_dir = a.model_dir or str(build_tiny_model(tmp / "tiny", init_std=0.1))
    res = asyncio.run(run_bench(cluster_cfg(tmp, model_dir, n, max_tokens, tmp / "shm"), n, migrate_n, model_dir))
    by_size = asyncio.run(load_by_size(tmp, LOAD_SIZES_QUICK if a.quick else LOAD_SIZES))
    import statistics
    engine_rate, engine_tokens = statistics.median(res["engine_rates"]), res["engine_tokens"]
    res["role_tokens_per_s"] = statistics.median(res["role_rates"])
    ratio = res["role_tokens_per_s"] / engine_rate
    print_table(f"rollout on the vLLM CPU engine ({n} trajectories, up to {max_tokens} tokens, temperature 1)",
                ["measure", "value", "note"],
                [["engine alone, tokens/s", engine_rate, f"{engine_tokens} tokens; median of {TIMED_EPOCHS}"],
                 ["inside the rollout role, tokens/s", res["role_tokens_per_s"],
                  f"{res['role_tokens']} tokens per batch; median of {TIMED_EPOCHS}; pools + streaming + stats on"],
                 ["role / engine", ratio, "target >= 0.85"],
                 ["weight load (in place), s", res["weight_load_s"], f"{res['params'] / 1e6:.2f} M parameters"],
                 ["migration, 1 trajectory, s", res["migration_s_1"], "command -> generating on the destination"],
                 [f"migration, {migrate_n} trajectories, s", res[f"migration_s_{migrate_n}"], ""]])
    print_table("in-place weight load vs model size (fresh engine each, median of 3 versions)",
                ["params", "MB (fp32)", "load s", "GB/s"],
                [[f"{r['params'] / 1e6:.2f} M", r["bytes"] / 1e6, r["load_s"], r["load_gb_per_s"]] for r in by_size])
    write_json(
        a.out,
        {
            "quick": a.quick,
            "engine_tokens_per_s": engine_rate,
            "role_tokens_per_s": res["role_tokens_per_s"],
            "engine_tokens_per_s_runs": res["engine_rates"],
            "role_tokens_per_s_runs": res["role_rates"],
            "role_over_engine": ratio,
            "weight_load_s": res["weight_load_s"],
            "weight_params": res["params"],
            "migration_s_per_trajectory": res["migration_s_1"],
            f"migration_s_{migrate_n}_trajectories": res[f"migration_s_{migrate_n}"],
            "migration_s_per_trajectory_batched": res[f"migration_s_{migrate_n}"] / migrate_n,
            "weight_load_by_size": by_size,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
