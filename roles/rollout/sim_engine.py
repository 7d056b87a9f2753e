"""SimEngine: a simulated vLLM behind the `RolloutEngine` interface (docs/sim.md).

    engine = SimEngine.from_workload(model="32B", tp=4, lengths="32B_math", max_num_seqs=1024,
                                     clock=CompressedClock(speedup=50))
    await engine.start()
    async for toks, lps, finish in engine.generate("t0#r0.1", prompt, max_tokens=16384, seed=7):
        ...                      # cancel the consuming task to abort the request, as with vLLM

What it models, like vLLM v1's scheduler (continuous batching, FCFS):
- one scheduler loop; every step advances each running request by one token and costs the step
  curve's time at the current batch size, plus prefill time for the prompt tokens admitted in
  that step (a per-step budget of `max_batched_tokens` spreads prefill like chunked prefill);
- a paged KV cache of `kv_capacity_tokens` in blocks of `block_size` tokens; `kv_usage` = blocks
  held / blocks (what vLLM reports). With prefix caching (vLLM's default) the full blocks of a
  prompt are shared by every running request with that prompt (a GRPO group);
- waiting requests are admitted while blocks, `max_num_seqs` and the prefill budget allow;
  a running request that needs a block when none is free makes the newest running request be
  preempted (recompute: its blocks are freed, it returns to the head of the queue and prefills
  prompt + output again when readmitted), as vLLM's default preemption does.

Lengths: a request's total response length comes from the length distribution at a z derived
from its seed (lengths.z_from_key), so the same seed always means the same length, in any
process. The engine emits one constant token id; a resumed request (prompt + generated tokens as
its prompt, the remaining budget, the same seed) is recognised by the trailing run of that id,
so it stops at the same total length (a prompt that itself ends with that id would be miscounted
by that many tokens). Finish reason "stop" at the drawn length, "length" at `max_tokens` (or at
`max_model_len`). Without a seed the length is drawn from the engine's own generator, conditioned
on being longer than what the request already generated.

Time and cost: the scheduler advances in *macro-steps* of up to `emit_every` steps during which
the batch does not change except for requests finishing (each takes its exact steps; the time is
summed step by step with the batch shrinking, over numpy columns of the batch). Admissions,
preemptions and emission happen at macro-step boundaries, so Python work is O(running) per
`emit_every` steps, not per token; a new or finished request waits up to `emit_every` steps (~1 s
simulated) for its boundary. With `stream_batch` > 0 running requests stream only every
max(1, running // stream_batch) boundaries (finished ones at their own), so a batch of 1,024 costs
about `stream_batch` wake-ups per boundary; a small batch (a tail, what repack moves) streams at
every one. Tokens not streamed when a request is aborted are generated again by whoever resumes it
(vLLM streams every step: the simulator's price for speed). The loop keeps its own simulated
timeline and sleeps on a `Clock` until it (sim_clock.py; `max_lag_s`: the machine fell behind).

Scoring (`reward_cost`; None: free): a finished request is handed over only once scored, on a
scorer timeline of its own (roles/rollout/sim_scorer.py).

Weights: `load_relay` reads the newest version in the relay folder (LocalWeights) if the folder
exists, else counts versions itself; an exact load (run, lineage, version) checks the folder holds
those weights (newest or retained); `load_file` only costs time. Both cost `load_s` of
simulated time (the bf16 weights of one GPU over PCIe from host memory, see `from_workload`).
A scheduler that fails fails every stream with `SimEngineDead` (like vLLM's EngineDeadError);
`close()` fails outstanding streams with `SimEngineClosed`.
"""
from __future__ import annotations

import asyncio
import math
import os
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

import numpy as np
from laminar.roles.rollout.engine import EngineStats, RolloutEngine
from laminar.roles.rollout.sim_clock import Clock, CompressedClock, VirtualClock
from laminar.roles.rollout.sim_scorer import ScorerTimeline
from laminar.roles.rollout.sim_settings import SimRolloutSettings

