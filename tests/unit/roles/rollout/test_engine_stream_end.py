"""How VllmEngine.generate (roles/rollout/engine.py) leaves vLLM's stream of a request, against a
stand-in for AsyncLLM.generate shaped as vLLM's is (it yields until the finished output, then ends;
closed or cancelled before its end, it aborts the request):

- a consumer that stops reading at the finished output and closes the stream (an agent call, an
  env turn) lets vLLM's stream end: no abort, which would be one more message to the engine core;
- one that stops before the end (a stop string) still aborts the request, as does a cancelled one;
- one that reads to the end is unchanged (no abort);
- a request that asks for its output whole (`Sampling.whole`) is vLLM's FINAL_ONLY, others DELTA.
"""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from laminar.roles.rollout.engine import Sampling, VllmEngine  # noqa: E402


class FakeLLM:
    """AsyncLLM.generate's shape: outputs until a finished one; an early close or a cancel aborts."""

    def __init__(self, steps: int):
        self.steps = steps
        self.aborted: list[str] = []
        self.ended: list[str] = []
        self.gate: asyncio.Event | None = None  # when set: waits for it before each output
        self.kinds: list = []                    # each request's output kind

    async def generate(self, prompt, sp, request_id, lora_request=None):
        self.kinds.append(sp.output_kind)
        try:
            for i in range(self.steps):
                if self.gate is not None:
                    await self.gate.wait()
                done = i == self.steps - 1
                yield SimpleNamespace(finished=done, outputs=[SimpleNamespace(
                    token_ids=[10 + i], logprobs=None, finish_reason="length" if done else None)])
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted.append(request_id)  # AsyncLLM: await self.abort(request_id, internal=True)
            raise
        self.ended.append(request_id)


def engine(steps: int) -> tuple[VllmEngine, FakeLLM]:
    eng = VllmEngine("unused", max_model_len=64, max_num_seqs=2, kv_cache_gib=1, temperature=1.0, top_p=1.0)
    eng.llm = FakeLLM(steps)
    return eng, eng.llm


async def read(eng, rid: str, stop_after: int | None = None) -> list[int]:
    """As an agent call reads: stop at the finish reason (or after `stop_after` outputs), then close."""
    got, stream = [], eng.generate(rid, [1, 2, 3], 8, None)
    try:
        async for toks, _, finish in stream:
            got += toks
            if finish is not None or (stop_after is not None and len(got) >= stop_after):
                break
    finally:
        await stream.aclose()
    for _ in range(5):
        await asyncio.sleep(0)  # a dropped stream is closed by the loop's finalizer a step later
    return got


def test_a_stream_closed_at_its_finished_output_ends_without_an_abort():
    eng, llm = engine(4)
    assert asyncio.run(read(eng, "r1")) == [10, 11, 12, 13]
    assert llm.ended == ["r1"] and llm.aborted == []


def test_a_stream_closed_before_its_end_still_aborts_the_request():
    eng, llm = engine(4)
    assert asyncio.run(read(eng, "r2", stop_after=2)) == [10, 11]
    assert llm.aborted == ["r2"] and llm.ended == []


def test_a_stream_read_to_its_end_or_cancelled_is_as_before():
    eng, llm = engine(3)

    async def go():
        whole = [t async for toks, _, _ in eng.generate("r3", [1], 8, None) for t in toks]
        llm.gate = asyncio.Event()
        task = asyncio.ensure_future(read(eng, "r4"))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return whole
    assert asyncio.run(go()) == [10, 11, 12]
    assert llm.ended == ["r3"] and llm.aborted == ["r4"]


def test_a_request_that_takes_its_output_whole_asks_vllm_for_the_final_output_only():
    from vllm.sampling_params import RequestOutputKind
    eng, llm = engine(1)

    async def go():
        for whole in (True, False):
            async for _ in eng.generate(f"w{whole}", [1], 8, None, Sampling(whole=whole)):
                pass
        async for _ in eng.generate("none", [1], 8, None):
            pass
    asyncio.run(go())
    assert llm.kinds == [RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA, RequestOutputKind.DELTA]
