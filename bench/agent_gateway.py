"""Agent gateway benchmark: tokens/s of agent episodes through the gateway (the real `openai` client),
over the same requests sent straight to the engine.

    python bench/agent_gateway.py [--episodes 16] [--calls 6] [--max-tokens 64[,256,...]] [--rounds 12] [--out FILE]

One process holds the cluster (prompt pool, partial pool, buffer, gateway, one vLLM CPU rollout in
agent mode, the tiny model; its weights from a relay folder this program writes, a new version
every `--publish-s` seconds all along); the agents run in a child process (their event loop apart
from the cluster's), `--episodes` at once, each claiming an episode and making `--calls` chat
calls of up to `--max-tokens` tokens, every call with its own seed.

A round times both sides once, the gateway first in even rounds and the direct side first in odd
ones. Before each side the rollout's next batch is open (the last one stored) and the engine's
prefix cache is emptied, so neither side reuses prompts the other computed.

- gateway: completion tokens of all calls / wall time from the first call to the last reply (the
  episodes are claimed and the agents' clients built before, the episodes ended after);
- direct: the calls of the latest gateway round again (that round's own in even rounds, the one
  before in odd ones), straight to the same engine (`engine.generate`), each with the context the
  engine saw for it through the gateway (read back from the stored trajectories), the same seed
  and as many tokens (`ignore_eos`), asked for whole as the gateway's non-streamed calls ask
  (`Sampling.whole`: vLLM gives the output at its end), `--episodes` sequences of calls at once
  -> tokens / wall time;
- `gateway_over_direct`: the median over the rounds of each round's gateway / direct tokens/s;
  `gateway_over_direct_spread` (max - min) / median of the rounds' ratios, `_iqr` their
  interquartile range / median, `_rounds` each one;
- per side, the CPU per call of the agents' process, this one and the engine's (each round's and
  the medians), of it this process's full garbage collections (`gc_full`), and the partial pool's
  commits during each gateway side. What the cluster holds once its roles are up (vLLM, torch, the
  engine) is frozen out of the collector (`gc.freeze`), as each role's own process does after its
  setup (laminar/shell.py): unfrozen, a full collection would walk all of it, in whichever side
  it fell;
- `episodes`: episodes the agents completed; `version_mixed_episodes`: episodes whose calls were
  not all served by one version, or whose stored trajectory names another (must be 0).

Call lengths. `--max-tokens` takes a list (`64,256`): `--rounds` rounds at each length in turn, each
length summarised apart (`by_max_tokens`, `gateway_over_direct_by_max_tokens`); `gateway_over_direct`
is the first length's. Per length, `path_cpu_ms_per_call_by_max_tokens`: the CPU per call of this
process and the engine's through the gateway, less the same on the direct side (the agents' client
apart); with two lengths or more, a line through those over the tokens a call made splits it into
`path_cpu_ms_fixed_per_call` (what a call costs whatever its length: HTTP, the bus hop, rendering,
the pool write) and `path_cpu_ms_per_token`. Each length must fit the model: `calls` calls of that
many tokens, their observations and the prompt within the rollout's max_model_len and the prompt
pool's response budget (checked before anything starts).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import GcClock, cpu_split, exit_on_signals, free_port, print_table, run_loop, spread_of, write_json  # noqa: E402


def agents(base: str, conn) -> None:
    """The child process: the agents of one round per command `(n, calls, max_tokens, seed)` on `conn`
    (None ends it); each round's results go back on `conn`. One process for every round: importing
    `openai` is paid once, and the agents' event loop stays apart from the cluster's."""
    import httpx
    import openai

    async def claim(h) -> dict:
        deadline = time.monotonic() + 180  # 503 "no_episode": the rollout's next batch is not open yet
        while True:
            r = await h.post("/episodes", json={"wait_s": 60})
            if r.status_code != 503 or time.monotonic() > deadline:
                r.raise_for_status()
                return r.json()

    async def one(i: int, ep: dict, client, calls: int, max_tokens: int, seed: int) -> dict:
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

    async def round_(n: int, calls: int, max_tokens: int, seed: int) -> dict:
        async with httpx.AsyncClient(base_url=base, timeout=600) as h:
            eps = await asyncio.gather(*(claim(h) for _ in range(n)))  # claimed first: the clock is the calls'
            # one client per agent, built before the clock: building one makes an SSL context (~10 ms
            # of CPU), a cost of starting an agent program, not of its calls (docs/benchmarks.md)
            clients = [openai.AsyncOpenAI(base_url=base, api_key="bench", max_retries=0, timeout=600)
                       for _ in eps]
            conn.send("claimed")
            conn.recv()  # "go": the cluster is settled (nothing else on this loop meanwhile)
            t0, c0 = time.perf_counter(), time.process_time()
            done = await asyncio.gather(*(one(i, ep, c, calls, max_tokens, seed)
                                          for i, (ep, c) in enumerate(zip(eps, clients, strict=True))))
            conn.send({"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, "episodes": done})
            await asyncio.gather(*(c.close() for c in clients))
            await asyncio.gather(*(h.post(f"/episodes/{ep['id']}/end", json={"reward": 0.0}) for ep in eps))
        conn.send("ended")

    for cmd in iter(conn.recv, None):
        asyncio.run(round_(*cmd))


class CpuClock:
    """CPU seconds since it was made, of this process (the roles, the pools, vLLM's client side) and
    of the engine's processes (its children but `exclude`, the agents' process), and the seconds
    this process spent in full garbage collections meanwhile (`gc_full`, part of `here`)."""

    def __init__(self, exclude: int | None = None):
        self.exclude = exclude
        self.gc = GcClock()
        self.t0 = self._now()

    def _now(self) -> tuple[float, float]:
        return cpu_split(self.exclude)

    def read(self) -> dict:
        now = self._now()
        self.gc.close()
        return {"here": now[0] - self.t0[0], "engine": now[1] - self.t0[1], "gc_full": self.gc.total}


def _wake(ready: asyncio.Future) -> None:
    if not ready.done():
        ready.set_result(None)


class Agents:
    """The agents' process, driven round by round from the cluster's loop."""

    def __init__(self, base: str):
        ctx = multiprocessing.get_context("spawn")
        self.mine, theirs = ctx.Pipe()
        self.p = ctx.Process(target=agents, args=(base, theirs), daemon=True)
        self.p.start()

    async def _recv(self):
        """The agents' next message, the cluster running on this loop meanwhile. It waits on the pipe
        and on the process's sentinel, not by polling: a poll every 10 ms was a hundred wake-ups a
        second charged to the gateway side's CPU alone (the direct side waits on nothing)."""
        loop, fds = asyncio.get_running_loop(), (self.mine.fileno(), self.p.sentinel)
        while not self.mine.poll():
            if not self.p.is_alive():
                raise RuntimeError(f"the agents' process exited ({self.p.exitcode}); its error is above")
            ready = loop.create_future()
            for fd in fds:
                loop.add_reader(fd, _wake, ready)
            try:
                await ready
            finally:
                for fd in fds:
                    loop.remove_reader(fd)
        try:
            return self.mine.recv()
        except EOFError:  # its end of the pipe closed: it exited
            self.p.join(5)
            raise RuntimeError(f"the agents' process exited ({self.p.exitcode}); its error is above") from None

    async def round(self, n: int, calls: int, max_tokens: int, seed: int, settle) -> dict:
        """One round: the agents claim their episodes, `settle()` runs, then the timed calls (with
        the CPU this process and the engine's used meanwhile), then the agents end their episodes."""
        self.mine.send((n, calls, max_tokens, seed))
        if await self._recv() != "claimed":
            raise RuntimeError("the agents' process did not claim its episodes")
        await settle()
        cpu = CpuClock(exclude=self.p.pid)
        self.mine.send("go")
        res = await self._recv()
        res["cpu_s"] = {"agents": res["cpu_s"], **cpu.read()}
        if await self._recv() != "ended":
            raise RuntimeError("the agents' process did not end its episodes")
        return res

    def close(self) -> None:
        if self.p.is_alive():
            self.mine.send(None)
        self.p.join(30)
        if self.p.is_alive():
            self.p.kill()


