"""Multi-rank trainer (docs/architecture.md §9): two CPU ranks, FSDP2 over gloo.

- engine: 2 ranks train the same batches as 1 process -> the same weights and loss metrics
  (token-level losses divide by the whole mini-batch's tokens; gradients are summed over ranks);
- role: trainer.0 + trainer.1 as real role processes with a real experience buffer: rank 0
  samples and broadcasts, both ranks step through the same versions, rank 0 writes metrics and
  an atomic checkpoint, a SIGTERM to rank 0 stops both ranks cleanly (exit 0), and both ranks
  restarted resume from the newest checkpoint (FSDP2 state broadcast from rank 0) and retrain the
  groups the buffer still leased to the discarded version before any new one.
"""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from laminar.roles.trainer.metrics import read_jsonl  # noqa: E402

from laminar.testing.load_ranks import launch_ranks  # noqa: E402
from laminar.testing.procs import RoleProc, free_port  # noqa: E402
from laminar.testing.trainer_ranks import train_reference  # noqa: E402
from laminar.testing.trainer_task import random_groups  # noqa: E402
from tests.integration.trainer.test_trainer import feed, proc_cluster, wait_events  # noqa: E402

pytestmark = pytest.mark.timeout(240)


def launch_two_ranks(model_dir: Path, out: Path, extra: list[str], timeout: float, world: int = 2,
                     module: str = "laminar.testing.trainer_ranks") -> None:
    """`module` (a rank program) as `world` gloo ranks on a fresh port; all must exit 0."""
    launch_ranks(module, world, [str(model_dir), str(out), *extra], timeout)


def run_ranks(tmp: Path, model_dir: Path, algorithm: str) -> dict:
    out = tmp / f"{algorithm}.pt"
    launch_two_ranks(model_dir, out, ["--algorithm", algorithm], timeout=180)
    return torch.load(out)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_two_gloo_ranks_match_one_process(tmp_path, tiny, algorithm):
    two = run_ranks(tmp_path, tiny, algorithm)
    one = train_reference(str(tiny), algorithm)
    for m2, m1 in zip(two["metrics"], one["metrics"], strict=False):
        for k in ("pg_loss", "loss", "clip_frac_high", "clip_frac_low", "ratio_mean", "response_tokens", "tokens"):
            assert m2[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-6), k
        assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-4)
        if algorithm == "ppo":
            assert m2["value_loss"] == pytest.approx(m1["value_loss"], rel=1e-4, abs=1e-7)
    assert set(two["model"]) == set(one["model"])
    # Adam turns a near-zero gradient into a ~lr step whose sign is at the mercy of summation
    # order, so a rare element may differ by up to 2 lr; the rest must agree to float precision
    # (gradient scaling errors are caught above: grad_norm is compared before Adam normalizes).
    diff = torch.cat([(two["model"][k] - v).abs().flatten() for k, v in one["model"].items()])
    assert float(diff.max()) <= 2 * 1e-3 + 1e-6
    assert float((diff > 1e-5).float().mean()) < 1e-3
    print(f"\n{algorithm}: max |2 ranks - 1 process| = {float(diff.max()):.2e}, "
          f"elements off by > 1e-5: {int((diff > 1e-5).sum())} of {diff.numel()}")


@pytest.mark.slow  # 2 ranks train 3 engines, 2 versions each (~1-2 minutes on 2 shared cores)
def test_balanced_micro_batches_two_gloo_ranks_match_round_robin(tmp_path, tiny):
    """Long-tailed lengths on 2 ranks: sequences dealt by count (round robin, micro-batches of 2)
    and by a balanced token budget (packed, and right-padded) make the same losses, gradient norms
    and update; the balanced plans put about the same tokens on both ranks."""
    variants = [{"performance": dict(micro_batch_balance="round_robin", micro_batch_size=2, packing=True)},
                {"performance": dict(micro_batch_balance="tokens", max_tokens_per_micro_batch=80, packing=True)},
                {"performance": dict(micro_batch_balance="tokens", max_tokens_per_micro_batch=80, packing=False)}]
    out = tmp_path / "variants.pt"
    launch_two_ranks(tiny, out, ["--variants", json.dumps(variants)], timeout=180)
    rr, *balanced = torch.load(out)["variants"]
    for b in balanced:
        for m_rr, m_b in zip(rr["metrics"], b["metrics"], strict=True):
            for k in ("pg_loss", "loss", "clip_frac_high", "clip_frac_low", "ratio_mean", "response_tokens", "tokens",
                      "grad_norm", "entropy"):
                assert m_b[k] == pytest.approx(m_rr[k], rel=1e-4, abs=1e-6), k
            assert m_b["rank_imbalance"] < m_rr["rank_imbalance"]
        diff = torch.cat([(b["model"][k] - v).abs().flatten() for k, v in rr["model"].items()])
        assert float(diff.max()) <= 2 * 1e-3 + 1e-6  # Adam's near-zero gradients (see above)
        assert float((diff > 1e-5).float().mean()) < 1e-3
    print("\nrank_imbalance round robin / balanced packed / padded:",
          [round(v["metrics"][0]["rank_imbalance"], 3) for v in (rr, *balanced)])


