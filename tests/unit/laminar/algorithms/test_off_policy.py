"""Sequence-level off-policy corrections (laminar/algorithms/off_policy.py): truncated IS at the
token, sequence and geometric level, masked IS that drops tokens or whole sequences whose ratio
leaves the band, each checked against its formula on hand-built batches; the loss they weight; the
per-version ratio distribution the trainer logs."""
from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from laminar.algorithms.grpo import clipped_policy_loss  # noqa: E402
from laminar.algorithms.off_policy import (  # noqa: E402
    importance_weights,
    level_log_ratio,
    ratio_distribution,
    sequence_log_ratio,
)

# two sequences: the first 3 tokens long, the second 4; a padding position in the first
D = [[0.1, -0.3, 0.5, 0.0], [0.4, 0.4, 0.4, 0.4]]     # old - behaviour per token
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float32)


def batch():
    beh = torch.tensor([[-1.0, -2.0, -0.5, -7.0], [-0.2, -0.9, -1.1, -0.3]])
    old = beh + torch.tensor(D)
    old[0, 3] = 80.0   # garbage outside the mask must not matter
    return old, beh


def test_seq_is_level_ratios_are_the_token_product_and_its_geometric_mean():
    old, beh = batch()
    tok = level_log_ratio(old, beh, MASK, "token")
    seq = level_log_ratio(old, beh, MASK, "sequence")
    geo = level_log_ratio(old, beh, MASK, "geometric")
    assert tok[0, :3].tolist() == pytest.approx(D[0][:3]) and tok[0, 3] == 0
    assert seq[0, :3].tolist() == pytest.approx([0.3] * 3) and seq[0, 3] == 0     # 0.1 - 0.3 + 0.5
    assert seq[1].tolist() == pytest.approx([1.6] * 4)
    assert geo[0, :3].tolist() == pytest.approx([0.1] * 3)                        # 0.3 / 3 tokens
    assert geo[1].tolist() == pytest.approx([0.4] * 4)                            # 1.6 / 4


def test_seq_is_truncated_weights_match_the_formula():
    old, beh = batch()
    w, dropped = importance_weights(old, beh, MASK, mode="tis", level="sequence", cap=2.0)
    assert not dropped.any()
    assert w[0, :3].tolist() == pytest.approx([math.exp(0.3)] * 3) and w[0, 3] == 0
    assert w[1].tolist() == pytest.approx([2.0] * 4)                               # min(e^1.6 = 4.95, 2)
    tw, _ = importance_weights(old, beh, MASK, mode="tis", level="token", cap=1.5)
    assert tw[1].tolist() == pytest.approx([1.4918] * 4, abs=1e-4)                 # e^0.4 < 1.5
    assert tw[0, :3].tolist() == pytest.approx([math.exp(0.1), math.exp(-0.3), 1.5])
    gw, _ = importance_weights(old, beh, MASK, mode="tis", level="geometric", cap=2.0)
    assert gw[0, :3].tolist() == pytest.approx([math.exp(0.1)] * 3)
    assert gw[1].tolist() == pytest.approx([math.exp(0.4)] * 4)


def test_seq_is_masked_drops_tokens_or_whole_sequences_outside_the_band():
    old, beh = batch()
    w, dropped = importance_weights(old, beh, MASK, mode="mis", level="token", cap=1.5, low=0.8)
    # token ratios e^0.1 (in), e^-0.3 = 0.74 (< 0.8: out), e^0.5 = 1.65 (> 1.5: out); e^0.4 = 1.49 (in)
    assert dropped.tolist() == [[False, True, True, False], [False] * 4]
    assert w[0].tolist() == pytest.approx([math.exp(0.1), 0, 0, 0])
    assert w[1].tolist() == pytest.approx([math.exp(0.4)] * 4)
    w, dropped = importance_weights(old, beh, MASK, mode="mis", level="sequence", cap=2.0)   # band [0.5, 2]
    assert dropped.tolist() == [[False] * 4, [True] * 4]                    # e^1.6 leaves it: the whole sequence
    assert w[0, :3].tolist() == pytest.approx([math.exp(0.3)] * 3) and w[1].tolist() == [0.0] * 4
    w, dropped = importance_weights(old, beh, MASK, mode="mis", level="geometric", cap=1.2)
    assert dropped.tolist() == [[False] * 4, [True] * 4]                    # e^0.1 in, e^0.4 = 1.49 out
    assert w[0, :3].tolist() == pytest.approx([math.exp(0.1)] * 3)


