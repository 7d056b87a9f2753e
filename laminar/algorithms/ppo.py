"""PPO with a critic (DESIGN §6 option): generalized advantage estimation and the clipped value loss.

Token-level MDP: one reward per token (usually only the last one is non-zero), a value per
token; `mask` marks valid tokens and the episode ends after the last valid one (bootstrap 0).
"""
from __future__ import annotations


def gae(rewards, values, mask, gamma: float = 1.0, lam: float = 0.95):
    """Advantages and returns [B, T] by GAE(gamma, lambda):
        delta_t = r_t + gamma V_{t+1} m_{t+1} - V_t,   A_t = delta_t + gamma lam m_{t+1} A_{t+1}
    computed right to left; invalid positions get 0. returns = A + V."""
    import torch
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


def value_loss(values, old_values, returns, mask, clip: float | None = 0.2, num_tokens: float | None = None):
    """0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2), token-level mean over mask."""
    import torch
    mask = mask.float()
    n = float(num_tokens) if num_tokens is not None else max(float(mask.sum()), 1.0)
    err = (values - returns) ** 2
    if clip is not None:
        vc = old_values + torch.clamp(values - old_values, -clip, clip)
        err = torch.maximum(err, (vc - returns) ** 2)
    return 0.5 * (err * mask).sum() / n
