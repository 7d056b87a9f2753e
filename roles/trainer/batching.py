"""The trainer's batch layout: right-padded `prompt + response` sequences and their per-token arrays.

A batch of B sequences is right-padded to T tokens. Every per-token tensor lives on the T-1
*target* positions: position t holds what the model says about token t+1 (logits[:, t] predicts
input_ids[:, t+1]), so response token j of a sequence with P prompt tokens sits at position P-1+j.
`collate()` builds that layout from per-trajectory arrays (behaviour, proximal and reference
logprobs, PPO's values and advantages, the loss mask of tool outputs); `response_logprobs()` maps a
[B, T-1] result back to one array per response. The losses (laminar/algorithms/) and the packed
path (packing.py, which maps its row back to this layout) all read it; which sequences go into
one micro-batch, on which rank, is micro_batches.py's.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def collate(prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray],
            per_token: dict[str, Sequence[np.ndarray | None]] | None = None,
            loss_masks: Sequence[np.ndarray | None] | None = None, pad_id: int = 0):
    """Right-pad `prompt + response` sequences; returns (input_ids [B,T], attention_mask [B,T],
    response_mask [B,T-1] float, {name: [B,T-1] float}) with per-response-token arrays (e.g.
    behaviour logprobs) placed at their target positions (0 elsewhere)."""
    import torch  # late: torch; configs validate without it
    B = len(prompts)
    lens = [len(p) + len(r) for p, r in zip(prompts, responses, strict=False)]
    T = max(lens)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    att = torch.zeros((B, T), dtype=torch.long)
    mask = torch.zeros((B, T - 1), dtype=torch.float32)
    extra = {k: torch.zeros((B, T - 1), dtype=torch.float32) for k in (per_token or {})}
    for b, (p, r) in enumerate(zip(prompts, responses, strict=False)):
        P, R = len(p), len(r)
        ids[b, :P] = torch.tensor(np.asarray(p, dtype=np.int64))
        ids[b, P:P + R] = torch.tensor(np.asarray(r, dtype=np.int64))
        att[b, :P + R] = 1
        lm = None if loss_masks is None else loss_masks[b]
        m = np.ones(R, np.float32) if lm is None else np.asarray(lm, np.float32)
        mask[b, P - 1:P - 1 + R] = torch.tensor(m)
        for k, arrs in (per_token or {}).items():
            if arrs[b] is not None:
                extra[k][b, P - 1:P - 1 + R] = torch.tensor(np.asarray(arrs[b], np.float32))
    return ids, att, mask, extra


def response_logprobs(logp_targets, prompt_lens: Sequence[int], response_lens: Sequence[int]) -> list[np.ndarray]:
    """Back from the target layout to one float32 array per response (for caching proximal/ref)."""
    out = []
    lp = logp_targets.detach().float().cpu().numpy()
    for b, (P, R) in enumerate(zip(prompt_lens, response_lens, strict=False)):
        out.append(lp[b, P - 1:P - 1 + R].copy())
    return out
