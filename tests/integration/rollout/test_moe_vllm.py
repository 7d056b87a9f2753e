"""The tiny Qwen3-MoE model on vLLM's CPU build, with the engine's own routing (docs/moe.md).

- the engine (VllmEngine, routing on) records, per request, the experts of every processed position;
  replayed in the trainer's model they reproduce vLLM's logprobs (float32) on every token;
- an in-place load of the same weights leaves every logprob unchanged (vLLM 0.32's CPU build skips
  the expert kernel's prepack on reload: roles/rollout/moe_worker.py's repack_cpu_experts);
- in a cluster (real pools and rollouts, one process): a trajectory migrated to another rollout
  mid-way, whose new rollout's engine core process is then killed (SIGKILL) mid-trajectory (the
  rollout then stops: its last flush sends the tokens it holds, but the rows its dead engine had not
  handed over are gone) and which a third rollout resumes from the partial pool, keeps the routing
  rows every earlier rollout recorded (the pool's copy at each move is a prefix of the stored
  trajectory's), gets the lost positions' rows from the new engine's re-prefill, ends with one row
  per processed position, and its recorded routing replayed reproduces the behaviour logprobs of
  every token.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from laminar.roles.rollout.engine import VllmEngine  # noqa: E402
from laminar.roles.trainer.moe_settings import TrainerMoe  # noqa: E402
from laminar.roles.trainer.routing_replay import RoutingReplay  # noqa: E402

from laminar.config import parse_config  # noqa: E402
from laminar.models.tiny import build_tiny_moe_model  # noqa: E402
from laminar.protocol import GrantPartials, InFlightOf, MigrateIn, MigrateOut, SampleGroups  # noqa: E402
from laminar.testing.inproc_cluster import InprocCluster  # noqa: E402
from laminar.testing.moe import hf_routing  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1800)]
MAX_TOKENS = 160  # long enough that the moves happen mid-way whatever the machine's speed


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    d = build_tiny_moe_model(tmp_path_factory.mktemp("moe") / "m", seed=1, init_std=0.2)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return d, model


def replayed_logprobs(model, tokens: list[int], routing: np.ndarray, prompt_len: int) -> np.ndarray:
    """The trainer's logprobs of tokens[prompt_len:] with `routing` replayed (RoutingReplay)."""
    replay = RoutingReplay.attach(TrainerMoe(routing_replay=True), [model], model.config)
    replay.stage([routing], [len(tokens)], len(tokens), packed=False, device="cpu")
    ids = torch.tensor([tokens])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids, use_cache=False).logits[0, prompt_len - 1:-1].float(), -1)
    replay.clear()
    return lp.gather(-1, ids[0, prompt_len:, None])[:, 0].numpy()


def test_moe_engine_routing_replays_to_vllms_logprobs_and_survives_reload(moe_model, tmp_path):
    model_dir, model = moe_model

    async def go():
        engine = VllmEngine(str(model_dir), max_model_len=256, max_num_seqs=8, kv_cache_gib=1, temperature=1.0,
                            top_p=1.0, seeded=True, routing=True)
        await engine.start()
        try:
            prompts = [[1, 5 + i, 9, 40 + 3 * i, 7] for i in range(4)]

            async def one(i, tag):
                toks, lps = [], []
                async for t, lp, _ in engine.generate(f"r{i}{tag}", prompts[i], 24, seed=i):
                    toks += t
                    lps += lp
                got = await engine.routing([(f"r{i}{tag}", 0, len(prompts[i]) + len(toks))], [f"r{i}{tag}"])
                return toks, lps, got[0]
            first = await asyncio.gather(*(one(i, "a") for i in range(4)))
            torch.save(model.state_dict(), tmp_path / "same.pt")
            await engine.load_file(str(tmp_path / "same.pt"))
            again = await asyncio.gather(*(one(i, "b") for i in range(4)))
            return engine.routing_info, prompts, first, again
        finally:
            await engine.close()
    info, prompts, first, again = asyncio.run(go())
    assert info["layers"] == 2 and info["top_k"] == 2 and info["experts"] == 8
    worst = disagree = rows = 0.0
    for p, (toks, lps, (start, routing)) in zip(prompts, first, strict=True):
        assert start == 0 and routing.dtype == np.uint8 and routing.shape == (len(p) + len(toks) - 1, 2, 2)
        rep = replayed_logprobs(model, p + toks, routing, len(p))
        worst = max(worst, float(np.abs(rep - np.asarray(lps)).max()))
        own = hf_routing(model, p + toks)
        disagree += float((np.sort(own, -1) != np.sort(routing, -1)).any(-1).any(-1).sum())
        rows += len(routing)
    print(f"replayed max |dlogprob| {worst:.2e}; positions whose own top-k differs {disagree}/{rows}")
    assert worst < 1e-4
    for (t1, l1, _), (t2, l2, _) in zip(first, again, strict=True):  # seeded: the same tokens, the same logprobs
        assert t1 == t2 and np.abs(np.asarray(l1) - np.asarray(l2)).max() < 1e-5