from laminar.sim import load_workload
from laminar.sim.hardware import gpu as gpu_spec
from laminar.sim.hardware import kv_capacity_tokens
from laminar.sim.hardware import model as model_shape
from laminar.sim.latency import HOST_MS_PER_LAYER, decode_step_ms, kv_ms_per_token, model_curve, prefill_ms_per_token
from laminar.sim.lengths import LengthDistribution, workload_lengths, z_from_key
from laminar.sim.reward_cost import RewardCost
from laminar.stepcurve import StepCurve

_N = NormalDist()
__all__ = ["Clock", "CompressedClock", "SimEngine", "SimEngineClosed", "SimEngineDead", "VirtualClock"]


class SimEngineClosed(RuntimeError):
    """The engine was closed with the request outstanding."""


class SimEngineDead(RuntimeError):
    """The scheduler (or the scorer) failed: every stream fails with it."""


# -- requests -----------------------------------------------------------------------------------
@dataclass(eq=False)
class _Request:
    id: str
    prompt_len: int          # tokens given as the prompt (an original prompt + earlier output)
    key: int                 # the original prompt (crc32, length): its prefix-cache entry
    shared_blocks: int       # full blocks of the original prompt (0 without prefix caching)
    target: int              # tokens this request generates
    finish: str              # finish reason at target
    response_tokens: int = 0  # the whole response at target (earlier attempts' output included): what is scored
    generated: int = 0
    emitted: int = 0
    blocks: int = 0          # private blocks held (0 while waiting)
    in_cache: bool = False   # holds a reference on the shared prefix entry
    done: bool = False
    error: BaseException | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def held(self) -> int:
        return self.prompt_len + self.generated


