"""Sharded rollouts on vLLM's CPU build: the tiny model at tensor_parallel_size=2, one worker
process per rank, each rank's OpenMP threads on one of the two cores (VLLM_CPU_OMP_THREADS_BIND
"0|1"), weights pulled by every rank from a relay folder in /dev/shm.

- fast (`make test`): greedy tokens and logprobs at TP=2 match transformers' model on the same
  weights (tolerance 1e-3, as at TP=1: tests/integration/rollout/test_rollout_vllm.py) before and after
  a weight update pulled from the relay, including for a prompt whose KV blocks the engine had
  cached under the old weights (the prefix cache is reset by every load); a load that fails on
  one rank, in its prepare or part-way through its commit (the worker extension's test hook),
  raises WeightsLoadError and leaves both ranks on the old weights: the same tokens and the same
  logprobs, bit for bit; the next load succeeds; KV usage is reported while requests run;
- slow: TP=2 equals TP=1 (the same tokens; logprobs within 1e-4, the order of the all-reduce's
  sums being the only difference) before and after the update;
- slow: the rollout role on a TP=2 engine, with the real pools: it reports KV usage, and its
  trajectories migrated half-way to a TP=1 rollout finish with exactly the greedy tokens of an
  unmigrated run.
"""
from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from laminar.roles.rollout.engine import VllmEngine  # noqa: E402
from laminar.roles.rollout.rank_load import WeightsLoadError  # noqa: E402
from laminar.roles.rollout.worker_ext import FAULT_ENV  # noqa: E402

from laminar.models.tiny import build_tiny_model  # noqa: E402
from laminar.protocol import MigrateIn, MigrateOut  # noqa: E402
from laminar.testing.inproc_cluster import InprocCluster  # noqa: E402
from laminar.weights.local_write import write_version  # noqa: E402
from laminar.weights.store import ShmStore  # noqa: E402
from tests.integration.rollout.test_rollout_vllm import MAX_TOKENS as POOL_TOKENS  # noqa: E402
from tests.integration.rollout.test_rollout_vllm import assert_greedy, drain, hf_logprobs, make_cfg  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
MAX_TOKENS = 24
LONG = [3 + (i * 37) % 250 for i in range(100)]  # three whole KV blocks: kept by the prefix cache
PROMPTS = [[5, 6, 7, 8], [40, 41, 42], LONG]


def hf(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def state(model_dir, seed: int) -> dict:
    """Weights of the tiny model's architecture, another random draw (a "trained" version)."""
    other = build_tiny_model(model_dir.parent / f"v{seed}", seed=seed, init_std=0.5)
    return {k: v.contiguous() for k, v in hf(other).state_dict().items()}


def engine(model_dir, tp: int) -> VllmEngine:
    # kv_cache_tokens: KV blocks of 32 tokens (the CPU build's default is 128), so LONG fills
    # whole blocks, which is what the prefix cache keeps
    return VllmEngine(str(model_dir), max_model_len=256, max_num_seqs=4, kv_cache_gib=1, temperature=0.0,
                      top_p=1.0, tensor_parallel_size=tp, omp_threads_bind="0|1" if tp == 2 else "0",
                      kv_cache_tokens=4096)


async def greedy(eng: VllmEngine, tag: str, seen_kv: list | None = None) -> list[tuple[list[int], np.ndarray]]:
    """Every prompt's greedy continuation and its logprobs, all requests at once."""
    async def one(i, prompt):
        toks, lps = [], []
        async for t, lp, _ in eng.generate(f"{tag}-{i}", prompt, MAX_TOKENS, None):
            toks += t
            lps += lp
            if seen_kv is not None:
                seen_kv.append(eng.stats.kv_usage)
        return toks, np.array(lps)
    return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))


def check_against(model, outs, what: str) -> float:
    """Greedy tokens of `model` (near-ties allowed, as at TP=1) and logprobs within 1e-3."""
    worst = 0.0
    for prompt, (toks, lps) in zip(PROMPTS, outs, strict=True):
        assert_greedy(model, prompt, toks, MAX_TOKENS, what)
        worst = max(worst, float(np.abs(hf_logprobs(model, prompt, toks) - lps).max()))
    assert worst < 1e-3, f"{what}: logprobs differ from transformers' by {worst:.3g}"
    return worst


def same(a, b) -> bool:
    return all(ta == tb and np.array_equal(la, lb) for (ta, la), (tb, lb) in zip(a, b, strict=True))


@pytest.fixture
def relay(shm_path):
    store = ShmStore(shm_path("tp"), retain=1)
    store.open()
    yield store
    store.close()