MAX_MODEL_LEN = 2048     # the rollout's (the tiny model's max_position_embeddings)
RESPONSE_BUDGET = 2048   # the prompt pool's max_tokens: response tokens of an episode, observations included
PROMPT = "{:04d} tell me a long story"


def context_need(calls: int, max_tokens: int) -> dict:
    """Tokens an episode of `calls` calls of `max_tokens` tokens takes at most with the tiny model's
    chat format (its byte codec): its context at the last call's end, and its response (the context
    less the first call's prompt)."""
    from laminar.chat import ChatFormat
    fmt = ChatFormat.load(None)
    msgs = [{"role": "user", "content": PROMPT.format(4095)}]
    prompt = len(fmt.encode(fmt.render(msgs)))
    for _ in range(calls - 1):
        msgs += [{"role": "assistant", "content": "x" * max_tokens}, {"role": "user", "content": "go on"}]
    context = len(fmt.encode(fmt.render(msgs))) + max_tokens
    return {"context": context, "response": context - prompt}


def check_fits(calls: int, lengths: list[int]) -> None:
    """Refuse a call length whose episodes would not fit (the last calls would be cut short)."""
    for mt in lengths:
        need = context_need(calls, mt)
        if need["context"] > MAX_MODEL_LEN or need["response"] > RESPONSE_BUDGET:
            raise SystemExit(f"--max-tokens {mt}: {calls} calls need a context of {need['context']} tokens "
                             f"({need['response']} response tokens); the rollout's max_model_len is {MAX_MODEL_LEN} "
                             f"and the prompt pool's budget {RESPONSE_BUDGET}: fewer --calls or shorter calls")


