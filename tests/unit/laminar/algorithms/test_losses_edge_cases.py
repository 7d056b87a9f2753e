"""The loss fixes: multi-turn GAE carries value and advantage across masked observation tokens
(right-padded results unchanged to the bit), the k3 KL and the ratios are masked before their
exponentials (no NaN from prompt or pad positions), and the optional dual clip bounds the loss of
negative-advantage tokens at c * |A|."""
from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from laminar.algorithms.grpo import grpo_loss  # noqa: E402
from laminar.algorithms.ppo import gae, sequence_gae  # noqa: E402


def gae_before_the_fix(rewards, values, mask, gamma=1.0, lam=0.95):
    """The recursion as it was, kept verbatim: a masked token cut the episode."""
    mask = mask.float()
    B, T = rewards.shape
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    last = torch.zeros(B, dtype=torch.float32)
    next_v = torch.zeros(B, dtype=torch.float32)
    next_m = torch.zeros(B, dtype=torch.float32)
    for t in range(T - 1, -1, -1):
        delta = rewards[:, t] + gamma * next_v * next_m - values[:, t]
        last = delta + gamma * lam * next_m * last
        last = last * mask[:, t]
        adv[:, t] = last
        next_v, next_m = values[:, t], mask[:, t]
    return adv, (adv + values) * mask


def plain_gae(reward, values, gamma, lam):
    """Reference GAE of one unmasked episode, reward at its last token, in float64."""
    n = len(values)
    adv = np.zeros(n)
    last = 0.0
    for t in range(n - 1, -1, -1):
        nv = values[t + 1] if t + 1 < n else 0.0
        r = reward if t == n - 1 else 0.0
        last = r + gamma * nv - values[t] + gamma * lam * last
        adv[t] = last
    return adv


def test_multi_turn_gae_carries_across_tool_output():
    # two turns of 3 and 2 policy tokens with a 3-token tool output between them; the outcome
    # reward comes at the very end
    mask = np.array([1, 1, 1, 0, 0, 0, 1, 1], np.float32)
    rng = np.random.default_rng(0)
    values = rng.normal(size=8).astype(np.float32)
    adv, ret = sequence_gae(1.0, values, gamma=0.9, lam=0.8, mask=mask)
    keep = mask > 0
    # the episode the policy sees is its own tokens: observation tokens are skipped, not an end
    expected = plain_gae(1.0, values[keep].astype(np.float64), 0.9, 0.8)
    np.testing.assert_allclose(adv[keep], expected, atol=1e-5)
    np.testing.assert_allclose(ret[keep], expected + values[keep], atol=1e-5)
    assert np.all(adv[~keep] == 0) and np.all(ret[~keep] == 0)
    # the first turn learns from the outcome: with gamma = lam = 1 and zero values its
    # advantage is the reward, not 0
    adv1, _ = sequence_gae(1.0, np.zeros(8, np.float32), gamma=1.0, lam=1.0, mask=mask)
    np.testing.assert_allclose(adv1[keep], np.ones(5), atol=1e-6)


def test_batched_gae_skips_masked_tokens_inside_a_sequence():
    r = torch.tensor([[0.0, 0.0, 0.0, 2.0]])
    v = torch.tensor([[0.1, 7.0, 0.3, 0.4]])   # the observation token's value must not be used
    m = torch.tensor([[1, 0, 1, 1]])
    adv, ret = gae(r, v, m, gamma=1.0, lam=1.0)
    # Monte-Carlo returns (lam = 1): every policy token's return is 2
    np.testing.assert_allclose(ret.numpy(), [[2.0, 0.0, 2.0, 2.0]], atol=1e-6)
    np.testing.assert_allclose(adv.numpy(), [[1.9, 0.0, 1.7, 1.6]], atol=1e-6)


def test_right_padded_gae_is_bit_identical():
    g = torch.Generator().manual_seed(3)
    B, T = 16, 40
    lens = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lens[:, None]).to(torch.long)
    values = torch.randn(B, T, generator=g)
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), lens - 1] = torch.randn(B, generator=g)
    rewards += torch.randn(B, T, generator=g) * 0.1 * mask  # dense rewards too
    for gamma, lam in ((1.0, 0.95), (0.99, 0.9), (0.9, 1.0)):
        a0, r0 = gae_before_the_fix(rewards, values, mask, gamma, lam)
        a1, r1 = gae(rewards, values, mask, gamma, lam)
        assert torch.equal(a0, a1) and torch.equal(r0, r1)
    for b in range(4):  # and the one-sequence path the trainer uses
        n = int(lens[b])
        ref_a, ref_r = gae_before_the_fix(rewards[b:b + 1, :n] * 0 + torch.nn.functional.one_hot(
            torch.tensor([n - 1]), n).float() * 0.7, values[b:b + 1, :n], torch.ones(1, n), 0.99, 0.9)
        a, r = sequence_gae(0.7, values[b, :n].numpy(), 0.99, 0.9)
        assert np.array_equal(a, ref_a[0].numpy()) and np.array_equal(r, ref_r[0].numpy())


