"""The agent gateway's own CPU per call: the path around the engine (HTTP, the bus hop, rendering and the
extension check, recording, the pool write, the reply), with an engine that costs next to nothing.

    python bench/agent_gateway_path.py [--episodes 16] [--calls 6] [--max-tokens 64] [--rounds 8]
                                       [--profile FILE] [--out FILE]

The cluster of bench/agent_gateway.py (prompt pool, partial pool, buffer, gateway, a rollout in
agent mode) with the simulator's engine, whose generation is replaced here by a stub: one
token per step every `--step-ms`, no model and no scheduler. The agents are the same child
process with the real `openai` client. A round: `--episodes` agents, `--calls` chat calls of
`--max-tokens` tokens each; this process's CPU seconds (`time.process_time`, every thread)
per call, less the stub's own CPU per call measured alone, is `path_cpu_ms_per_call`.

CPU seconds, not wall time, so it is usable as a rough comparison on a loaded machine (the
median and the lowest round are both written); `--profile FILE` writes a cProfile of the rounds
(each thread's CPU time) for `python -m pstats FILE`.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import exit_on_signals, free_port, run_loop, write_json  # noqa: E402
from agent_gateway import Agents, cluster_cfg  # noqa: E402

SIM = {"model": "7B", "tp": 1, "lengths": "7B_math", "speedup": 50, "token_id": 100, "max_output_tokens": 64}


def stub_generate(step_s: float):
    """A generation of `max_tokens` letters, one per step, each step `step_s` apart (its own seed),
    handed over a step at a time, or at the end when the request asks for its output whole
    (`Sampling.whole`), as vLLM does."""
    async def generate(self, request_id, prompt, max_tokens, seed, sampling=None):
        x, whole, toks = seed or 7, sampling is not None and sampling.whole, []
        for i in range(max_tokens):
            await asyncio.sleep(step_s)  # the engine's step
            x = (x * 1103515245 + 12345) & 0x7FFFFFFF
            toks.append(3 + 97 + x % 26)
            if not whole or i == max_tokens - 1:
                yield toks, [-0.5] * len(toks), ("length" if i == max_tokens - 1 else None)
                toks = []
    return generate


async def stub_cpu_ms(gen, episodes: int, calls: int, max_tokens: int) -> float:
    """The stub's own CPU per call, the same calls without anything around them."""
    from laminar.roles.rollout.engine import Sampling
    whole = Sampling(whole=True)  # as the agents' calls ask (non-streamed, no stop strings)

    async def one(i: int) -> None:
        for k in range(calls):
            async for _ in gen(None, "r", [], max_tokens, 1000 * i + k, whole):
                pass
    c0 = time.process_time()
    await asyncio.gather(*(one(i) for i in range(episodes)))
    return 1000 * (time.process_time() - c0) / (episodes * calls)


async def run(a) -> dict:
    from laminar.roles.rollout import sim_engine

    from laminar.testing.inproc_cluster import InprocCluster
    gen = stub_generate(a.step_ms / 1000)
    sim_engine.SimEngine.generate = gen
    stub = await stub_cpu_ms(gen, a.episodes, a.calls, a.max_tokens)
    tmp = Path(tempfile.mkdtemp(prefix="agent-gateway-path-"))
    port = free_port()
    cluster = InprocCluster(cluster_cfg(tmp, a.episodes, port, {"engine": "sim", "sim": SIM, "model_dir": str(tmp)}))
    agents = Agents(f"http://127.0.0.1:{port}/v1")
    prof = cProfile.Profile(time.thread_time) if a.profile else None
    rows = []

    async def settle() -> None:
        return None  # no engine cache to empty

    try:
        for r in ("prompt_pool", "partial_pool", "experience_buffer", "gateway", "rollout"):
            await cluster.start(r)
        gc.freeze()  # as each role's own process does once its setup is done (laminar/shell.py when_ready)
        await agents.round(a.episodes, 1, 8, 1, settle)  # warm-up: a whole batch, as each round takes one
        for rnd in range(a.rounds):
            if prof:
                prof.enable()
            res = await agents.round(a.episodes, a.calls, a.max_tokens, 100 + rnd, settle)
            if prof:
                prof.disable()
            n = sum(len(e["seeds"]) for e in res["episodes"])
            row = {"round": rnd, "calls": n, "tokens": sum(e["tokens"] for e in res["episodes"]),
                   "here_cpu_ms_per_call": 1000 * res["cpu_s"]["here"] / n,
                   "agents_cpu_ms_per_call": 1000 * res["cpu_s"]["agents"] / n}
            row["path_cpu_ms_per_call"] = row["here_cpu_ms_per_call"] - stub
            rows.append(row)
            print(f"round {rnd}: {row['path_cpu_ms_per_call']:.3f} ms of CPU a call on the gateway path "
                  f"(the agents' process {row['agents_cpu_ms_per_call']:.3f})", flush=True)
    finally:
        agents.close()
        await cluster.close()
        shutil.rmtree(tmp, ignore_errors=True)
    if prof:
        prof.dump_stats(a.profile)
    path = [r["path_cpu_ms_per_call"] for r in rows]
    return {"path_cpu_ms_per_call": statistics.median(path), "path_cpu_ms_per_call_min": min(path),
            "stub_cpu_ms_per_call": stub,
            "agents_cpu_ms_per_call": statistics.median(r["agents_cpu_ms_per_call"] for r in rows),
            "settings": vars(a), "rounds": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=16, help="agents (and episodes) at once")
    ap.add_argument("--calls", type=int, default=6, help="chat calls per episode")
    ap.add_argument("--max-tokens", type=int, default=64, help="completion tokens per call")
    ap.add_argument("--rounds", type=int, default=8, help="rounds of calls")
    ap.add_argument("--step-ms", type=float, default=2.0, help="the stub engine's step")
    ap.add_argument("--profile", default=None, help="write a cProfile of the rounds here")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args()
    exit_on_signals()
    res = run_loop(run(a))  # the cluster's loop as a role's
    print(f"gateway path: {res['path_cpu_ms_per_call']:.3f} ms of CPU a call (median of {a.rounds} rounds, lowest "
          f"{res['path_cpu_ms_per_call_min']:.3f}; the stub engine's own {res['stub_cpu_ms_per_call']:.3f} taken out)")
    write_json(a.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