def cluster_cfg(tmp: Path, n: int, port: int, engine: dict):
    """The bench's cluster (prompt pool, partial pool, buffer, gateway, one rollout in agent mode)
    with `engine`'s rollout settings (its model, or the simulator's engine)."""
    from laminar.config import parse_config
    data = tmp / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": PROMPT.format(i), "answer": ""}) + "\n"
                            for i in range(4096)))
    roles = [{"role": r, "port": free_port()} for r in ("prompt_pool", "partial_pool", "experience_buffer",
                                                          "gateway", "rollout")]
    return parse_config({
        "run": {"workdir": str(tmp / "run")},
        "cluster": {"keys_dir": None, "shutdown_s": 30, "broker": {"host": "h0"},
                    "hosts": {"h0": {"address": "127.0.0.1", "roles": roles}}},
        "roles": {"prompt_pool": {"dataset": str(data), "group_size": 1, "max_tokens": RESPONSE_BUDGET},
                  "gateway": {"http_port": port},
                  "rollout": {**engine, "max_concurrency": n, "seed": 0,
                              "max_model_len": MAX_MODEL_LEN, "stop_when_exhausted": False, "idle_wait_s": 0.1,
                              "agent": {"max_calls": 64}}}})


def make_cfg(tmp: Path, model_dir: Path, shm: str, n: int, port: int):
    return cluster_cfg(tmp, n, port, {"model_dir": str(model_dir), "shm_dir": shm})


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
    """The same calls straight to the engine: each call's context read from its trajectory, and as
    many tokens as it had (`ignore_eos`: the batch holds the same sequences, step by step), asked
    for whole as the agent call asked (roles/rollout/agent_call.py: a non-streamed call without stop
    strings), so both sides make the same requests of the engine."""
    from laminar.roles.rollout.engine import Sampling

    async def one(ep) -> int:
        t = trajs[ep["id"]]
        prompt, toks = [int(x) for x in t.spec.prompt_tokens], [int(x) for x in t.response_tokens]
        spans, n = t.obs_spans.tolist(), 0
        for k, (_, start) in enumerate(spans):
            end = spans[k + 1][0] if k + 1 < len(spans) else len(toks)
            async for out, _, _ in engine.generate(f"direct-{ep['id']}-{k}-{time.time_ns()}", prompt + toks[:start],
                                                   end - start, ep["seeds"][k],
                                                   Sampling(temperature=1.0, ignore_eos=True, whole=True)):
                n += len(out)
        return n
    t0 = time.perf_counter()
    n = sum(await asyncio.gather(*(one(ep) for ep in eps)))
    return time.perf_counter() - t0, n