def kl_batch():
    # one sequence: a prompt position (target 0), two response tokens, a pad position (target 3)
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    logp = torch.tensor([[-100.0, -1.0, -2.0, -95.0]], requires_grad=True)  # < -88.7 outside the response
    old = torch.tensor([[0.0, -1.1, -1.9, 0.0]])   # behaviour/ref logprobs are 0 outside the response
    ref = torch.tensor([[0.0, -1.2, -2.1, 0.0]])
    return logp, old, ref, mask


def test_kl_is_finite_with_very_negative_logprobs_outside_the_response():
    logp, old, ref, mask = kl_batch()
    loss, m = grpo_loss(logp, old, torch.tensor([1.0]), mask, ref_logp=ref, kl_coef=0.1)
    assert math.isfinite(float(loss)) and math.isfinite(m["kl"])
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 3] == 0
    d = ref[0, 1:3] - logp.detach()[0, 1:3]   # the KL is that of the two response tokens alone
    assert m["kl"] == pytest.approx(float((torch.exp(d) - d - 1).sum() / 2), abs=1e-6)


def test_ratio_and_is_weight_are_finite_when_masked_positions_disagree():
    # a masked (tool output) token whose behaviour logprob is very negative while the trainer's is not
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    logp = torch.tensor([[-1.0, -0.01, -1.0]], requires_grad=True)
    beh = torch.tensor([[-1.0, -120.0, -1.0]])
    for kw in ({}, {"behaviour_logp": beh, "off_policy": "tis"}, {"behaviour_logp": beh, "off_policy": "decoupled"}):
        old = beh if not kw else torch.tensor([[-1.0, -0.01, -1.0]])
        loss, m = grpo_loss(logp, old, torch.tensor([-1.0]), mask, **kw)
        assert math.isfinite(float(loss)) and all(math.isfinite(v) for v in m.values()), kw
        logp.grad = None
        loss.backward()
        assert torch.isfinite(logp.grad).all(), kw


def test_dual_clip_bounds_negative_advantage_tokens():
    old = torch.zeros(1, 2)
    logp = torch.tensor([[5.0, 5.0]], requires_grad=True)   # ratio e^5 (a stale behaviour logprob)
    adv = torch.tensor([[-1.5, 1.0]])                        # one negative, one positive advantage token
    mask = torch.ones(1, 2)
    plain, _ = grpo_loss(logp, old, adv, torch.tensor([[1.0, 0.0]]))  # the negative token alone
    assert float(plain) == pytest.approx(1.5 * math.exp(5), rel=1e-5)  # unbounded without it
    loss, m = grpo_loss(logp, old, adv, mask, dual_clip=3.0)
    # negative A: min(max(-A r, -A clip(r)), c |A|) = 3 * 1.5; positive A: -A (1 + eps_high)
    assert float(loss) == pytest.approx((3.0 * 1.5 + -1.0 * 1.28) / 2, abs=1e-5)
    assert m["clip_frac_dual"] == pytest.approx(0.5)
    loss.backward()
    np.testing.assert_allclose(logp.grad.numpy(), [[0.0, 0.0]], atol=1e-7)  # both clipped: no gradient
    # below the bound it changes nothing
    small = torch.tensor([[0.1, 0.1]])
    a, _ = grpo_loss(small, old, adv, mask, dual_clip=3.0)
    b, _ = grpo_loss(small, old, adv, mask)
    assert float(a) == float(b)
    with pytest.raises(ValueError, match="dual_clip"):
        grpo_loss(logp, old, adv, mask, dual_clip=1.0)


def test_dual_clip_is_a_trainer_setting_with_c_3():
    from laminar.roles.trainer.config import TrainerConfig
    from pydantic import ValidationError
    c = TrainerConfig(model_dir="m", loss={"dual_clip": True})
    assert c.loss.dual_clip and c.loss.dual_clip_c == 3.0
    assert not TrainerConfig(model_dir="m").loss.dual_clip   # off unless asked for
    with pytest.raises(ValidationError):
        TrainerConfig(model_dir="m", loss={"dual_clip": True, "dual_clip_c": 1.0})
