"""Balanced, token-budget micro-batches (roles/trainer/micro_batches.py): the Karmarkar-Karp
partition, the same number of micro-batches on every rank, the token budget (packed and padded),
and a long-tailed batch far better balanced than dealt round-robin; the engine reports it."""
from __future__ import annotations

import numpy as np
import pytest
from laminar.roles.trainer.micro_batches import karmarkar_karp, plan_micro_batches


def long_tailed(n: int, seed: int = 0) -> list[int]:
    """Lognormal lengths (median ~2,800, a tail to the 16K cap): reasoning responses."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.clip(np.exp(rng.normal(np.log(2800), 0.7, n)), 16, 16384)]


@pytest.mark.parametrize("n,k", [(1, 3), (7, 2), (50, 4), (200, 16), (5, 8)])
def test_balance_karmarkar_karp_partitions_every_item_once_with_near_equal_sums(n, k):
    costs = [float(c) for c in long_tailed(n, seed=n)]
    parts = karmarkar_karp(costs, k)
    assert len(parts) == k
    assert sorted(i for p in parts for i in p) == list(range(n))
    sums = [sum(costs[i] for i in p) for p in parts]
    if n <= k:
        assert all(len(p) <= 1 for p in parts)  # every item a part of its own
    else:
        assert max(sums) - min(sums) <= max(costs)  # no worse than moving one item would fix


def check_plan(plan, idx, lengths, world, max_seqs, max_tokens, padded):
    by_idx = dict(zip(idx, lengths, strict=True))
    assert len(plan.ranks) == world
    assert len({len(r) for r in plan.ranks}) == 1  # the same number of micro-batches on every rank
    assert sorted(i for r in plan.ranks for mb in r for i in mb) == sorted(idx)
    for r in plan.ranks:
        for mb in r:
            assert len(mb) <= max_seqs
            if max_tokens is not None and len(mb) > 1:
                used = len(mb) * max(by_idx[i] for i in mb) if padded else sum(by_idx[i] for i in mb)
                assert used <= max_tokens


packed_rounds: dict[int, int] = {}


@pytest.mark.parametrize("padded", [False, True])
def test_balance_token_budget_same_count_on_every_rank(padded):
    lengths = long_tailed(512, seed=1)
    idx = list(np.random.default_rng(2).permutation(10_000)[:512])  # any sequence indices
    for world in (1, 4, 32):
        plan = plan_micro_batches(idx, lengths, world, max_seqs=64, max_tokens=32_768, padded=padded)
        check_plan(plan, idx, lengths, world, 64, 32_768, padded)
        if padded:  # bins of like lengths (a bin pays for its longest): fewer, coarser (2 rounds at 32)
            assert plan.rank_imbalance() < 1.15 and plan.step_imbalance() < 1.2
            assert len(plan.ranks[0]) <= 1.2 * packed_rounds[world]
        else:
            assert plan.rank_imbalance() < 1.02 and plan.step_imbalance() < 1.1
            packed_rounds[world] = len(plan.ranks[0])


def test_balance_beats_round_robin_on_long_tailed_lengths():
    lengths = long_tailed(512, seed=3)
    idx = list(range(512))
    rr = plan_micro_batches(idx, lengths, 32, max_seqs=4, balance="round_robin")
    check_plan(rr, idx, lengths, 32, 4, None, False)
    bal = plan_micro_batches(idx, lengths, 32, max_seqs=64, max_tokens=32_768)
    att = plan_micro_batches(idx, lengths, 32, max_seqs=64, max_tokens=32_768, balance="attention",
                             attention_tokens=75_000.0)
    check_plan(att, idx, lengths, 32, 64, 32_768, False)
    assert rr.rank_imbalance() > 1.15      # 16 sequences a rank: the tail lands somewhere
    assert bal.rank_imbalance() < 1.01 < rr.rank_imbalance()
    assert att.rank_imbalance() < 1.05


def test_balance_round_robin_with_a_token_budget_and_edge_cases():
    lengths = [100, 5000, 100, 100, 6000, 100, 100]
    plan = plan_micro_batches(list(range(7)), lengths, 2, max_seqs=8, max_tokens=5100, balance="round_robin")
    check_plan(plan, list(range(7)), lengths, 2, 8, 5100, False)
    assert plan.ranks[0] == [[0, 2], [4], [6]] and plan.ranks[1] == [[1, 3], [5], []]
    empty = plan_micro_batches([], [], 4, max_seqs=2)
    assert empty.ranks == [[], [], [], []] and empty.rank_imbalance() == 1.0
    one = plan_micro_batches([9], [50_000], 3, max_seqs=2, max_tokens=100)  # longer than the budget: alone
    assert one.ranks == [[[9]], [[]], [[]]]
    with pytest.raises(ValueError, match="micro_batch_balance"):
        plan_micro_batches([1], [5], 1, 1, balance="random")


def test_balance_engine_reports_rank_imbalance_and_micro_batches(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from laminar.roles.trainer.config import TrainerConfig
    from laminar.roles.trainer.engine import TrainEngine

    from laminar.models.tiny import build_tiny_model
    from laminar.testing.trainer_task import random_groups
    d = build_tiny_model(tmp_path / "m", hidden=32, layers=1, intermediate=64)
    torch.manual_seed(0)
    cfg = TrainerConfig(model_dir=str(d), performance={"max_tokens_per_micro_batch": 40},
                        loss={"skip_uniform_groups": False})
    e = TrainEngine(cfg, 0, torch.device("cpu"))
    e.load()
    out = e.train(random_groups(2, 4, "b", resp_len=10, prompt_len=6), 1)
    assert out["rank_imbalance"] == 1.0 and out["step_imbalance"] == 1.0  # one rank
    assert out["micro_batches"] == 4  # 8 sequences of 16 tokens, 40 tokens a micro-batch: 2 each