class Bench:
    """The cluster, the agents and the engine of one run; its rounds."""

    def __init__(self, a, cluster, agents: Agents):
        self.a, self.cluster, self.agents = a, cluster, agents
        self.engine = cluster.roles["rollout.0"].engine
        self.book = cluster.roles["gateway.0"].book
        self.pool = cluster.roles["partial_pool.0"].store  # its commits: how well the calls' writes group
        self.episodes = self.mixed = self.cache_kept = 0

    async def settle(self) -> None:
        """Before each side: the rollout's next batch open (the last one stored, its weights loaded),
        and the engine's prefix cache empty, so neither side reuses the other's prompts."""
        async with asyncio.timeout(300):
            while len(self.book.unclaimed) < self.a.episodes:
                await asyncio.sleep(0.05)  # the rollout opens its next batch
        await self.empty_cache()

    async def empty_cache(self) -> None:
        """The engine's prefix cache emptied (vLLM declines while a request runs: counted)."""
        self.cache_kept += not await self.engine.llm.reset_prefix_cache()

    async def gateway(self, calls: int, max_tokens: int, seed: int) -> tuple[dict, dict]:
        """A round of agents through the gateway: (their results, the stored trajectories)."""
        commits = self.pool.commits
        res = await self.agents.round(self.a.episodes, calls, max_tokens, seed, self.empty_cache)
        res["pool_commits"] = self.pool.commits - commits  # the calls' (and the periodic flushes')
        trajs = await stored(self.cluster, {e["id"] for e in res["episodes"]})
        for e in res["episodes"]:
            self.mixed += len(set(e["versions"])) != 1 or e["versions"][0] != f"laminar-v{trajs[e['id']].version}"
        return res, trajs

    async def direct(self, res: dict, trajs: dict) -> tuple[float, int, dict]:
        await self.settle()
        cpu = CpuClock(exclude=self.agents.p.pid)
        wall, tokens = await direct_round(self.engine, trajs, res["episodes"])
        n_calls = sum(len(e["seeds"]) for e in res["episodes"])
        return wall, tokens, {k: 1000 * v / n_calls for k, v in cpu.read().items()}

    async def rounds(self) -> list[dict]:
        """Warm-up, then `--rounds` rounds at each call length in turn, the gateway first in even ones
        and the direct side first in odd ones (replaying the latest gateway round's calls, of the
        same length: each length starts with a gateway-first round)."""
        a, out = self.a, []
        last = await self.gateway(1, 8, 1)  # warm-up of both paths, not counted
        await self.direct(*last)
        for k, mt in enumerate(a.max_tokens):
            for rnd in range(a.rounds):
                row, last = await self.round(rnd, mt, 100 + (k * a.rounds + rnd) * 10**6, last)
                out.append(row)
        return out

    async def round(self, rnd: int, max_tokens: int, seed: int, last) -> tuple[dict, tuple]:
        """One round at `max_tokens` a call: its row, and its gateway side (the next round's `last`)."""
        a = self.a
        if rnd % 2:
            d_wall, d_tokens, d_cpu = await self.direct(*last)
            last = await self.gateway(a.calls, max_tokens, seed)
        else:
            last = await self.gateway(a.calls, max_tokens, seed)
            d_wall, d_tokens, d_cpu = await self.direct(*last)
        res = last[0]
        self.episodes += len(res["episodes"])
        g_tokens = sum(e["tokens"] for e in res["episodes"])
        g, d = g_tokens / res["wall_s"], d_tokens / d_wall
        n_calls = sum(len(e["seeds"]) for e in res["episodes"])
        row = {"round": rnd, "max_tokens": max_tokens, "order": "direct,gateway" if rnd % 2 else "gateway,direct",
               "gateway_tokens": g_tokens, "gateway_s": res["wall_s"], "gateway_tokens_per_s": g,
               "gateway_tokens_per_call": g_tokens / n_calls,
               "direct_tokens": d_tokens, "direct_s": d_wall, "direct_tokens_per_s": d,
               "gateway_over_direct": g / d, "pool_commits": res["pool_commits"],
               "gateway_cpu_ms_per_call": {k: 1000 * v / n_calls for k, v in res["cpu_s"].items()},
               "direct_cpu_ms_per_call": d_cpu}
        print(f"round {rnd} ({max_tokens} tokens a call, {row['order']}): gateway {g:.0f} tokens/s, direct {d:.0f}, "
              f"ratio {g / d:.3f}", flush=True)
        return row, last