@pytest.mark.slow  # 1 and 2 ranks each train a LoRA engine for 2 versions (~1 minute on 2 shared cores)
def test_lora_two_gloo_ranks_match_one_process(tmp_path, tiny):
    """LoRA under FSDP2: 2 ranks train the adapter on the same long-tailed batches as 1 process,
    with the same losses and gradient norms and the same adapter weights; the base stays frozen."""
    lora = [dict(lora=dict(rank=4, alpha=8, dropout=0.0), performance=dict(micro_batch_size=2))]
    runs = {}
    for world in (1, 2):
        out = tmp_path / f"lora{world}.pt"
        launch_two_ranks(tiny, out, ["--variants", json.dumps(lora)], timeout=180, world=world)
        runs[world] = torch.load(out)["variants"][0]
    one, two = runs[1], runs[2]
    for m1, m2 in zip(one["metrics"], two["metrics"], strict=True):
        for k in ("pg_loss", "loss", "response_tokens", "tokens", "grad_norm"):
            assert m2[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-6), k
    assert set(two["model"]) == set(one["model"])
    adapter = [k for k in one["model"] if "lora_" in k]
    assert adapter, sorted(one["model"])[:5]
    diff = torch.cat([(two["model"][k] - one["model"][k]).abs().flatten() for k in adapter])
    assert float(diff.max()) <= 2 * 1e-3 + 1e-6  # Adam's near-zero gradients (see above)
    assert float((diff > 1e-5).float().mean()) < 1e-3


# -- the role on two ranks -------------------------------------------------------------------------
def start_ranks(path: Path, tmp: Path) -> list[RoleProc]:
    ranks = [RoleProc("trainer", str(r), path, tmp, env={"OMP_NUM_THREADS": "1"}).start() for r in range(2)]
    for r in ranks:
        r.wait_ready(120)
    return ranks


def stop_rank0(ranks: list[RoleProc]) -> list[int | None]:
    """SIGTERM to rank 0 only: it tells rank 1 to stop; both must exit 0."""
    ranks[0].stop(timeout=30)
    deadline = time.monotonic() + 30
    while ranks[1].alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    return [r.proc.poll() for r in ranks]


@pytest.mark.slow  # ~20 s on a quiet 2-core machine, 40+ s under load: four torch processes start
def test_trainer_role_on_two_ranks_stops_and_resumes(tmp_path, tiny):
    path = proc_cluster(tmp_path, tiny, ranks=2, distributed={"world_size": 2, "port": free_port()}, device="cpu",
                        performance={"micro_batch_size": 4})
    procs = []
    try:
        buf = RoleProc("experience_buffer", "0", path, tmp_path).start()
        procs.append(buf)
        buf.wait_ready(60)
        ranks = start_ranks(path, tmp_path)
        procs += ranks
        asyncio.run(feed(path, tmp_path / "keys", random_groups(6, 4, "d", seed=3)))
        for r in ranks:
            wait_events(r, "iteration", lambda e: any(x["version"] == 3 for x in e), timeout=120)
        first = stop_rank0(ranks)
        follower_versions = [e["version"] for e in ranks[1].events("iteration")]
        # restart both: resume from v2 (v3 was not checkpointed). v3's groups (d-g4, d-g5) are still
        # leased in the buffer (handed out after the v2 checkpoint), so the resumed trainer is handed
        # them again and retrains them as the new v3; then the 2 new batches -> v4, v5
        ranks = start_ranks(path, tmp_path)
        procs += ranks
        asyncio.run(feed(path, tmp_path / "keys", random_groups(4, 4, "e", seed=4)))
        for r in ranks:
            wait_events(r, "iteration", lambda e: any(x["version"] == 5 for x in e), timeout=120)
        second = stop_rank0(ranks)
        resumed = ranks[0].events("resumed")
    finally:
        for p in reversed(procs):
            p.stop()
    assert first == [0, 0] and second == [0, 0], [r.tail() for r in ranks]
    assert follower_versions == [1, 2, 3]
    assert resumed and resumed[-1]["version"] == 2 and resumed[-1]["cursor"] == 4
    recs = read_jsonl(tmp_path / "run" / "trainer" / "metrics.jsonl")
    assert [r["version"] for r in recs] == [1, 2, 3, 4, 5]  # no gap, no repeat
    # every group handed out is trained exactly once in the kept versions: none lost (the discarded
    # v3's groups are retrained by the resumed trainer, before any new one), none twice
    ids = [g for r in recs for g in r["group_ids"]]
    assert len(ids) == len(set(ids)) == 10, ids
    assert set(ids[:6]) == {f"d-g{i}" for i in range(6)} and set(ids[4:6]) == {"d-g4", "d-g5"}, ids
    assert set(ids[6:]) == {f"e-g{i}" for i in range(4)}, ids
    discarded = read_jsonl(tmp_path / "run" / "trainer" / "metrics.discarded.jsonl")
    assert [r["version"] for r in discarded] == [3] and set(discarded[0]["group_ids"]) == {"d-g4", "d-g5"}
    assert (tmp_path / "run" / "trainer" / "checkpoints" / "v00000004" / "COMPLETE").exists()
    assert not (tmp_path / "run" / "trainer-1").exists()  # only rank 0 writes metrics and checkpoints
