"""Context parallelism (roles/trainer/context_parallel.py): one sequence's tokens split over gloo ranks,
Ulysses all-to-all over the attention heads, against one process training the same batches.

- 2 ranks at context_parallel_size 2 (one data-parallel group) against 1 process, in float32: the
  logprobs and entropies of a micro-batch of long-tailed sequences (odd lengths: the split pads),
  its policy loss and every parameter's gradient within 1e-5, then the metrics of a version of
  training; for right-padded unchunked logits, for packed rows with chunked logprobs and
  activation checkpointing, for LoRA with a KL term (its reference: the adapter off), and with
  recomputed old logprobs (the batch's ratio distribution counts each sequence once);
- 4 ranks (slow): CP 2 x 2 data-parallel groups with token-budget micro-batches, and CP 4 on a model
  with 2 key/value heads (each rank gets a copy of the one its queries use);
- the trainer role on 2 ranks at CP 2, as role processes with a real experience buffer, trains
  versions from groups put into the buffer;
- the same in an in-process cluster (laminar/testing/inproc_cluster.py): the experience buffer and
  trainer.0 in the test's process, trainer.1 a role process following rank 0's command stream;
  rank 0 steps through a version and its metrics are those of the whole group.
"""
from __future__ import annotations

import asyncio
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from laminar.testing.load_ranks import launch_ranks  # noqa: E402
from laminar.testing.procs import RoleProc, free_port  # noqa: E402
from laminar.testing.trainer_task import random_groups  # noqa: E402
from tests.integration.trainer.test_trainer import feed, proc_cluster, wait_events  # noqa: E402

pytestmark = pytest.mark.timeout(900)
TOL = 1e-5
VARIANTS = [dict(performance=dict(packing=False, logprob_chunk_tokens=0)),
            dict(performance=dict(packing=True, logprob_chunk_tokens=16, activation_checkpointing=True)),
            dict(performance=dict(packing=True, logprob_chunk_tokens=16), lora=dict(rank=4, alpha=8),
                 loss=dict(kl_coef=0.1)),
            dict(performance=dict(packing=True, logprob_chunk_tokens=16), loss=dict(old_logprobs="recompute"))]


def run(tmp, model, world: int, variants: list[dict], name: str, cp: int) -> list[dict]:
    vs = [{**v, "distributed": {"context_parallel_size": cp}} for v in variants]
    out = tmp / f"{name}.pt"
    launch_ranks("laminar.testing.cp_ranks", world, [str(model), str(out), "--variants", json.dumps(vs),
                                                     "--versions", "1"], timeout=800)
    return torch.load(out)


def assert_equal_runs(one: dict, cp: dict, label: str) -> None:
    m = one["mask"] > 0
    assert torch.equal(one["mask"], cp["mask"])
    dlp = float((one["logp"] - cp["logp"])[m].abs().max())
    dent = float((one["entropy"] - cp["entropy"])[m].abs().max())
    assert dlp <= TOL and dent <= TOL, (label, dlp, dent)
    assert cp["loss"] == pytest.approx(one["loss"], abs=TOL), label
    assert set(cp["grads"]) == set(one["grads"]) and one["grads"], label
    dg = max(float((one["grads"][k] - cp["grads"][k]).abs().max()) for k in one["grads"])
    assert dg <= TOL, (label, dg)
    ratios = sorted(k for k in one["metrics"][0] if k.startswith("is_seq_"))  # with recomputed old logprobs
    for k in ("loss", "pg_loss", "grad_norm", "entropy", "tokens", "response_tokens", "clip_frac_high", *ratios):
        assert cp["metrics"][0][k] == pytest.approx(one["metrics"][0][k], rel=TOL, abs=TOL), (label, k)
    print(f"\n{label}: max |d logp| {dlp:.1e}, |d entropy| {dent:.1e}, |d grad| {dg:.1e} "
          f"over {len(one['grads'])} gradients")


def test_context_parallel_two_ranks_equal_one(tmp_path, tiny):
    one = run(tmp_path, tiny, 1, VARIANTS, "one", cp=1)
    two = run(tmp_path, tiny, 2, VARIANTS, "two", cp=2)
    for v, a, b in zip(VARIANTS, one, two, strict=True):
        assert_equal_runs(a, b, f"cp 2 {v}")