def summary(rows: list[dict]) -> dict:
    """The median ratio over the rounds, how far the rounds scatter around it ((max - min) / median
    and the interquartile range / median, as bench/rollout.py reports) and each round's; the
    median CPU per call of each side, by process."""
    ratios = [r["gateway_over_direct"] for r in rows]
    s = spread_of(ratios)
    return {"gateway_over_direct": s["median"], "gateway_over_direct_spread": s["spread"],
            "gateway_over_direct_iqr": s["iqr"], "gateway_over_direct_range": [s["min"], s["max"]],
            "gateway_over_direct_rounds": ratios,
            "gateway_tokens_per_s": statistics.median(r["gateway_tokens_per_s"] for r in rows),
            "direct_tokens_per_s": statistics.median(r["direct_tokens_per_s"] for r in rows),
            "gateway_cpu_ms_per_call": _medians([r["gateway_cpu_ms_per_call"] for r in rows]),
            "direct_cpu_ms_per_call": _medians([r["direct_cpu_ms_per_call"] for r in rows])}


def path_cpu_ms(row: dict) -> float:
    """The gateway path's CPU in one round: this process's and the engine's per call through the
    gateway, less the same on the direct side (the agents' client is counted apart)."""
    g, d = row["gateway_cpu_ms_per_call"], row["direct_cpu_ms_per_call"]
    return g["here"] + g["engine"] - d["here"] - d["engine"]


def by_max_tokens(rows: list[dict], lengths: list[int]) -> dict:
    """The summary of the first call length (the default's), each length's, and with two lengths or
    more the path's CPU per call split into a fixed part and a part per token (a least-squares line
    through each length's median path CPU over its median tokens per call)."""
    per = {mt: [r for r in rows if r["max_tokens"] == mt] for mt in lengths}
    each = {str(mt): summary(rs) for mt, rs in per.items()}
    out = {**each[str(lengths[0])], "by_max_tokens": each,
           "gateway_over_direct_by_max_tokens": {k: v["gateway_over_direct"] for k, v in each.items()}}
    path = {mt: statistics.median(path_cpu_ms(r) for r in rs) for mt, rs in per.items()}
    out["path_cpu_ms_per_call_by_max_tokens"] = {str(mt): v for mt, v in path.items()}
    if len(lengths) >= 2:
        xs = [statistics.median(r["gateway_tokens_per_call"] for r in per[mt]) for mt in lengths]
        slope, fixed = statistics.linear_regression(xs, [path[mt] for mt in lengths])
        out["path_cpu_ms_fixed_per_call"], out["path_cpu_ms_per_token"] = fixed, slope
    return out


