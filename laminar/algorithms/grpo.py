"""GRPO (docs/architecture.md §9; docs/learning.md): group-normalized advantages, per-token logprobs,
the Clip-Higher policy loss (PPO's policy term too: `clipped_policy_loss`).

Every per-token tensor is [B, T-1], in the trainer's target layout (roles/trainer/batching.py:
position t holds what the model says about token t+1; response token j of a sequence with P
prompt tokens sits at position P-1+j). How the logprobs are computed is roles/trainer/logprobs.py's.

Loss (per valid token, A = the sequence's advantage, r = exp(logp - old)):
    pg   = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))      (Clip-Higher: eps_high > eps_low)
    pg   = min(pg, c |A|)  where A < 0, with dual_clip = c > 1 (optional): a stale token whose
           ratio exploded cannot dominate the batch (without it -A r is unbounded)
    pg  *= w   with off-policy correction, w from rho = old / behaviour (detached; off_policy.py):
               "tis": w = min(rho, is_cap) (truncated importance sampling);
               "mis": w = rho inside the band [is_low, is_cap], else the token is dropped (masked IS);
               "decoupled": clip against the proximal policy `old`, times tis's w (decoupled PPO);
               rho per token, per sequence (their product) or geometric (its per-token mean), is_level
    kl   = exp(ref - logp) - (ref - logp) - 1                     (k3 estimator, if ref given)
    loss = (sum pg + kl_coef * sum kl) / N                       N = valid tokens in the mini-batch
Every exponent is masked first (0 at prompt, pad and tool-output positions), so logprobs there,
however negative (reference logprobs are 0 outside the response), cannot overflow into inf * 0 = NaN.
Token-level aggregation: every valid token of the mini-batch weighs the same, whatever its
sequence's length. Pass `num_tokens` (the mini-batch's count) when a mini-batch is split into
micro-batches, so the micro-batch losses (and metrics) add up to the mini-batch's.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from laminar.algorithms.off_policy import importance_weights


def group_advantages(rewards: Sequence[Sequence[float]], eps: float = 1e-6,
                     std_normalize: bool = True) -> list[np.ndarray]:
    """Per group: (r - mean) / (std + eps), std unbiased; a group of one, or with equal
    rewards, gets zero advantages (no signal)."""
    out = []
    for g in rewards:
        r = np.asarray(g, dtype=np.float64)
        if len(r) < 2:
            out.append(np.zeros_like(r, dtype=np.float32))
            continue
        a = r - r.mean()
        if std_normalize:
            a = a / (r.std(ddof=1) + eps)
        out.append(a.astype(np.float32))
    return out


def clipped_policy_loss(logp, old_logp, advantages, mask, *, eps_low: float = 0.2, eps_high: float = 0.28,
              behaviour_logp=None, off_policy: str = "none", is_cap: float | None = 2.0,
              ref_logp=None, kl_coef: float = 0.0, num_tokens: float | None = None, entropy=None,
              dual_clip: float | None = None, is_level: str = "token", is_low: float | None = None):
    """The clipped policy loss of a (micro-)batch, GRPO's and PPO's policy term alike; see the
    module docstring. `advantages` is [B] (one per sequence: GRPO) or [B, T-1] (per token: PPO's
    GAE). Returns (loss, metrics) where each metric is a sum over the valid
    tokens divided by N (so micro-batch metrics add up to the mini-batch mean)."""
    import torch  # late: torch; configs validate without it
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip!r}")
    mask = mask.float()
    valid = mask > 0
    n = float(num_tokens) if num_tokens is not None else max(float(mask.sum()), 1.0)
    A = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(logp)

    def masked(x):  # an exponent, 0 outside the valid tokens (exp -> 1 there, never inf)
        return torch.where(valid, x, torch.zeros_like(x))

    ratio = torch.exp(masked(logp - old_logp))
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    pg = torch.maximum(-A * ratio, -A * clipped)
    dual = None
    if dual_clip is not None:
        bound = -A * dual_clip
        dual = (A < 0) & (pg > bound)
        pg = torch.where(A < 0, torch.minimum(pg, bound), pg)
    w = dropped = None
    if off_policy in ("tis", "mis", "decoupled"):
        if behaviour_logp is None:
            raise ValueError(f"off_policy={off_policy!r} needs behaviour logprobs")
        w, dropped = importance_weights(old_logp, behaviour_logp, mask, mode="mis" if off_policy == "mis" else "tis",
                                        level=is_level, cap=is_cap, low=is_low)
        pg = pg * w
    elif off_policy != "none":
        raise ValueError(f"off_policy must be none, tis, mis or decoupled, got {off_policy!r}")
    pg_loss = (pg * mask).sum() / n
    loss = pg_loss
    with torch.no_grad():
        metrics = {
            "pg_loss": float(pg_loss.detach()),
            "clip_frac_low": float(((ratio < 1.0 - eps_low) & (A < 0) & valid).sum()) / n,
            "clip_frac_high": float(((ratio > 1.0 + eps_high) & (A > 0) & valid).sum()) / n,
            "ratio_mean": float((ratio * mask).sum()) / n,
        }
        if dual is not None:
            metrics["clip_frac_dual"] = float((dual & valid).sum()) / n
        if w is not None:
            metrics["is_weight_mean"] = float((w * mask).sum()) / n
            metrics["is_dropped_frac"] = float(dropped.sum()) / n
            if is_cap is not None and off_policy != "mis":
                metrics["is_truncated_frac"] = float(((w >= is_cap * (1 - 1e-6)) & valid).sum()) / n
        if entropy is not None:
            metrics["entropy"] = float((entropy * mask).sum()) / n
    if ref_logp is not None:
        d = masked(ref_logp - logp)
        kl = ((torch.exp(d) - d - 1.0) * mask).sum() / n
        loss = loss + kl_coef * kl
        metrics["kl"] = float(kl.detach())
    metrics["loss"] = float(loss.detach())
    return loss, metrics


grpo_loss = clipped_policy_loss  # the name GRPO's papers use; the same function
