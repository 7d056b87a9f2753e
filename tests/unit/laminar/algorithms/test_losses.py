"""GRPO / PPO losses against hand-computed values (docs/learning.md): advantages, both clip bounds,
token-level aggregation, TIS and decoupled-PPO weights, k3 KL, GAE and the value loss."""
from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from laminar.roles.trainer.batching import collate, response_logprobs  # noqa: E402

from laminar.algorithms.grpo import group_advantages, grpo_loss  # noqa: E402
from laminar.algorithms.ppo import gae, value_loss  # noqa: E402


def test_group_advantages_hand_computed():
    a, b, c = group_advantages([[1, 0, 0, 1], [2, 2], [5]])
    s = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    np.testing.assert_allclose(a, [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s], rtol=1e-5)
    np.testing.assert_allclose(b, [0, 0])   # equal rewards: no signal
    np.testing.assert_allclose(c, [0])      # a group of one: no signal


def batch():
    # seq 0: 3 valid tokens, A = +1, ratios 1.0, 1.5 (above 1 + eps_high), 0.5 (below, but A > 0)
    # seq 1: 1 valid token,  A = -1, ratio 0.5 (below 1 - eps_low); two padded positions
    ratio = torch.tensor([[1.0, 1.5, 0.5], [0.5, 7.0, 9.0]])
    old = torch.full((2, 3), -1.0)
    logp = (old + torch.log(ratio)).requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    return logp, old, adv, mask


def test_grpo_loss_clip_higher_and_token_level():
    logp, old, adv, mask = batch()
    loss, m = grpo_loss(logp, old, adv, mask)
    # per-token pg = max(-A r, -A clip(r, 0.8, 1.28)): -1.0, -1.28, -0.5 | 0.8
    expected = (-1.0 - 1.28 - 0.5 + 0.8) / 4  # token level: / 4 valid tokens
    assert float(loss) == pytest.approx(expected, abs=1e-6)
    seq_level = ((-1.0 - 1.28 - 0.5) / 3 + 0.8) / 2
    assert abs(expected - seq_level) > 0.1  # the test tells the two aggregations apart
    assert m["clip_frac_high"] == pytest.approx(0.25) and m["clip_frac_low"] == pytest.approx(0.25)
    assert m["ratio_mean"] == pytest.approx((1.0 + 1.5 + 0.5 + 0.5) / 4, abs=1e-6)
    loss.backward()
    # d/dlogp of -A r / N where unclipped; 0 where the clip is active; 0 on padding
    np.testing.assert_allclose(logp.grad.numpy(), [[-0.25, 0.0, -0.125], [0.0, 0.0, 0.0]], atol=1e-6)


def test_grpo_loss_micro_batches_add_up():
    logp, old, adv, mask = batch()
    full, _ = grpo_loss(logp, old, adv, mask)
    parts = sum(float(grpo_loss(logp[i:i + 1], old[i:i + 1], adv[i:i + 1], mask[i:i + 1], num_tokens=4)[0])
                for i in range(2))
    assert parts == pytest.approx(float(full), abs=1e-6)


def test_tis_and_decoupled_weights():
    logp, old, adv, mask = batch()
    # old - behaviour = log 3 on seq 0, log 0.5 on seq 1
    beh = old - torch.tensor([[math.log(3)] * 3, [math.log(0.5)] * 3])
    tis, mt = grpo_loss(logp, old, adv, mask, behaviour_logp=beh, off_policy="tis", is_cap=2.0)
    assert float(tis) == pytest.approx((2.0 * (-1.0 - 1.28 - 0.5) + 0.5 * 0.8) / 4, abs=1e-6)
    assert mt["is_weight_mean"] == pytest.approx((2 * 3 + 0.5) / 4, abs=1e-6)
    dec, _ = grpo_loss(logp, old, adv, mask, behaviour_logp=beh, off_policy="decoupled", is_cap=None)
    assert float(dec) == pytest.approx((3.0 * (-1.0 - 1.28 - 0.5) + 0.5 * 0.8) / 4, abs=1e-5)
    with pytest.raises(ValueError):
        grpo_loss(logp, old, adv, mask, off_policy="tis")


def test_k3_kl():
    logp, old, adv, mask = batch()
    base, _ = grpo_loss(logp, old, adv, mask)
    ref = logp.detach() + math.log(2)  # k3 = 2 - log 2 - 1 per token
    loss, m = grpo_loss(logp, old, adv, mask, ref_logp=ref, kl_coef=0.1)
    assert m["kl"] == pytest.approx(1 - math.log(2), abs=1e-6)
    assert float(loss) == pytest.approx(float(base) + 0.1 * (1 - math.log(2)), abs=1e-6)
    _, m0 = grpo_loss(logp, old, adv, mask, ref_logp=logp.detach(), kl_coef=0.1)
    assert m0["kl"] == pytest.approx(0.0, abs=1e-7)


def test_collate_places_response_tokens_at_targets():
    ids, att, mask, extra = collate([np.array([1, 10]), np.array([1])], [np.array([20, 21, 2]), np.array([30])],
                                    {"b": [np.array([-1, -2, -3], np.float32), np.array([-4], np.float32)]},
                                    loss_masks=[np.array([1, 0, 1], np.uint8), None])
    assert ids.tolist() == [[1, 10, 20, 21, 2], [1, 30, 0, 0, 0]]
    assert att.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert mask.tolist() == [[0, 1, 0, 1], [1, 0, 0, 0]]
    assert extra["b"].tolist() == [[0, -1, -2, -3], [-4, 0, 0, 0]]
    back = response_logprobs(extra["b"], [2, 1], [3, 1])
    assert [x.tolist() for x in back] == [[-1, -2, -3], [-4]]


def test_gae_hand_computed():
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 5.0]])
    v = torch.tensor([[0.5, 0.6, 0.7], [0.5, 0.6, 9.0]])
    m = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = gae(r, v, m, gamma=1.0, lam=0.5)
    np.testing.assert_allclose(adv.numpy(), [[0.225, 0.25, 0.3], [0.3, 0.4, 0.0]], atol=1e-6)
    np.testing.assert_allclose(ret.numpy(), [[0.725, 0.85, 1.0], [0.8, 1.0, 0.0]], atol=1e-6)


def test_value_loss_clipped():
    loss = value_loss(torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0, 1.0]]), torch.tensor([[0.0, 3.0]]),
                      torch.tensor([[1, 1]]), clip=0.2)
    assert float(loss) == pytest.approx(0.5 * (1.0 + 1.8 ** 2) / 2, abs=1e-6)