def test_seq_is_long_sequences_never_overflow():
    n = 200
    beh = torch.full((1, n), -3.0)
    old = beh + 1.0                                   # a product of e^200: inf in float32 without log space
    mask = torch.ones(1, n)
    w, _ = importance_weights(old, beh, mask, mode="tis", level="sequence", cap=5.0)
    assert torch.isfinite(w).all() and w.max() == pytest.approx(5.0)
    w, dropped = importance_weights(old, beh, mask, mode="mis", level="sequence", cap=5.0)
    assert dropped.all() and (w == 0).all()
    w, _ = importance_weights(old - 2.0, beh, mask, mode="tis", level="sequence", cap=5.0)   # e^-200
    assert torch.isfinite(w).all() and (w >= 0).all()


def test_seq_is_weights_the_clipped_loss_and_keeps_n():
    old, beh = batch()
    logp = old.clone().requires_grad_(True)           # on-policy w.r.t. old: ratio 1, pg = -A
    adv = torch.tensor([1.0, -2.0])
    loss, m = clipped_policy_loss(logp, old, adv, MASK, behaviour_logp=beh, off_policy="mis", is_level="sequence",
                                  is_cap=2.0)
    # sequence 1 is dropped; sequence 0's 3 tokens weigh e^0.3 each; N stays 7 valid tokens
    assert float(loss.detach()) == pytest.approx(-1.0 * 3 * math.exp(0.3) / 7, rel=1e-5)
    assert m["is_dropped_frac"] == pytest.approx(4 / 7)
    loss.backward()
    assert logp.grad[1].abs().sum() == 0 and logp.grad[0, :3].abs().min() > 0
    loss, m = clipped_policy_loss(old.clone(), old, adv, MASK, behaviour_logp=beh, off_policy="tis",
                                  is_level="sequence", is_cap=2.0)
    assert float(loss) == pytest.approx((-3 * math.exp(0.3) + 2.0 * 4 * 2.0) / 7, rel=1e-5)
    assert m["is_truncated_frac"] == pytest.approx(4 / 7) and m["is_dropped_frac"] == 0


def test_seq_is_token_tis_is_unchanged():
    old, beh = batch()
    adv = torch.tensor([0.5, 1.0])
    loss, _ = clipped_policy_loss(old.clone(), old, adv, MASK, behaviour_logp=beh, off_policy="tis", is_cap=1.2)
    w = torch.clamp(torch.exp(torch.tensor(D)), max=1.2) * MASK
    assert float(loss) == pytest.approx(float((-adv[:, None] * w).sum() / 7), rel=1e-6)


def test_seq_is_ratio_distribution_matches_its_definitions():
    seqs = [sequence_log_ratio(np.array(o), np.array(b), m)
            for o, b, m in [([0.0, 0.5, 9.0], [0.1, 0.2, 0.0], [1, 1, 0]), ([1.0], [0.0], None),
                            ([-1.0, -1.0], [0.0, 0.0], [1, 1])]]
    assert seqs[0] == pytest.approx((0.2, 2)) and seqs[1] == (1.0, 1) and seqs[2] == (-2.0, 2)
    d = ratio_distribution(seqs, staleness=[0, 1, 1])
    lr = np.array([0.2, 1.0, -2.0])
    w = np.exp(lr)
    assert d["is_seq_logratio_p50"] == pytest.approx(0.2) and d["is_seq_logratio_min"] == -2.0
    assert d["is_seq_logratio_max"] == 1.0 and d["is_seq_logratio_p95"] == pytest.approx(np.quantile(lr, 0.95))
    assert d["is_geo_ratio_min"] == pytest.approx(math.exp(-1.0)) and d["is_geo_ratio_max"] == pytest.approx(math.e)
    assert d["is_seq_ess"] == pytest.approx(w.sum() ** 2 / (3 * (w ** 2).sum()))
    assert d["is_seq_logratio_abs_mean_stale0"] == pytest.approx(0.2)
    assert d["is_seq_logratio_abs_mean_stale1"] == pytest.approx(1.5)
    assert ratio_distribution([]) == {}


