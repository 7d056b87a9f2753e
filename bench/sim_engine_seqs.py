"""One simulated rollout engine kept full, with and without a cap on the sequences it runs at once:
generated tokens/s against the roofline the ceiling assumes, and preemptions.

    python bench/sim_engine_seqs.py [--models 7B,32B,72B] [--modes laminar,sync] [--sim-s 4000] [--out FILE]

For each model and mode, one SimEngine with the settings a rollout of that mode gets in the
cluster (scenario.build_config from configs/sim/paper.yaml: TP, memory fraction, the paper's
lengths) runs on a virtual clock with `max_concurrency`
(1,024) requests always outstanding, as a rollout that never runs dry. Policies:
- `vllm`: the engine runs every request it can hold, preempting (recompute) the newest when the
  KV cache runs out, as vLLM does; the sweeps of docs/sim.md ran this way;
- `kv`: at most b* = KV capacity ÷ the tokens a sequence holds on average over its life (the batch
  the ceiling assumes: scenario.ideal_replica_tokens_per_s), the rest waiting in the queue
  (`roles.rollout.max_num_seqs`; `bench/scale.py --engine-seqs kv`).
Tokens/s are counted after the first quarter of the simulated time (the start, every request
prefilling at once, is left out). `ratio` = tokens/s ÷ the ideal replica tokens/s. Seconds of
wall time per row; no cluster, no processes.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import print_table, write_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


async def steady(setup, workload: dict, size: str, mode: str, policy: str, sim_s: float) -> dict:
    from laminar.roles.rollout.sim_engine import SimEngine, VirtualClock

    from laminar.sim.scenario import build_config, ideal_replica_tokens_per_s, scales
    shape = setup.run_shape
    ideal, bstar = ideal_replica_tokens_per_s(setup, workload, size, mode)
    outstanding = shape.max_concurrency
    # the engine settings a rollout of this mode gets in the cluster (the scale changes only its
    # weight-load time, which an engine kept full never pays)
    cfg = build_config(setup, size, scales(workload, size)[-1], mode, workdir="/nonexistent", speedup=1.0,
                       iterations=1, workload=workload, weights_root="/nonexistent")
    # the engine alone (its steady state): no compressed time, no scoring timeline (a VirtualClock has one sleeper)
    sim = {k: v for k, v in cfg["roles"]["rollout"]["sim"].items() if k not in ("speedup", "reward_s_by_tokens")}
    clock = VirtualClock()
    eng = SimEngine.from_workload(**sim, clock=clock, seed=1,
                                  max_num_seqs=min(bstar, outstanding) if policy == "kv" else outstanding)
    await eng.start()
    tokens, started, mark = 0, 0, None
    prompt = [5] * shape.prompt_tokens

    async def one(i: int) -> None:
        nonlocal tokens
        async for toks, _, _ in eng.generate(f"r{i}", prompt, shape.max_output_tokens, seed=i):
            tokens += len(toks)
    tasks: set = set()
    t0 = time.perf_counter()
    try:
        while clock.now() < sim_s:
            while len(tasks) < outstanding:
                started += 1
                task = asyncio.create_task(one(started))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if mark is None and clock.now() >= sim_s / 4:
                mark = (clock.now(), tokens, eng.counters["preemptions"])
            await asyncio.sleep(0)
        t, n, p = clock.now(), tokens, eng.counters["preemptions"]
    finally:
        await eng.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    rate = (n - mark[1]) / (t - mark[0])
    return {"model": size, "mode": mode, "policy": policy, "running_cap": eng.max_num_seqs, "b_star": bstar,
            "tokens_per_s": rate, "ideal_tokens_per_s": ideal, "ratio": rate / ideal,
            "preemptions_per_1000_s": (p - mark[2]) / (t - mark[0]) * 1000, "wall_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="7B,32B,72B")
    ap.add_argument("--modes", default="laminar,sync")
    ap.add_argument("--sim-s", type=float, default=4000.0, help="simulated seconds per row")
    ap.add_argument("--setups", default=os.path.join(ROOT, "configs", "sim", "paper.yaml"))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from laminar.sim import load_workload
    from laminar.sim.setup import load_setup
    setup = load_setup(a.setups)
    workload = load_workload(setup.workload)
    rows = []
    for size in a.models.split(","):
        for mode in a.modes.split(","):
            pair = {p: asyncio.run(steady(setup, workload, size, mode, p, a.sim_s)) for p in ("vllm", "kv")}
            pair["kv"]["gain"] = pair["kv"]["tokens_per_s"] / pair["vllm"]["tokens_per_s"]
            rows += [pair["vllm"], pair["kv"]]
    print_table("one engine kept full: running every request (vllm) vs at most b* (kv)",
                ["model", "mode", "policy", "running cap", "tokens/s", "ideal", "ratio", "preempt/1000 s", "kv ÷ vllm"],
                [[r["model"], r["mode"], r["policy"], r["running_cap"], r["tokens_per_s"], r["ideal_tokens_per_s"],
                  r["ratio"], r["preemptions_per_1000_s"], r.get("gain", "")] for r in rows])
    write_json(a.out, {"sim_s": a.sim_s, "rows": rows})


if __name__ == "__main__":
    main()