def _medians(dicts: list[dict]) -> dict:
    return {k: statistics.median(d[k] for d in dicts) for k in dicts[0]}


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

    async def publish():  # all along, so both sides share its cost; episodes see versions come
        while True:
            await asyncio.sleep(a.publish_s)
            version[0] += 1
            await asyncio.to_thread(write_version, store, {k: v + 0.001 * version[0] for k, v in sd.items()},
                                    version[0])
    agents_ = Agents(f"http://127.0.0.1:{port}/v1")
    pub = None
    try:
        for r in ("prompt_pool", "partial_pool", "experience_buffer", "gateway", "rollout"):
            await cluster.start(r)
        gc.freeze()  # what each role's own process does once its setup is done (laminar/shell.py when_ready)
        pub = asyncio.ensure_future(publish())
        bench = Bench(a, cluster, agents_)
        rows = await bench.rounds()
    finally:
        if pub is not None:
            pub.cancel()
        agents_.close()
        await cluster.close()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    cpu = lambda c: "+".join(f"{c[k]:.1f}" for k in ("agents", "here", "engine") if k in c)  # noqa: E731
    print_table("agent gateway vs direct engine (CPU ms per call: agents' process + this one + the engine's)",
                ["round", "order", "gw tokens", "gw s", "gw tok/s", "direct tokens", "direct s", "direct tok/s",
                 "ratio", "pool commits", "gw CPU", "direct CPU"],
                [[r["round"], r["order"], r["gateway_tokens"], round(r["gateway_s"], 2),
                  round(r["gateway_tokens_per_s"]), r["direct_tokens"], round(r["direct_s"], 2),
                  round(r["direct_tokens_per_s"]), round(r["gateway_over_direct"], 3), r["pool_commits"],
                  cpu(r["gateway_cpu_ms_per_call"]), cpu(r["direct_cpu_ms_per_call"])] for r in rows])
    return {**by_max_tokens(rows, a.max_tokens), "episodes": bench.episodes, "version_mixed_episodes": bench.mixed,
            "prefix_cache_not_emptied": bench.cache_kept,
            "versions_published": version[0], "settings": vars(a), "rounds": rows}


def _lengths(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a number of tokens, or numbers separated by commas") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every length must be at least 1")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=16, help="agents (and episodes) at once")
    ap.add_argument("--calls", type=int, default=6, help="chat calls per episode")
    ap.add_argument("--max-tokens", type=_lengths, default=[64],
                    help="completion tokens per call; a list (64,256) runs --rounds rounds at each")
    ap.add_argument("--rounds", type=int, default=12, help="rounds, each timing one gateway and one direct side")
    ap.add_argument("--publish-s", type=float, default=2.0, help="a new weight version this often")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args()
    check_fits(a.calls, a.max_tokens)
    exit_on_signals()
    res = run_loop(run(a))  # the cluster's loop as a role's
    if len(a.max_tokens) > 1:
        print("gateway/direct by call length: " + ", ".join(
            f"{k} tokens {v:.3f}" for k, v in res["gateway_over_direct_by_max_tokens"].items())
              + f"; path CPU {res['path_cpu_ms_fixed_per_call']:.2f} ms a call + "
                f"{1000 * res['path_cpu_ms_per_token']:.1f} us a token")
    print(f"gateway/direct {res['gateway_over_direct']:.3f} (median of {a.rounds} rounds; spread "
          f"{res['gateway_over_direct_spread']:.3f}, IQR {res['gateway_over_direct_iqr']:.3f})  "
          f"episodes {res['episodes']}  "
          f"version-mixed episodes {res['version_mixed_episodes']}")
    write_json(a.out, res)
    return 0 if res["version_mixed_episodes"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