def test_seq_is_settings_are_validated():
    from laminar.roles.trainer.config import TrainerConfig
    from pydantic import ValidationError
    c = TrainerConfig(model_dir="m", loss={"off_policy": "mis", "is_level": "geometric", "is_cap": 1.01,
                                           "is_low": 0.99})
    assert (c.loss.off_policy, c.loss.is_level, c.loss.is_low) == ("mis", "geometric", 0.99)
    for bad in ({"is_level": "batch"}, {"off_policy": "gspo"}, {"is_low": 0}):
        with pytest.raises(ValidationError):
            TrainerConfig(model_dir="m", loss=bad)
    old, beh = batch()
    with pytest.raises(ValueError, match="band"):
        importance_weights(old, beh, MASK, mode="mis", cap=1.0, low=2.0)
    with pytest.raises(ValueError, match="is_level"):
        level_log_ratio(old, beh, MASK, "batch")


def test_seq_is_trainer_logs_the_ratio_distribution_per_version(tmp_path):
    """A trainer with sequence-level masked IS: a rollout that claims logprobs 0.1 higher than the
    trainer's gives each sequence the log ratio -0.1 x its length; those leaving the band are dropped."""
    pytest.importorskip("transformers")
    from dataclasses import replace

    from laminar.roles.trainer.config import TrainerConfig
    from laminar.roles.trainer.engine import TrainEngine

    from laminar.models.loading import load_causal_lm
    from laminar.models.tiny import build_tiny_model
    from laminar.testing.trainer_task import generate_groups
    tiny = build_tiny_model(tmp_path / "m", seed=0)
    torch.manual_seed(0)
    groups = generate_groups(load_causal_lm(tiny, "cpu", train=False), 3, 4, version=0, max_new_tokens=6)
    groups = [[replace(t, logprobs=(t.logprobs + np.float32(0.1)).astype(np.float32)) for t in g] for g in groups]
    lens = np.array([len(t.response_tokens) for g in groups for t in g], np.float64)
    e = TrainEngine(TrainerConfig(model_dir=str(tiny), optimizer={"lr": 1e-3},
                                  loss={"off_policy": "mis", "is_level": "sequence", "is_cap": 1.5}),
                    0, torch.device("cpu"))
    e.load()
    out = e.train(groups, 1)
    assert out["is_seq_logratio_min"] == pytest.approx(-0.1 * lens.max(), abs=1e-3)
    assert out["is_seq_logratio_max"] == pytest.approx(-0.1 * lens.min(), abs=1e-3)
    assert out["is_seq_logratio_p50"] == pytest.approx(np.median(-0.1 * lens), abs=1e-3)
    assert out["is_geo_ratio_min"] == pytest.approx(math.exp(-0.1), abs=1e-3)
    assert out["is_seq_logratio_abs_mean_stale0"] == pytest.approx(0.1 * lens.mean(), abs=1e-3)
    out_of_band = (-0.1 * lens) < math.log(1 / 1.5)      # ratio below 1 / is_cap: dropped
    trained = [t for g in groups if len({x.reward for x in g}) > 1 for t in g]
    n_trained = sum(len(t.response_tokens) for t in trained)
    dropped = sum(len(t.response_tokens) for t in trained if -0.1 * len(t.response_tokens) < math.log(1 / 1.5))
    assert out_of_band.any() and out["is_dropped_frac"] == pytest.approx(dropped / n_trained, abs=1e-6)
