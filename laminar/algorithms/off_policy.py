"""Off-policy corrections of the policy loss: importance weights between the proximal policy (the
trainer's own logprobs at the weights a batch starts from) and the behaviour policy (the rollout's
logprobs, of the version that generated the sample), at three levels, truncated or masked.

Every sample after the first version is stale by design (asynchronous rollouts), and the rollout
engine's kernels differ from the trainer's; the ratio between the two policies measures both. Per
valid token t of sequence i, with d_t = old_t - behaviour_t (0 outside the valid tokens):

    level token:      log rho_t = d_t                              one ratio per token
    level sequence:   log rho_i = sum_t d_t                        the sequence's likelihood ratio
    level geometric:  log rho_i = (sum_t d_t) / n_i                its geometric mean per token (n_i tokens)

(a sequence-level ratio applies to every token of its sequence), then

    tis (truncated IS):  w = min(rho, cap)                      every token kept
    mis (masked IS):     w = rho if low <= rho <= cap else 0    a token (level token) or a whole
                                                                sequence (sequence, geometric) whose
                                                                ratio leaves the band is dropped

The weight multiplies the token's clipped policy loss (grpo.py); it is a constant (no gradient).
A dropped token still counts in the loss's token mean N, as a token of zero advantage would: the
kept tokens' step does not grow when many are dropped, and N is the same on every rank without a
collective. The sequence ratio of a long response is a product of many token ratios: it is
computed in log space and its exponent bounded (`MAX_LOG`) so it never overflows; truncation and
the band compare in log space.

`ratio_distribution` summarizes a batch's ratios (per version, in the trainer's metrics): the
sequence log-ratio's quantiles, the geometric ratio's extremes, by staleness the mean |log ratio|,
and the effective sample size of the sequence weights.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

LEVELS = ("token", "sequence", "geometric")
MODES = ("tis", "mis")
MAX_LOG = 30.0   # exp(30) ~ 1e13: any ratio past it is truncated or dropped anyway


def level_log_ratio(old, behaviour, mask, level: str):
    """log rho per token position [B, T] at `level` (module docstring); 0 outside the mask."""
    import torch  # late: torch; the trainer imports this module, configs validate without it
    if level not in LEVELS:
        raise ValueError(f"is_level must be one of {', '.join(LEVELS)}, got {level!r}")
    valid = mask > 0
    d = torch.where(valid, old - behaviour, torch.zeros_like(old))
    if level == "token":
        return d
    total = d.sum(dim=-1, keepdim=True)
    if level == "geometric":
        total = total / valid.sum(dim=-1, keepdim=True).clamp(min=1)
    return torch.where(valid, total.expand_as(d), torch.zeros_like(d))


def importance_weights(old, behaviour, mask, *, mode: str = "tis", level: str = "token", cap: float | None = 2.0,
                       low: float | None = None):
    """(w, dropped): the constant weights [B, T] (0 outside the mask) and the boolean [B, T] of
    valid tokens a masked correction drops. `cap`: tis's truncation and the band's top (None: no
    truncation; mis needs a cap); `low`: the band's bottom (default 1 / cap)."""
    import torch  # late: torch; the trainer imports this module, configs validate without it
    if mode not in MODES:
        raise ValueError(f"off-policy mode must be one of {', '.join(MODES)}, got {mode!r}")
    with torch.no_grad():
        log_rho = level_log_ratio(old.detach(), behaviour.detach(), mask, level).clamp(-MAX_LOG, MAX_LOG)
        valid = mask > 0
        if mode == "tis":
            if cap is not None:
                log_rho = log_rho.clamp(max=math.log(cap))
            dropped = torch.zeros_like(valid)
        else:
            if cap is None:
                raise ValueError("off_policy mis needs is_cap (the band's top)")
            lo = 1.0 / cap if low is None else low
            if not 0 < lo <= cap:
                raise ValueError(f"off_policy mis: the band [{lo}, {cap}] is empty")
            dropped = valid & ((log_rho > math.log(cap)) | (log_rho < math.log(lo)))
        w = torch.where(valid & ~dropped, torch.exp(log_rho), torch.zeros_like(log_rho))
    return w, dropped


def sequence_log_ratio(old, behaviour, mask=None) -> tuple[float, int]:
    """(sum of old - behaviour over the valid tokens, valid tokens) of one response (1-D arrays)."""
    d = np.asarray(old, np.float64) - np.asarray(behaviour, np.float64)
    keep = np.isfinite(d) if mask is None else np.isfinite(d) & (np.asarray(mask)[:d.size] > 0)
    return float(d[keep].sum()), int(keep.sum())


def ratio_distribution(seqs: Sequence[tuple[float, int]], staleness: Sequence[int] = ()) -> dict[str, float]:
    """The batch's ratio distribution from each sequence's (log ratio, tokens): quantiles of the
    sequence log-ratio, extremes of the geometric ratio, the effective sample size of the sequence
    weights (sum w)^2 / (n sum w^2) in (0, 1], and by staleness s the mean |sequence log-ratio|."""
    if not seqs:
        return {}
    lr = np.array([s for s, _ in seqs], np.float64)
    n = np.array([max(t, 1) for _, t in seqs], np.float64)
    geo = lr / n
    w = np.exp(np.clip(lr - lr.max(), -MAX_LOG * 4, 0.0))  # scaled by a constant: ESS is scale-free
    out = {"is_seq_logratio_p05": float(np.quantile(lr, 0.05)), "is_seq_logratio_p50": float(np.median(lr)),
           "is_seq_logratio_p95": float(np.quantile(lr, 0.95)), "is_seq_logratio_min": float(lr.min()),
           "is_seq_logratio_max": float(lr.max()), "is_geo_ratio_min": float(np.exp(geo.min())),
           "is_geo_ratio_max": float(np.exp(geo.max())),
           "is_seq_ess": float(w.sum() ** 2 / (len(w) * (w ** 2).sum()))}
    if len(staleness) == len(seqs):
        st = np.asarray(staleness)
        for s in sorted(set(st.tolist())):
            out[f"is_seq_logratio_abs_mean_stale{s}"] = float(np.abs(lr[st == s]).mean())
    return out
