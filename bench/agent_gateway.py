"""Agent gateway benchmark: tokens/s of agent episodes through the gateway (the real `openai` client),
over the same requests sent straight to the engine.

    python bench/agent_gateway.py [--episodes 16] [--calls 3] [--max-tokens 64] [--rounds 2] [--out FILE]

One process holds the cluster (prompt pool, partial pool, buffer, gateway, one vLLM CPU rollout in
agent mode, the tiny model; its weights from a relay folder this program writes); the agents run
in a child process (their event loop apart from the cluster's), `--episodes` at once, each
claiming an episode and making `--calls` chat calls of `--max-tokens` tokens, every call with its
own seed. While they run, a new weight version is published every `--publish-s` seconds.

- gateway: completion tokens of all calls / wall time from the first call to the last reply (the
  episodes are claimed before, ended after);
- direct: the very calls again, straight to the same warm engine (`engine.generate`), each with the
  context the engine saw for it through the gateway (read back from the stored trajectories) and
  the same seed, `--episodes` sequences of calls at once -> their tokens / wall time (the same
  tokens but where another batch's arithmetic tips a near tie: each side counts its own);
- `gateway_over_direct`: the ratio of the two, over `--rounds` alternations (gateway, direct, ...);
- `episodes`: episodes the agents completed; `version_mixed_episodes`: episodes whose calls were
  not all served by one version, or whose stored trajectory names another (must be 0).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import exit_on_signals, free_port, print_table, write_json  # noqa: E402


def agents(base: str, n: int, calls: int, max_tokens: int, seed: int, out) -> None:
    """The child process: n concurrent agents through the openai client; results to `out`."""
    import httpx
    import openai

    async def claim(h) -> dict:
        deadline = time.monotonic() + 180  # 503 "no_episode": the rollout's next batch is not open yet
        while True:
            r = await h.post("/episodes", json={"wait_s": 60})
            if r.status_code != 503 or time.monotonic() > deadline:
                r.raise_for_status()
                return r.json()

    async def one(i: int, ep: dict, client) -> dict:
        msgs, seeds, versions, tokens = [{"role": "user", "content": ep["prompt"]}], [], [], 0
        for k in range(calls):
            s = seed + 1000 * i + k
            r = await client.chat.completions.create(model="laminar-policy", messages=msgs, user=ep["id"],
                                                     max_tokens=max_tokens, temperature=1.0, seed=s)
            seeds.append(s)
            versions.append(r.system_fingerprint)
            tokens += r.usage.completion_tokens
            msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
        return {"id": ep["id"], "seeds": seeds, "versions": versions, "tokens": tokens}

    async def main():
        async with httpx.AsyncClient(base_url=base, timeout=600) as h:
            eps = await asyncio.gather(*(claim(h) for _ in range(n)))  # claimed first: the clock is the calls'
            # one client per agent, built before the clock: building one makes an SSL context (~10 ms
            # of CPU), a cost of starting an agent program, not of its calls (docs/benchmarks.md)
            clients = [openai.AsyncOpenAI(base_url=base, api_key="bench", max_retries=0, timeout=600)
                       for _ in eps]
            t0 = time.perf_counter()
            done = await asyncio.gather(*(one(i, ep, c) for i, (ep, c) in enumerate(zip(eps, clients, strict=True))))
            wall = time.perf_counter() - t0
            await asyncio.gather(*(c.close() for c in clients))
            await asyncio.gather(*(h.post(f"/episodes/{ep['id']}/end", json={"reward": 0.0}) for ep in eps))
        return {"wall_s": wall, "episodes": done}
    out.send(asyncio.run(main()))


def make_cfg(tmp: Path, model_dir: Path, shm: str, n: int, port: int):
    from laminar.config import parse_config
    data = tmp / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i:04d} tell me a long story", "answer": ""}) + "\n"
                            for i in range(4096)))
    roles = [{"role": r, "port": free_port()} for r in ("prompt_pool", "partial_pool", "experience_buffer",
                                                          "gateway", "rollout")]
    return parse_config({
        "run": {"workdir": str(tmp / "run")},
        "cluster": {"keys_dir": None, "shutdown_s": 30, "broker": {"host": "h0"},
                    "hosts": {"h0": {"address": "127.0.0.1", "roles": roles}}},
        "roles": {"prompt_pool": {"dataset": str(data), "group_size": 1, "max_tokens": 2048},
                  "gateway": {"http_port": port},
                  "rollout": {"model_dir": str(model_dir), "shm_dir": shm, "max_concurrency": n, "seed": 0,
                              "max_model_len": 2048, "stop_when_exhausted": False, "idle_wait_s": 0.1,
                              "agent": {"max_calls": 64}}}})


async def gateway_round(base: str, n: int, calls: int, max_tokens: int, seed: int, publish) -> dict:
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    p = ctx.Process(target=agents, args=(base, n, calls, max_tokens, seed, theirs))
    p.start()
    pub = asyncio.ensure_future(publish())
    try:
        while not mine.poll():
            await asyncio.sleep(0.05)  # the cluster runs on this loop while the agents work
        res = mine.recv()
    finally:
        pub.cancel()
        p.join(30)
    return res


async def stored(cluster, ids: set[str]) -> dict:
    from laminar.protocol import SampleGroups
    buf, got = cluster.client("experience_buffer"), {}
    async with asyncio.timeout(300):
        while not ids <= set(got):
            s = await buf.call(SampleGroups(64, 10**6))
            got.update({t.spec.trajectory_id: t for g in s.groups for t in g})
            if not s.groups:
                await asyncio.sleep(0.1)  # polling the buffer for the stored episodes
    return got


async def direct_round(engine, trajs: dict, eps: list[dict]) -> tuple[float, int]:
    """The same calls straight to the engine: each call's context read from its trajectory."""
    from laminar.roles.rollout.engine import Sampling

    async def one(ep) -> int:
        t = trajs[ep["id"]]
        prompt, toks = [int(x) for x in t.spec.prompt_tokens], [int(x) for x in t.response_tokens]
        spans, n = t.obs_spans.tolist(), 0
        for k, (_, start) in enumerate(spans):
            end = spans[k + 1][0] if k + 1 < len(spans) else len(toks)
            async for out, _, _ in engine.generate(f"direct-{ep['id']}-{k}-{time.time_ns()}", prompt + toks[:start],
                                                   end - start, ep["seeds"][k], Sampling(temperature=1.0)):
                n += len(out)
        return n
    t0 = time.perf_counter()
    n = sum(await asyncio.gather(*(one(ep) for ep in eps)))
    return time.perf_counter() - t0, n