def cluster_cfg(tmp: Path, model_dir) -> object:
    data = tmp / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}{chr(65 + i)}q", "answer": "A"}) + "\n" for i in range(2)))
    roles = [{"role": "prompt_pool", "port": 7101}, {"role": "partial_pool", "port": 7102},
             {"role": "experience_buffer", "port": 7103}, {"role": "rollout", "id": "0", "port": 7110},
             {"role": "rollout", "id": "1", "port": 7111}, {"role": "rollout", "id": "2", "port": 7112}]
    return parse_config({
        "run": {"workdir": str(tmp / "run")},
        "cluster": {"keys_dir": None, "shutdown_s": 30, "broker": {"host": "h0"},
                    "hosts": {"h0": {"address": "127.0.0.1", "roles": roles}}},
        "roles": {"prompt_pool": {"dataset": str(data), "group_size": 2, "max_tokens": MAX_TOKENS, "max_epochs": 1},
                  "rollout": {"model_dir": str(model_dir), "max_concurrency": 4, "temperature": 1.0, "seed": 3,
                              "max_model_len": 256, "stop_when_exhausted": False, "delta_interval_s": 0.05,
                              "idle_wait_s": 0.2, "moe": {"routing": True}}}})


def engine_core_pids(role) -> list[int]:
    out = []
    for pid in role.engine.shm.owners:
        try:
            if b"EngineCor" in Path(f"/proc/{pid}/cmdline").read_bytes() + Path(f"/proc/{pid}/comm").read_bytes():
                out.append(pid)
        except OSError:
            continue
    return out


async def until(check, timeout=240):
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.02)  # watching the roles' own state


async def pool_partials(cluster, owner: str) -> dict:
    got = await cluster.client("partial_pool").call(InFlightOf(owner), timeout=30)
    return {p.spec.trajectory_id: p for p in got.partials}


async def moves(cluster):
    """Rollout 0 starts the group; half-way it is moved to rollout 1, whose engine core is killed
    a few tokens later; rollout 2 takes it over from the partial pool. Returns the pool's copies at
    each move and the stored trajectories."""
    r0 = await cluster.start("rollout", "0", ready_timeout_s=600)
    await until(lambda: r0.active and min(len(a.tokens) for a in r0.active.values()) >= 12
                and all(a.routing is not None for a in r0.active.values()))
    moved = await cluster.client("rollout", "0").call(MigrateOut(list(r0.active)), timeout=60)
    at_move = {p.spec.trajectory_id: p for p in moved.partials}  # those still generating
    ids = list(at_move)
    r1 = await cluster.start("rollout", "1", ready_timeout_s=600)
    await cluster.client("partial_pool").call(GrantPartials(ids, "1"), timeout=30)
    await cluster.client("rollout", "1").call(MigrateIn(list(moved.partials)), timeout=60)
    await until(lambda: any(len(a.tokens) >= len(at_move[t].tokens) + 8 for t, a in r1.active.items()))
    pids = engine_core_pids(r1)
    assert pids, "rollout 1's engine core process"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)  # the engine dies mid-trajectory, taking its unpulled routing rows
    await until(lambda: not r1.active or any(a.task.done() for a in r1.active.values()))  # the engine is gone
    await cluster.stop("rollout", "1")  # its last flush: the tokens it holds (rows only as far as it had them)
    at_kill = await pool_partials(cluster, "1")
    await cluster.start("rollout", "2", ready_timeout_s=600)
    await cluster.client("partial_pool").call(GrantPartials(list(at_kill), "2"), timeout=30)
    await cluster.client("rollout", "2").call(MigrateIn(list(at_kill.values())), timeout=60)
    buf, stored = cluster.client("experience_buffer"), []
    async with asyncio.timeout(240):
        while not set(ids) <= {t.spec.trajectory_id for t in stored}:  # (a group may finish with others)
            s = await buf.call(SampleGroups(1, 99))
            stored += [t for g in s.groups for t in g]
            if not s.groups:
                await asyncio.sleep(0.2)  # polling the buffer for finished work
    await cluster.close()
    return at_move, at_kill, {t.spec.trajectory_id: t for t in stored if t.spec.trajectory_id in ids}


def test_moe_routing_survives_migration_and_a_killed_rollout(moe_model, tmp_path):
    model_dir, model = moe_model
    cluster = InprocCluster(cluster_cfg(tmp_path, model_dir))

    async def go():
        for r in ("prompt_pool", "partial_pool", "experience_buffer"):
            await cluster.start(r)
        return await moves(cluster)
    at_move, at_kill, stored = asyncio.run(go())
    assert at_move and at_kill and set(at_kill) <= set(stored) == set(at_move)
    for tid, t in stored.items():
        prompt, resp = [int(x) for x in t.spec.prompt_tokens], [int(x) for x in t.response_tokens]
        assert t.routing is not None and t.routing.shape == (len(prompt) + len(resp) - 1, 2, 2)
        for snap in (at_move[tid], at_kill.get(tid)):
            if snap is None:
                continue  # finished on rollout 1 before the kill
            n = len(snap.routing)
            assert 0 < n <= len(prompt) + len(snap.tokens)
            assert np.array_equal(t.routing[:n], snap.routing), f"{tid}: rows recorded before a move were replaced"
        rep = replayed_logprobs(model, prompt + resp, t.routing, len(prompt))
        worst = float(np.abs(rep - t.logprobs).max())
        print(f"{tid}: {len(resp)} tokens, {len(at_move[tid].tokens)} at the move, "
              f"{len(at_kill[tid].tokens) if tid in at_kill else '-'} at the kill; replayed max |dlogprob| {worst:.2e}")
        assert worst < 1e-3
