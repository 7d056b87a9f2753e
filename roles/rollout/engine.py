"""The generation engine behind a rollout: vLLM's AsyncLLM, token ids in and out.

`RolloutEngine` is the small interface the rollout role drives (the simulator's engine implements
the same one): start, generate (an async stream of (new tokens, their logprobs, finish reason)),
load weights, scheduler statistics, close. Cancelling the task that consumes `generate` aborts
the request inside vLLM (AsyncLLM does that on CancelledError), which is how migration stops a
trajectory mid-way. Closing the stream early (`aclose`, a stop string) aborts it too; closing it
at its last output (the one with a finish reason, where agent calls and env turns stop reading)
lets vLLM's own stream end instead: vLLM aborts whatever stream is closed before its end, and an
abort of a finished request is one more message to the engine core and back for nothing.
A caller that takes only the whole output (`Sampling.whole`: a non-streamed agent call without
stop strings) gets it as one step at the end (vLLM's FINAL_ONLY): no output object, queue hand-off
and generator step per token in this process; the tokens and logprobs are the same.

vLLM is imported in `start()` only. The async engine spawns its engine-core process, so the
process hosting it needs the `__main__` guard, which the role shell provides.

Sharded engines (`tensor_parallel_size` > 1): vLLM runs one worker process per rank (on a GPU
each rank's GPU, on the CPU build each rank's OpenMP threads bound to its share of the
rollout's cores: `omp_threads_bind` "0|1" for two ranks on cores 0 and 1). Everything the role
sees is unchanged: one request stream, one abort, one set of scheduler statistics (KV usage is
the engine core's, over all ranks' blocks). A weight load reaches every rank as one version
(roles/rollout/rank_load.py): a rank that fails leaves every rank on the old weights.

GPU settings: `enforce_eager` None means CUDA graphs on a GPU (decode at small batch is bound by
kernel launches, which graphs remove) and eager on the CPU build; `gpu_memory_utilization` is
the share of each GPU the engine takes, the KV cache getting what weights and activations leave;
prefix caching lets a GRPO group's responses share their prompt's KV blocks. Every weight load
resets the prefix cache (blocks computed by the old weights are never reused under the new).

Seeded sampling on the CPU build: when vLLM splits a prompt's prefill over several steps
(chunked prefill: the batch's prompt tokens exceed `max_num_batched_tokens`), it rewinds a seeded
request's generator with `set_offset`, which torch's CPU generator does not support — the engine
core dies (EngineDeadError) and takes every request with it. So an engine whose requests carry
seeds (`seeded=True`) on the CPU runs without chunked prefill, with a step budget of at least one
whole sequence; a prompt then prefills in one step, and seeds reproduce as they should.

LoRA (`lora`: LoraServing, max_lora_rank and max_loras): the engine serves the model folder's weights as a frozen
base with vLLM's LoRA on, and a version is an adapter (roles/rollout/adapters.py): loading one
writes it to a folder of its own under a new adapter id, each request carries the adapter current
when it started (a trajectory is one version even while the next loads), and an adapter is removed
once no request uses it. The prefix cache is not reset on an adapter load: vLLM keys its blocks
by adapter, so no block of one version serves another.

Mixture-of-experts routing (`routing=True`, docs/moe.md): the engine records the experts it routes
each token to, and `routing(asks, drop)` hands out the rows of positions [start, end) of the requests
asked for. On the CPU build the worker extension captures them at every MoE layer's router
(roles/rollout/moe_worker.py), readable while a request runs; prefix caching is then off, so every
request computes (and records) its prompt itself. With CUDA, vLLM's own `enable_return_routed_experts`
returns them with a finished request (`CompletionOutput.routed_experts`, every decoder layer; the MoE
layers are kept); that path is gated and not exercised on the CPU.

Shared memory: the engine core and its worker create POSIX segments in /dev/shm (`psm_*`, the
message queues between them, 160 + 240 MiB with vLLM's defaults) and multiprocessing semaphores.
vLLM unlinks them on a clean shutdown only. The processes that appear while the engine starts are
this engine's; what they hold in /dev/shm is noted right after start, and `close()` removes what
is still there and held by no one else (an engine core that died or was killed). A rollout process
that is killed outright is cleaned up by whoever swept its process group (the supervisor).
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from laminar.roles.rollout.rank_load import load_on_ranks

from laminar.engine_settings import EngineSettings, LoraServing
from laminar.shm import ShmLedger, descendants
from laminar.weights.pull import LocalWeights

KV_BLOCK = 32  # tokens per KV block when the cache is sized in tokens (kv_cache_tokens)


@dataclass
class Sampling:
    """Per-request sampling that overrides the engine's own settings (agent calls: roles/rollout/agent.py).
    `top_logprobs` > 0 asks for that many alternatives per token, appended to `top` as
    {token id: logprob} (one dict per generated token). `ignore_eos`: generate `max_tokens` tokens
    whatever is sampled (bench/agent_gateway.py replays a call to the length it had). `whole`: the
    caller only takes the whole output, so the engine may give it as one step at its end (vLLM
    does; the simulator's engine still gives a step per token)."""
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int = 0
    top: list | None = None
    ignore_eos: bool = False
    whole: bool = False


@dataclass
class EngineStats:
    kv_usage: float = 0.0
    running: int = 0
    waiting: int = 0
    updated: float = 0.0


class RolloutEngine:
    stats: EngineStats

    async def start(self) -> None: ...

    def generate(self, request_id: str, prompt: list[int], max_tokens: int, seed: int | None,
                 sampling: Sampling | None = None) -> AsyncIterator[tuple[list[int], list[float], str | None]]: ...

    async def load_relay(self, shm_dir: str, min_version: int, exact: tuple[str, int, int] | None = None) -> int:
        """Load the relay's newest version if newer than min_version (or exactly the weights `exact`
        names, (run_id, lineage, version), newest or retained); its number, or -1 if there is none."""

    async def load_file(self, path: str) -> None: ...

    async def routing(self, asks: list[tuple[str, int, int]], drop: list[str]) -> list[tuple[int, Any] | None]:
        """MoE routing rows of positions [start, end) of each (request id, start, end) asked: (start,
        rows) of those the engine holds, None for none; then it forgets the requests in `drop`."""

    async def close(self) -> None: ...


def _stat_logger_class(stats: EngineStats):
    from vllm.v1.metrics.loggers import StatLoggerBase  # late: vLLM, loaded only in an engine process

    class LaminarStatLogger(StatLoggerBase):
        """Receives vLLM's scheduler statistics every engine step (the repack inputs)."""

        def __init__(self, vllm_config, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, *args, **kwargs) -> None:
            if scheduler_stats is not None:
                stats.kv_usage = float(scheduler_stats.kv_cache_usage)
                stats.running = int(scheduler_stats.num_running_reqs)
                stats.waiting = int(scheduler_stats.num_waiting_reqs)
                stats.updated = time.monotonic()

        def log_engine_initialized(self) -> None:
            pass

    return LaminarStatLogger


class VllmEngine(RolloutEngine):
    """vLLM's AsyncLLM, token ids in and out, on one GPU, several (tensor parallel) or the CPU."""

    def __init__(self, model_dir: str, *, max_model_len: int, max_num_seqs: int, kv_cache_gib: float,
                 temperature: float, top_p: float, dtype: str = "float32",
                 omp_threads_bind: str | None = None, seeded: bool = False, kv_cache_tokens: int | None = None,
                 tensor_parallel_size: int = 1, enforce_eager: bool | None = None,
                 gpu_memory_utilization: float = 0.9, enable_prefix_caching: bool = True,
                 lora: LoraServing | None = None, adapter_dir: str | None = None, routing: bool = False,
                 expert_parallel: bool = False):
        self.model_dir, self.max_model_len, self.max_num_seqs = model_dir, max_model_len, max_num_seqs
        self.seeded, self.kv_cache_tokens = seeded, kv_cache_tokens
        self.kv_cache_gib, self.temperature, self.top_p, self.dtype = kv_cache_gib, temperature, top_p, dtype
        self.omp_threads_bind = omp_threads_bind
        self.tensor_parallel_size, self.enforce_eager = tensor_parallel_size, enforce_eager
        self.gpu_memory_utilization, self.enable_prefix_caching = gpu_memory_utilization, enable_prefix_caching
        self.lora = lora  # versions are LoRA adapters (None: full weights)
        self.adapters = None
        if lora is not None:
            from laminar.roles.rollout.adapters import Adapters  # late: only with LoRA
            self.adapters = Adapters(model_dir, adapter_dir)
        self.stats = EngineStats()
        self.llm = None
        self.shm = None
        self.routing_on = routing      # record the MoE routing of every token (module docstring)
        self.expert_parallel = expert_parallel  # vLLM: experts spread over the ranks instead of split
        self.routing_info: dict = {}   # layers, top_k, experts, dtype of the rows (after start)
        self._finished_routing: dict[str, np.ndarray] = {}  # CUDA path: a finished request's rows
        self._cpu = True

    @classmethod
    def from_settings(cls, s: EngineSettings, *, max_num_seqs: int, temperature: float, top_p: float,
                      seeded: bool, omp_threads_bind: str | None = None, routing: bool = False,
                      expert_parallel: bool = False) -> VllmEngine:
        """The engine an EngineSettings describes (the rollout's, the evaluator's or the judge's), with
        what each role decides itself: how many sequences run at once, how it samples, where its
        OpenMP threads go (`omp_threads_bind`: EngineSettings.omp_bind of the placement's cores), and
        a rollout's MoE settings (`routing`, `expert_parallel`: its `moe` section)."""
        return cls(s.model_dir, max_model_len=s.max_model_len, max_num_seqs=max_num_seqs,
                   kv_cache_gib=s.kv_cache_gib, temperature=temperature, top_p=top_p, dtype=s.dtype,
                   omp_threads_bind=omp_threads_bind, seeded=seeded, kv_cache_tokens=s.kv_cache_tokens,
                   tensor_parallel_size=s.tensor_parallel_size, enforce_eager=s.enforce_eager,
                   gpu_memory_utilization=s.gpu_memory_utilization, enable_prefix_caching=s.enable_prefix_caching,
                   lora=s.lora, routing=routing, expert_parallel=expert_parallel)

    def engine_args(self, cpu: bool) -> dict:
        """The AsyncEngineArgs of this engine (`cpu`: vLLM's CPU build), as keyword arguments."""
        extra = {}
        if self.seeded and cpu:  # see the module docstring
            extra = {"enable_chunked_prefill": False, "max_num_batched_tokens": max(self.max_model_len, 2048)}
        if self.kv_cache_tokens is not None:  # blocks of 32 tokens (the CPU attention needs multiples of 32)
            extra.update(block_size=KV_BLOCK, num_gpu_blocks_override=-(-self.kv_cache_tokens // KV_BLOCK))
        if self.lora is not None:
            extra.update(enable_lora=True, max_lora_rank=self.lora.max_lora_rank, max_loras=self.lora.max_loras)
        if self.expert_parallel:
            extra["enable_expert_parallel"] = True
        prefix_caching = self.enable_prefix_caching
        if self.routing_on:
            if cpu:
                prefix_caching = False  # a prompt served from the cache is never routed, so never recorded
            else:
                extra["enable_return_routed_experts"] = True
        eager = cpu if self.enforce_eager is None else self.enforce_eager
        return dict(model=self.model_dir, skip_tokenizer_init=True, enforce_eager=eager, dtype=self.dtype,
                    max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
                    tensor_parallel_size=self.tensor_parallel_size,
                    gpu_memory_utilization=self.gpu_memory_utilization,
                    enable_prefix_caching=prefix_caching,
                    worker_extension_cls="laminar.roles.rollout.worker_ext.LaminarWorkerExtension", **extra)

    async def start(self) -> None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(round(self.kv_cache_gib)))))
        if self.omp_threads_bind:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = self.omp_threads_bind
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm import AsyncEngineArgs  # late: vLLM, loaded only in an engine process
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        before = set(descendants(os.getpid()))
        self._cpu = current_platform.is_cpu()
        args = AsyncEngineArgs(**self.engine_args(cpu=self._cpu))
        # This blocks the loop for the engine core's start-up (seconds). AsyncLLM must be built on
        # the loop's thread (built in a worker thread it never delivers outputs); a rollout has
        # its own process, and peers of an in-process cluster ride it out by retrying.
        self.llm = AsyncLLM.from_engine_args(args, stat_loggers=[_stat_logger_class(self.stats)])
        self.shm = ShmLedger()  # only the processes this start created (other engines may share our process)
        self.shm.note([p for p in descendants(os.getpid()) if p not in before])
        if self.routing_on:
            await self._start_routing()

    async def _start_routing(self) -> None:
        """Bind the routing capture in every worker (CPU build), or read what vLLM's own returns
        will hold (CUDA). RuntimeError naming the cause when the model routes nothing."""
        from laminar.models.loading import read_config  # late: only for a MoE policy's routing
        from laminar.models.routing import moe_layer_ids, moe_shape, routing_dtype
        shape = moe_shape(read_config(self.model_dir))
        if shape is None:
            raise RuntimeError(f"routing capture is on (roles.rollout.moe.routing) but {self.model_dir} is not a "
                               f"mixture-of-experts model")
        if not self._cpu:
            layers, top_k, experts = shape
            self.routing_info = {"layers": layers, "top_k": top_k, "experts": experts,
                                 "dtype": routing_dtype(experts).str,
                                 "moe_layers": moe_layer_ids(read_config(self.model_dir))}
            return
        answers = await self._on_ranks("laminar_routing_start")
        bad = [v for ok, v in answers if not ok]
        if bad:
            raise RuntimeError(f"routing capture could not start: {bad[0]}")
        self.routing_info = answers[0][1]

    async def generate(self, request_id: str, prompt: list[int], max_tokens: int, seed: int | None,
                       sampling: Sampling | None = None):
        from vllm import SamplingParams  # late: vLLM, loaded only in an engine process
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind
        sm = sampling or Sampling()
        sp = SamplingParams(max_tokens=max_tokens,
                            temperature=self.temperature if sm.temperature is None else sm.temperature,
                            top_p=self.top_p if sm.top_p is None else sm.top_p,
                            logprobs=sm.top_logprobs, detokenize=False, seed=seed, ignore_eos=sm.ignore_eos,
                            output_kind=RequestOutputKind.FINAL_ONLY if sm.whole else RequestOutputKind.DELTA)
        with self.adapters.use() if self.adapters is not None else _no_adapter() as lora:
            outs = self.llm.generate(TokensPrompt(prompt_token_ids=list(prompt)), sp, request_id=request_id,
                                     lora_request=lora)
            finished = False
            try:
                async for out in outs:
                    c = out.outputs[0]
                    toks = list(c.token_ids)
                    lps = [d[t].logprob for t, d in zip(toks, c.logprobs or [], strict=False)]
                    if sm.top is not None:
                        sm.top += [{int(k): float(v.logprob) for k, v in d.items()} for d in (c.logprobs or [])]
                    if out.finished and getattr(c, "routed_experts", None) is not None:  # the CUDA path
                        self._finished_routing[request_id] = np.asarray(c.routed_experts)
                    finished = out.finished
                    yield toks, lps, (c.finish_reason if out.finished else None)
            finally:
                if finished:  # closed at its last output (module docstring): vLLM's stream ends, no abort
                    await _run_out(outs)
        await self.drop_unused_adapters()  # this request's adapter, if it was the last one on an older version

    async def routing(self, asks: list[tuple[str, int, int]], drop: list[str]) -> list[tuple[int, Any] | None]:
        """The rows held of each (request id, start, end), then forget `drop` (module docstring)."""
        if not self.routing_on or not (asks or drop):
            return [None] * len(asks)
        if not self._cpu:
            return self._finished_rows(asks, drop)
        ok, got = (await self._on_ranks("laminar_routing_take", list(asks), list(drop)))[0]  # every rank routes alike
        if not ok:
            raise RuntimeError(f"routing take failed: {got}")
        info = self.routing_info
        dtype, shape = np.dtype(info["dtype"]), (info["layers"], info["top_k"])
        return [None if g is None else (g[0], np.frombuffer(g[2], dtype).reshape(g[1], *shape)) for g in got]

    def _finished_rows(self, asks, drop) -> list:
        """The CUDA path: rows of finished requests (vLLM returns them at the end), MoE layers only."""
        keep = self.routing_info["moe_layers"]
        out = []
        for rid, start, end in asks:
            rows = self._finished_routing.get(rid)
            if rows is None or end <= start or start >= len(rows):
                out.append(None)
                continue
            block = rows[start:end]
            if block.shape[1] != len(keep):
                block = block[:, keep]
            out.append((start, block.astype(self.routing_info["dtype"], copy=False)))
        for rid in drop:
            self._finished_routing.pop(rid, None)
        return out

    async def _on_ranks(self, method: str, *args) -> list:
        """Run a worker-extension method on every rank; their answers in rank order."""
        return await self.llm.collective_rpc(method, args=args)

    async def load_relay(self, shm_dir: str, min_version: int, exact: tuple[str, int, int] | None = None) -> int:
        """WeightsLoadError: no rank's weights changed; WeightsLost: unknown (rank_load.py).
        LoRA: the version's adapter under a new adapter id (AdapterRefused: not one for our base)."""
        if self.adapters is not None:
            return await self._load_adapter(shm_dir, min_version, exact)
        version = await load_on_ranks(self._on_ranks, ("relay", shm_dir, min_version, exact))
        if version >= 0:
            await self._forget_prefixes()
        return version

    async def _load_adapter(self, shm_dir: str, min_version: int, exact) -> int:
        """The relay's newest adapter version above min_version (or the one `exact` names) becomes
        the current adapter; adapters no request uses any more are removed from the engine."""

        def write():
            lw = LocalWeights(shm_dir)
            try:
                pulled = lw.latest(min_version) if exact is None else lw.version(tuple(exact))
                if pulled is None:
                    return None
                with pulled:
                    return self.adapters.load(pulled)
            finally:
                lw.close()
        request = await asyncio.to_thread(write)
        if request is None:
            return -1
        await self.llm.add_lora(request)
        await self.drop_unused_adapters()
        return self.adapters.versions[request.lora_int_id]

    async def drop_unused_adapters(self) -> None:
        """Remove from the engine the adapters that are neither current nor used by a request."""
        if self.adapters is None:
            return
        for request in self.adapters.unused():
            await self.llm.remove_lora(request.lora_int_id)

    async def load_file(self, path: str) -> None:
        await load_on_ranks(self._on_ranks, ("file", path))
        await self._forget_prefixes()

    async def _forget_prefixes(self) -> None:
        """Drop the prefix cache after new weights: its KV blocks were computed by the old ones,
        and a later request with the same prompt would reuse them (a GRPO group's prompt, a
        prompt of an earlier epoch) and sample from a mix of versions. Requests still running
        (the role loads between batches, so normally none) are preempted and recomputed."""
        await self.llm.reset_prefix_cache(reset_running_requests=True)

    async def close(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None
        if self.adapters is not None:
            self.adapters.close()
        if self.shm is not None:
            # a worker orphaned by a dead core exits on its own, unlinking its own queue: let it.
            # Python's resource tracker (a child this start may have spawned) lives until this
            # process exits: waiting for it would only run out the timeout.
            from multiprocessing import resource_tracker

            from laminar.shm import wait_gone
            tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
            await asyncio.to_thread(wait_gone, [p for p in self.shm.owners if p != tracker], 10.0)
            _untrack(self.shm.release())
            self.shm = None


async def _run_out(outs) -> None:
    """vLLM's stream of a request whose finished output it already gave: resumed, it ends by itself."""
    async for _ in outs:
        pass


@contextlib.contextmanager
def _no_adapter():
    yield None


def _untrack(names: list[str]) -> None:
    """The engine's processes registered what they created with this process's multiprocessing
    resource tracker (they share it); forget what was just removed, or the tracker tries to unlink
    it again when this process exits (a FileNotFoundError traceback)."""
    from multiprocessing import resource_tracker  # late: a private module, only at close
    if not names or getattr(resource_tracker._resource_tracker, "_fd", None) is None:
        return
    for n in names:
        if n.startswith("psm_"):
            resource_tracker.unregister("/" + n, "shared_memory")
        elif n.startswith("sem.mp-"):
            resource_tracker.unregister("/" + n[len("sem."):], "semaphore")