def test_tensor_parallel_cpu_engine_pulls_one_version_into_both_ranks(tmp_path, relay, monkeypatch):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two cores needed (one per rank)")
    model_dir = build_tiny_model(tmp_path / "model", seed=1, init_std=0.5)
    fault = tmp_path / "fault"
    monkeypatch.setenv(FAULT_ENV, str(fault))  # read by both ranks' worker extensions (test hook)
    v1, v2 = state(model_dir, 2), state(model_dir, 3)
    m0, m1, m2 = hf(model_dir), hf(model_dir.parent / "v2"), hf(model_dir.parent / "v3")

    async def go():
        eng = engine(model_dir, 2)
        await eng.start()
        try:
            kv = []
            before = await greedy(eng, "a", kv)
            write_version(relay, v1, 1)
            assert await eng.load_relay(str(relay.dir), -1) == 1
            after = await greedy(eng, "b")
            write_version(relay, v2, 2)
            failed = []
            for phase in ("1 commit", "0 prepare"):
                fault.write_text(phase + "\n")
                with pytest.raises(WeightsLoadError):
                    await eng.load_relay(str(relay.dir), 1)
                failed.append(await greedy(eng, f"c{phase[0]}"))
            fault.unlink()
            assert await eng.load_relay(str(relay.dir), 1) == 2
            return kv, before, after, failed, await greedy(eng, "d")
        finally:
            await eng.close()
    kv, before, after, failed, last = asyncio.run(go())
    check_against(m0, before, "TP=2, initial weights")
    check_against(m1, after, "TP=2, v1 pulled from the relay")
    assert all(same(f, after) for f in failed), "a failed load changed the weights of a rank"
    check_against(m2, last, "TP=2, v2 after the failed loads")
    assert max(kv) > 0, "no KV usage reported while requests ran"


@pytest.mark.slow
def test_tensor_parallel_two_ranks_equal_one(tmp_path, relay):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two cores needed (one per rank)")
    model_dir = build_tiny_model(tmp_path / "model", seed=1, init_std=0.5)
    write_version(relay, state(model_dir, 2), 1)

    async def go(tp):
        eng = engine(model_dir, tp)
        await eng.start()
        try:
            before = await greedy(eng, "a")
            assert await eng.load_relay(str(relay.dir), -1) == 1
            return before, await greedy(eng, "b")
        finally:
            await eng.close()
    one, two = asyncio.run(go(1)), asyncio.run(go(2))
    worst = 0.0
    for o, t in zip(one, two, strict=True):
        for (t1, l1), (t2, l2) in zip(o, t, strict=True):
            assert t1 == t2
            worst = max(worst, float(np.abs(l1 - l2).max()))
    print(f"max |logprob(TP=2) - logprob(TP=1)| = {worst:.3g}")
    assert worst < 1e-4


@pytest.mark.slow
def test_tensor_parallel_rollout_reports_kv_and_migrates_to_tp1(tmp_path, relay):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two cores needed (one per rank)")
    model_dir = build_tiny_model(tmp_path / "model", seed=1, init_std=0.5)
    model = hf(model_dir)
    write_version(relay, {k: v.contiguous() for k, v in model.state_dict().items()}, 1)
    cfg = make_cfg(tmp_path, model_dir, relay.dir)
    cfg.spec("rollout", "0")[1].options["tensor_parallel_size"] = 2  # its ranks on this process's two cores
    cfg.roles["rollout"]["kv_cache_tokens"] = 1024
    n = POOL_TOKENS  # the response budget of make_cfg's prompt pool

    async def go():
        cluster = InprocCluster(cfg)
        try:
            for r, i in (("prompt_pool", "0"), ("prompt_pool", "1"), ("partial_pool", "0"),
                         ("experience_buffer", "0")):
                await cluster.start(r, i)
            # a deadline for starting three engine processes (TP 2) on two shared cores, not a wait
            r0 = await cluster.start("rollout", "0", ready_timeout_s=900)
            await cluster.start("rollout", "1", ready_timeout_s=900)
            kv = []
            async with asyncio.timeout(300):
                while not r0.active or min(len(a.tokens) for a in r0.active.values()) < n // 2:
                    kv.append(r0.engine.stats.kv_usage)
                    await asyncio.sleep(0.01)  # watching the role's own state
            ids = list(r0.active)
            moved = await cluster.client("rollout", "0").call(MigrateOut(ids), timeout=60)
            await cluster.client("rollout", "1").call(MigrateIn(list(moved.partials)), timeout=60)
            done = await drain(cluster, 1, timeout=300,
                               until=lambda ts: set(ids) <= {t.spec.trajectory_id for t in ts})
            return kv, ids, done
        finally:
            await cluster.close()
    kv, ids, done = asyncio.run(go())
    assert max(kv) > 0
    migrated = [t for t in done if t.spec.trajectory_id in ids]
    assert migrated and all(t.rollout_id == "1" and t.version == 1 for t in migrated)
    for t in done:
        assert_greedy(model, [int(x) for x in t.spec.prompt_tokens], [int(x) for x in t.response_tokens], n,
                      t.spec.trajectory_id)