@pytest.mark.slow  # 4 gloo ranks on 2 cores, two engines each (~3 minutes)
def test_context_parallel_with_data_parallel_and_kv_copies(tmp_path, tiny):
    budget = dict(performance=dict(packing=True, logprob_chunk_tokens=16, max_tokens_per_micro_batch=80,
                                   micro_batch_balance="tokens"))
    one = run(tmp_path, tiny, 1, [budget], "one", cp=1)[0]
    cp2 = run(tmp_path, tiny, 4, [budget], "cp2", cp=2)[0]   # 2 data-parallel groups of 2
    cp4 = run(tmp_path, tiny, 4, [budget], "cp4", cp=4)[0]   # 4 ranks, 2 key/value heads: copies
    assert_equal_runs(one, cp2, "cp 2 x dp 2")
    assert_equal_runs(one, cp4, "cp 4")
    assert cp2["metrics"][0]["micro_batches"] > 0


def test_context_parallel_trainer_role_two_ranks(tmp_path, tiny):
    """trainer.0 and trainer.1 (context_parallel_size 2, one data-parallel group) with a real
    experience buffer: both step through the same versions; rank 0 writes the metrics."""
    from laminar.roles.trainer.metrics import read_jsonl
    path = proc_cluster(tmp_path, tiny, ranks=2, device="cpu",
                        distributed={"world_size": 2, "port": free_port(), "context_parallel_size": 2},
                        performance={"micro_batch_size": 4, "packing": True})
    procs = []
    try:
        buf = RoleProc("experience_buffer", "0", path, tmp_path).start()
        procs.append(buf)
        buf.wait_ready(60)
        ranks = [RoleProc("trainer", str(r), path, tmp_path, env={"OMP_NUM_THREADS": "1"}).start() for r in range(2)]
        procs += ranks
        for r in ranks:
            r.wait_ready(180)
        asyncio.run(feed(path, tmp_path / "keys", random_groups(4, 4, "c", seed=5)))
        for r in ranks:
            wait_events(r, "iteration", lambda e: any(x["version"] == 2 for x in e), timeout=240)
        loaded = ranks[1].events("model_loaded")
    finally:
        for p in reversed(procs):
            p.stop()
    recs = read_jsonl(tmp_path / "run" / "trainer" / "metrics.jsonl")
    assert [r["version"] for r in recs] == [1, 2]
    assert all(r["tokens"] > 0 and r["response_tokens"] > 0 for r in recs)
    assert loaded and loaded[0]["model"] == "model" and loaded[0]["rank"] == 1


def test_context_parallel_trainer_step_in_an_inproc_cluster(tmp_path, tiny, monkeypatch):
    """trainer.0 at context_parallel_size 2 in an in-process cluster with the experience buffer;
    trainer.1 (rank 1, the other half of every sequence) a role process: one version is trained."""
    from laminar.config import load_config
    from laminar.protocol import PutTrajectory
    from laminar.testing.inproc_cluster import InprocCluster
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # dist.init sets it in this process otherwise
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path = proc_cluster(tmp_path, tiny, ranks=2, device="cpu", max_iterations=1,
                        distributed={"world_size": 2, "port": free_port(), "context_parallel_size": 2},
                        performance={"micro_batch_size": 4, "packing": True, "logprob_chunk_tokens": 16})
    follower = RoleProc("trainer", "1", path, tmp_path).start()  # waits in the rendezvous for rank 0

    async def main() -> list[dict]:
        cluster = InprocCluster(load_config(path))
        try:
            await cluster.start("experience_buffer")
            trainer = await cluster.start("trainer", "0", ready_timeout_s=240)
            assert trainer.info.cp_size == 2 and trainer.info.dp_size == 1
            buf = cluster.client("experience_buffer")
            for g in random_groups(2, 4, "ip", seed=7):
                for t in g:
                    assert (await buf.call(PutTrajectory(t))).status == "stored"
            for _ in range(2400):  # up to 240 s on a loaded machine
                done = [f for name, f in trainer.events if name == "iteration" and f["version"] == 1]
                if done:
                    return done
                assert follower.alive(), follower.tail()
                await asyncio.sleep(0.1)
            raise TimeoutError(trainer.events[-5:])
        finally:
            await cluster.close()

    try:
        (it,) = asyncio.run(main())
        followed = wait_events(follower, "iteration", lambda e: any(x["version"] == 1 for x in e), timeout=60)
    finally:
        follower.stop(30)
    from laminar.roles.trainer.metrics import read_jsonl
    (rec,) = read_jsonl(tmp_path / "run" / "trainer" / "metrics.jsonl")
    assert rec["version"] == 1 and rec["tokens"] > 0 and rec["response_tokens"] > 0
    assert followed[-1]["version"] == it["version"] == 1