def _ceil_div(a, b):
    return -(-a // b)


class SimEngine(RolloutEngine):
    def __init__(self, *, curve: StepCurve, lengths: LengthDistribution, kv_capacity_tokens: int,
                 prefill_ms_per_token: float, max_num_seqs: int = 1024, max_model_len: int | None = None,
                 block_size: int = 16, max_batched_tokens: int = 8192, emit_every: int = 32, stream_batch: int = 0,
                 prefix_caching: bool = True, group_correlation: float = 0.0, load_s: float = 1.0,
                 clock: Clock | None = None, token_id: int = 0, logprob: float = -0.5, seed: int = 0,
                 kv_ms_per_token: float = 0.0, curve_context: int = 4096, host_step_ms: float = 0.0,
                 host_ms_per_seq: float = 0.0, reward_cost: RewardCost | None = None):
        self.curve, self.lengths = curve, lengths
        # context dependence: every running sequence's KV is read once per step; the curve was
        # measured with `curve_context` tokens each, so a step is corrected by the KV bytes its
        # sequences really hold (`kv_ms_per_token` = one token's KV bytes per GPU ÷ HBM bandwidth),
        # never below the batch-1 time (the weights read). `host_step_ms`: the runtime's host-side
        # time per step (kernel dispatch), overlapped with the GPU's: a step takes the longer.
        # `host_ms_per_seq`: host work per running sequence after each step (sampled token's
        # logprob, detokenization, streaming to the client), not overlapped.
        self.kv_ms_per_token, self.curve_context, self.host_step_ms = kv_ms_per_token, curve_context, host_step_ms
        self.host_ms_per_seq = host_ms_per_seq
        self.reward_cost = reward_cost
        self.scoring: ScorerTimeline | None = None  # set at start() with a reward cost
        self._scorer: asyncio.Task | None = None
        self.block_size = block_size
        self.num_blocks = kv_capacity_tokens // block_size
        self.max_model_len = max_model_len or self.num_blocks * block_size
        if self.num_blocks < 1 or self.max_model_len > self.num_blocks * block_size:
            raise ValueError(f"sim engine: max_model_len {self.max_model_len} exceeds the KV cache "
                             f"({self.num_blocks} blocks of {block_size} tokens)")  # vLLM refuses too
        if not 0 <= group_correlation <= 1 or emit_every < 1 or max_num_seqs < 1:
            raise ValueError("sim engine: need 0 <= group_correlation <= 1, emit_every >= 1, max_num_seqs >= 1")
        self.prefill_s_per_token = prefill_ms_per_token / 1000.0
        self.max_num_seqs, self.max_batched_tokens, self.emit_every = max_num_seqs, max_batched_tokens, emit_every
        self.stream_batch, self._boundaries = stream_batch, 0
        self.prefix_caching, self.rho, self.load_s = prefix_caching, group_correlation, load_s
        self.clock = clock or CompressedClock(1.0)
        self.token_id, self.logprob, self.seed = token_id, logprob, seed
        self.stats = EngineStats()
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.free_blocks = self.num_blocks
        self._cache: dict[int, list[int]] = {}   # prompt key -> [references, blocks]
        self._ids: set[str] = set()
        self._rng = np.random.default_rng(seed)
        self._work = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._failure: BaseException | None = None
        self._versions = 0
        self._timeline = 0.0
        self._since_emit = 0
        self.counters = {"steps": 0, "macro_steps": 0, "tokens": 0, "prefill_tokens": 0, "finished": 0,
                         "aborted": 0, "preemptions": 0, "peak_kv_usage": 0.0, "max_lag_s": 0.0,
                         "scoring_s": 0.0}

    @classmethod
    def from_workload(cls, *, model: str, tp: int, lengths: str, gpu: str = "H800",
                      max_num_seqs: int = 1024, mem_fraction: float = 0.9, curve_path: str | None = None,
                      workload_path: str | None = None, max_output_tokens: int | None = None,
                      load_gbps: float = 25.0, host_ms_per_layer: float | None = None,
                      context_dependence: bool = True, reward_s_by_tokens=None, **kw) -> SimEngine:
        """Build from names: model '7B'/'32B'/'72B', `tp` GPUs of kind `gpu`, the workload's length
        statistics `lengths` (e.g. '32B_math'), the paper's step curve for <model>_TP<tp> (or the
        fitted roofline's where the paper has none, or `curve_path`, a measured curve); lengths are
        clipped to `max_output_tokens` (default: the workload's run_shape). load_s defaults to one
        GPU's share of the bf16 weights at `load_gbps` GB/s (PCIe from pageable host memory: ~40%
        of Gen5 x16). A step is corrected for the context it reads (`context_dependence`) and costs
        at least layers × `host_ms_per_layer` (default latency.HOST_MS_PER_LAYER; 0: off).
        `reward_s_by_tokens`: [[response tokens, seconds]] of scoring a trajectory (RewardCost;
        None: free). Other keywords go to the constructor."""
        m, g = model_shape(model), gpu_spec(gpu)
        workload = load_workload(workload_path)
        curve = StepCurve.load(curve_path) if curve_path else model_curve(model, tp, workload, gpu)
        kw.setdefault("load_s", m.weight_bytes() / tp / (load_gbps * 1e9))
        if context_dependence:
            kw.setdefault("kv_ms_per_token", kv_ms_per_token(m, g, tp))
        per_layer = HOST_MS_PER_LAYER if host_ms_per_layer is None else host_ms_per_layer
        kw.setdefault("host_step_ms", per_layer * m.layers)
        if reward_s_by_tokens:
            kw.setdefault("reward_cost", RewardCost.from_points(reward_s_by_tokens))
        return cls(curve=curve, lengths=workload_lengths(lengths, workload, max_output_tokens),
                   kv_capacity_tokens=kv_capacity_tokens(m, g, tp, mem_fraction),
                   prefill_ms_per_token=prefill_ms_per_token(m, g, tp), max_num_seqs=max_num_seqs, **kw)

    @classmethod
    def from_settings(cls, sim: SimRolloutSettings, *, max_num_seqs: int = 1024,
                      max_model_len: int | None = None) -> SimEngine:
        """From the rollout role's `sim` settings (the scenario writes them: model, tp, lengths,
        ..., and `speedup`, simulated seconds per real second, for its CompressedClock); a setting
        left out keeps this engine's default."""
        return cls.from_workload(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                 clock=CompressedClock(speedup=sim.speedup), **sim.engine_kwargs())

    # -- RolloutEngineAPI (roles/rollout/engine_api.py) ---------------------------------------------
    async def start(self) -> None:
        if self.reward_cost is not None and isinstance(self.clock, VirtualClock):
            raise ValueError("sim engine: a reward cost needs a CompressedClock (a VirtualClock has one sleeper)")
        self._timeline = self.clock.now()
        self._task = asyncio.create_task(self._run(), name="sim-engine-scheduler")
        if self.reward_cost is not None:
            self.scoring = ScorerTimeline(self.reward_cost, self.clock)
            self.scoring.until = self._timeline
            self._scorer = asyncio.create_task(self._score(), name="sim-engine-scorer")

    async def generate(self, request_id: str, prompt: list[int], max_tokens: int, seed: int | None,
                       sampling=None):
        if self._failure is not None:
            raise self._failure
        if self._task is None:
            raise RuntimeError("sim engine: generate() before start()")
        if request_id in self._ids:
            raise ValueError(f"sim engine: request {request_id!r} is already running")
        r = self._new_request(request_id, prompt, max_tokens, seed)
        self._ids.add(request_id)
        self.waiting.append(r)
        self._work.set()
        try:
            while True:
                await r.wake.wait()
                r.wake.clear()
                if r.error is not None:
                    raise r.error
                n = r.generated - r.emitted
                finished = r.done and r.generated >= r.target
                if n:
                    r.emitted += n
                    yield [self.token_id] * n, [self.logprob] * n, (r.finish if finished else None)
                if finished:
                    return
        finally:
            self._ids.discard(request_id)
            if not r.done:  # cancelled or closed by the consumer: abort, as vLLM does
                self._release(r)
                r.done = True
                self.counters["aborted"] += 1
                self._update_stats()

    async def load_relay(self, shm_dir: str, min_version: int, exact: tuple[str, int, int] | None = None) -> int:
        if os.path.isdir(shm_dir):
            from laminar.weights.pull import LocalWeights  # late: only when the simulated rollout reads a relay
            w = LocalWeights(shm_dir)
            if exact is not None:
                if not await asyncio.to_thread(w.has, exact):
                    return -1
                await self.clock.sleep(self.load_s)
                return int(exact[2]) if isinstance(exact, (tuple, list)) else exact
            version = await asyncio.to_thread(w.current_version)
            if version <= min_version:
                return -1
        else:
            version = self._versions = max(self._versions, min_version) + 1
        await self.clock.sleep(self.load_s)
        return version

    async def load_file(self, path: str) -> None:
        await self.clock.sleep(self.load_s)

    async def routing(self, asks: list[tuple[str, int, int]], drop: list[str]) -> list[tuple[int, Any] | None]:
        return [None] * len(asks)  # the simulator models no experts

    async def close(self) -> None:
        for task in (self._task, self._scorer):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._task = self._scorer = None
        self._failure = self._failure or SimEngineClosed("sim engine closed")
        self._fail_all(self._failure)

    # -- requests ---------------------------------------------------------------------------------
    def _new_request(self, request_id: str, prompt: list[int], max_tokens: int, seed: int | None) -> _Request:
        n = len(prompt)
        if n < 1 or max_tokens < 1:
            raise ValueError(f"sim engine: request {request_id!r} needs a prompt and max_tokens >= 1")
        if n >= self.max_model_len:
            raise ValueError(f"sim engine: prompt of {n} tokens does not fit max_model_len {self.max_model_len}")
        already = 0  # output of an earlier attempt, resumed as part of the prompt
        while already < n - 1 and prompt[n - 1 - already] == self.token_id:
            already += 1
        # the prefix-cache entry (and group) of the original prompt: its checksum and length
        key = zlib.crc32(np.asarray(prompt[:n - already], dtype=np.int64).tobytes()) | (n - already) << 32
        total = self._total_length(seed, key, already)
        rest = max(1, total - already)
        target, finish = (rest, "stop") if rest < max_tokens else (max_tokens, "length")
        if n + target > self.max_model_len:
            target, finish = self.max_model_len - n, "length"
        shared = (n - already) // self.block_size if self.prefix_caching else 0
        return _Request(request_id, n, key, shared, target, finish, response_tokens=already + target)

    def _total_length(self, seed: int | None, key: int, already: int) -> int:
        if seed is not None:
            z = z_from_key(seed, 2 * self.seed)
            if self.rho > 0:
                z = math.sqrt(self.rho) * z_from_key(key, 2 * self.seed + 1) + math.sqrt(1 - self.rho) * z
            return self.lengths.from_z(z)
        lo = self.lengths.cdf(already) if already else 0.0  # it was still running at `already`
        u = min(lo + (1 - lo) * self._rng.random(), 1 - 1e-12)
        return max(self.lengths.from_z(_N.inv_cdf(max(u, 1e-12))), already + 1)

    def _release(self, r: _Request) -> None:
        """Take `r` off its queue and free what it holds (O(queue): aborts and preemptions only)."""
        if r in self.running:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)
        self._free(r)

    def _free(self, r: _Request) -> None:
        self.free_blocks += r.blocks
        r.blocks = 0
        if r.in_cache:
            entry = self._cache[r.key]
            entry[0] -= 1
            if entry[0] == 0:
                self.free_blocks += entry[1]
                del self._cache[r.key]
            r.in_cache = False

    def _fail_all(self, exc: BaseException) -> None:
        scoring = self.scoring.drain() if self.scoring is not None else []
        for r in list(self.running) + list(self.waiting) + scoring:
            self._release(r)
            r.done, r.error = True, exc
            r.wake.set()

    # -- scheduler ----------------------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            while True:
                if not self.running and not self.waiting:
                    self._update_stats()
                    self._work.clear()
                    await self._work.wait()
                    self._timeline = max(self._timeline, self.clock.now())  # idle time is no credit
                    continue
                prefill = self._admit()
                k = self._steps_possible()
                while k == 0 and self.running:  # a running request needs a block: preempt the newest
                    self._preempt()
                    k = self._steps_possible()
                if not self.running:
                    raise RuntimeError("sim engine: nothing admissible although the cache is empty")
                self._update_stats()
                self._timeline += prefill * self.prefill_s_per_token + self._decode_s(k)
                lag = self.clock.now() - self._timeline
                self.counters["max_lag_s"] = max(self.counters["max_lag_s"], lag)
                await self.clock.sleep(-lag)
                self._advance(k)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._failure = SimEngineDead(f"sim engine scheduler failed: {exc!r}")
            self._fail_all(self._failure)
            raise

    def _admit(self) -> int:
        """Admit waiting requests (FCFS) while blocks, seats and the prefill budget allow."""
        prefill = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            cached = r.shared_blocks > 0 and r.key in self._cache
            new_shared = 0 if cached or not r.shared_blocks else r.shared_blocks
            private = _ceil_div(r.held, self.block_size) - r.shared_blocks
            tokens = r.held - (r.shared_blocks * self.block_size if cached else 0)
            if private + new_shared > self.free_blocks or (prefill and prefill + tokens > self.max_batched_tokens):
                break
            self.waiting.popleft()
            self.free_blocks -= private + new_shared
            r.blocks = private
            if r.shared_blocks:
                entry = self._cache.setdefault(r.key, [0, new_shared])
                entry[0] += 1
                r.in_cache = True
            self.running.append(r)
            prefill += tokens
        self.counters["prefill_tokens"] += prefill
        return prefill

    def _preempt(self) -> None:
        r = self.running.pop()
        self._free(r)
        self.waiting.appendleft(r)  # recomputed (prompt + output) when readmitted
        self.counters["preemptions"] += 1

    def _columns(self) -> tuple[np.ndarray, np.ndarray]:
        """(held, rest) of the running requests, in order: the tokens each holds and has still to make."""
        n = len(self.running)
        gen = np.fromiter((r.generated for r in self.running), np.int64, n)
        held = np.fromiter((r.prompt_len for r in self.running), np.int64, n) + gen
        return held, np.fromiter((r.target for r in self.running), np.int64, n) - gen

    def _steps_possible(self) -> int:
        """Steps until the next emission boundary, fewer if the free blocks run out before."""
        k = self.emit_every - self._since_emit
        held, rest = self._columns()
        base = _ceil_div(held, self.block_size)

        def need(steps: int) -> int:
            return int((_ceil_div(held + np.minimum(rest, steps), self.block_size) - base).sum())

        if need(k) <= self.free_blocks:
            return k
        lo, hi = 0, k  # need(lo) fits, need(hi) does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if need(mid) <= self.free_blocks else (lo, mid)
        return lo

    def _decode_s(self, k: int) -> float:
        """k steps, the batch shrinking as requests reach their target; each step at `step_ms`
        of its batch and the context its sequences hold (summed step by step, in order)."""
        held, rest = self._columns()
        n, order = len(rest), np.argsort(rest, kind="stable")
        left = np.zeros(n + 1, np.int64)  # left[i]: tokens held by the i requests that end first
        np.cumsum(held[order], out=left[1:])
        ended = np.searchsorted(rest[order], np.arange(1, k + 1), side="left").tolist()  # done before each step
        total, everyone = 0.0, int(left[-1])
        for step, i in enumerate(ended, start=1):
            if i == n:
                break
            total += self.step_ms(n - i, everyone - int(left[i]) + (n - i) * (step - 1))
        return total / 1000.0

    def step_ms(self, batch: int, context_tokens: float | None = None) -> float:
        """One decode step of `batch` sequences holding `context_tokens` tokens of KV in all (None:
        the curve's own context): latency.decode_step_ms with this engine's terms."""
        return decode_step_ms(self.curve, batch, context_tokens, kv_ms_per_token=self.kv_ms_per_token,
                              curve_context=self.curve_context, host_step_ms=self.host_step_ms,
                              host_ms_per_seq=self.host_ms_per_seq)

    def _advance(self, k: int) -> None:
        self._since_emit += k
        boundary = self._since_emit >= self.emit_every
        if boundary:
            self._since_emit = 0
            self._boundaries += 1
            if self.stream_batch > 0:  # stream running requests only every few boundaries (docstring)
                boundary = self._boundaries % max(1, len(self.running) // self.stream_batch) == 0
        held, rest = self._columns()  # the batch may have changed while the step slept (aborts)
        g = np.minimum(rest, k)
        new_blocks = _ceil_div(held + g, self.block_size) - _ceil_div(held, self.block_size)
        self.free_blocks -= int(new_blocks.sum())
        self.counters["tokens"] += int(g.sum())
        self.counters["steps"] += int(g.max()) if len(g) else 0
        self.counters["macro_steps"] += 1
        still = []  # then each request, as the arrays say
        for r, n, b, ends in zip(self.running, g.tolist(), new_blocks.tolist(), (g >= rest).tolist(), strict=True):
            r.blocks += b
            r.generated += n
            if ends:
                self._free(r)
                r.done = True
                self.counters["finished"] += 1
                if self.scoring is None:
                    r.wake.set()
                else:  # handed over once scored (sim_scorer.py), in the order they end
                    self.counters["scoring_s"] += self.scoring.add(r, self._timeline, r.response_tokens)
                continue
            still.append(r)
            if boundary:
                r.wake.set()
        self.running = still
        assert self.free_blocks >= 0, "sim engine: KV blocks over-allocated"
        self._update_stats()

    async def _score(self) -> None:
        """The scorer timeline's task; a failure fails every stream, as the scheduler's does."""
        try:
            await self.scoring.run()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._failure = SimEngineDead(f"sim engine scorer failed: {exc!r}")
            self._fail_all(self._failure)
            raise

    def _update_stats(self) -> None:
        s = self.stats
        s.kv_usage = (self.num_blocks - self.free_blocks) / self.num_blocks
        s.running, s.waiting, s.updated = len(self.running), len(self.waiting), time.monotonic()
        self.counters["peak_kv_usage"] = max(self.counters["peak_kv_usage"], s.kv_usage)

    def sim_stats(self) -> dict:
        """Counters plus the simulated time the scheduler has reached."""
        return {**self.counters, "sim_time_s": self._timeline, "kv_usage": self.stats.kv_usage, "running":
                len(self.running), "waiting": len(self.waiting), "free_blocks": self.free_blocks}