async def run(a) -> dict:
    from laminar.models.tiny import build_tiny_model
    from laminar.testing.inproc_cluster import InprocCluster
    from laminar.weights.local_write import write_version
    from laminar.weights.store import ShmStore
    tmp = Path(tempfile.mkdtemp(prefix="agent-gateway-bench-"))
    model_dir = build_tiny_model(tmp / "model", seed=3, init_std=0.5)
    from safetensors.torch import load_file
    sd = load_file(str(model_dir / "model.safetensors"))
    shm = f"/dev/shm/laminar-bench-agent-{os.getpid()}"
    store = ShmStore(shm, retain=4)
    store.open()
    write_version(store, sd, 1)
    port = free_port()
    cluster = InprocCluster(make_cfg(tmp, model_dir, shm, a.episodes, port))
    version = [1]

    async def publish():
        while True:
            await asyncio.sleep(a.publish_s)
            version[0] += 1
            await asyncio.to_thread(write_version, store, {k: v + 0.001 * version[0] for k, v in sd.items()},
                                    version[0])
    base = f"http://127.0.0.1:{port}/v1"
    rows, out = [], {"gateway": [], "direct": []}
    mixed = episodes = 0
    try:
        for r in ("prompt_pool", "partial_pool", "experience_buffer", "gateway", "rollout"):
            await cluster.start(r)
        rollout = cluster.roles["rollout.0"]
        # warm-up: one whole batch (a rollout opens its next batch's episodes once all of one ended)
        await gateway_round(base, a.episodes, 1, 8, 1, publish)
        for rnd in range(a.rounds):
            res = await gateway_round(base, a.episodes, a.calls, a.max_tokens, 100 + rnd * 10**6, publish)
            tokens = sum(e["tokens"] for e in res["episodes"])
            trajs = await stored(cluster, {e["id"] for e in res["episodes"]})
            for e in res["episodes"]:
                t = trajs[e["id"]]
                mixed += len(set(e["versions"])) != 1 or e["versions"][0] != f"laminar-v{t.version}"
            episodes += len(res["episodes"])
            wall, direct_tokens = await direct_round(rollout.engine, trajs, res["episodes"])
            out["gateway"].append(tokens / res["wall_s"])
            out["direct"].append(direct_tokens / wall)
            rows.append([rnd, tokens, round(res["wall_s"], 2), round(tokens / res["wall_s"]), direct_tokens,
                         round(wall, 2), round(direct_tokens / wall)])
    finally:
        await cluster.close()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    print_table("agent gateway vs direct engine", ["round", "gw tokens", "gw s", "gw tok/s", "direct tokens",
                                                   "direct s", "direct tok/s"], rows)
    g, d = sum(out["gateway"]) / len(out["gateway"]), sum(out["direct"]) / len(out["direct"])
    return {"gateway_tokens_per_s": g, "direct_tokens_per_s": d, "gateway_over_direct": g / d,
            "episodes": episodes, "version_mixed_episodes": mixed, "versions_published": version[0],
            "settings": vars(a), "rounds": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=16, help="agents (and episodes) at once")
    ap.add_argument("--calls", type=int, default=3, help="chat calls per episode")
    ap.add_argument("--max-tokens", type=int, default=64, help="completion tokens per call")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of gateway and direct")
    ap.add_argument("--publish-s", type=float, default=2.0, help="a new weight version this often")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args()
    exit_on_signals()
    try:  # the cluster's loop as a role's (laminar/shell.py): uvloop when it is installed
        import uvloop
        loop_run = uvloop.run
    except ImportError:
        loop_run = asyncio.run
    res = loop_run(run(a))
    print(f"gateway/direct {res['gateway_over_direct']:.3f}  episodes {res['episodes']}  "
          f"version-mixed episodes {res['version_mixed_episodes']}")
    write_json(a.out, res)
    return 0 if res["version_mixed_episodes"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
