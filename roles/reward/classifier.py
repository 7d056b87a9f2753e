"""ClassifierScorer: a sequence-classification model (a score head on a transformer) run with
transformers, batched by tokens.

The model reads the trajectory's own token ids (prompt + response): it must share the policy's
vocabulary (a reward model fine-tuned from the policy's base, as is usual). Trajectories are
sorted by length and cut into batches whose padded size (count x longest) stays under
`max_batch_tokens`; right padding with an attention mask; the score is the logit `label` at the
last real token (what a transformers *ForSequenceClassification head returns), or its sigmoid.
"""
from __future__ import annotations

import asyncio

import numpy as np
import torch

from laminar.protocol import Trajectory


def token_batches(lengths: list[int], max_batch_tokens: int) -> list[list[int]]:
    """Indices cut into batches, by length, each with count x longest <= max_batch_tokens
    (one item per batch at least)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    out, cur, longest = [], [], 0
    for i in order:
        n = max(longest, lengths[i])
        if cur and n * (len(cur) + 1) > max_batch_tokens:
            out.append(cur)
            cur, n = [], lengths[i]
        cur.append(i)
        longest = n
    if cur:
        out.append(cur)
    return out


class ClassifierScorer:
    """Scores trajectories with a transformers sequence-classification model."""

    def __init__(self, s):
        from transformers import AutoModelForSequenceClassification  # late: seconds to import
        if s.threads:
            torch.set_num_threads(s.threads)
        self.s = s
        self.model = AutoModelForSequenceClassification.from_pretrained(s.model_dir).to(s.device).eval()
        self.pad = self.model.config.pad_token_id if self.model.config.pad_token_id is not None else 0
        self.parse_failures = 0

    def ids(self, t: Trajectory) -> np.ndarray:
        ids = np.concatenate([np.asarray(t.spec.prompt_tokens, np.int64), np.asarray(t.response_tokens, np.int64)])
        return ids[-self.s.max_length:]

    @torch.inference_mode()
    def score_ids(self, seqs: list[np.ndarray]) -> list[float]:
        out = [0.0] * len(seqs)
        for idx in token_batches([len(x) for x in seqs], self.s.max_batch_tokens):
            n = max(len(seqs[i]) for i in idx)
            ids = torch.full((len(idx), n), self.pad, dtype=torch.long)
            mask = torch.zeros((len(idx), n), dtype=torch.long)
            for row, i in enumerate(idx):
                ids[row, :len(seqs[i])] = torch.from_numpy(seqs[i])
                mask[row, :len(seqs[i])] = 1
            logits = self.model(input_ids=ids.to(self.s.device), attention_mask=mask.to(self.s.device)).logits
            v = logits[:, self.s.label].float()
            if self.s.sigmoid:
                v = torch.sigmoid(v)
            for row, i in enumerate(idx):
                out[i] = float(v[row])
        return out

    async def score(self, trajs: list[Trajectory]) -> tuple[list[float], list[str]]:
        """(a score per trajectory, ids scored by a fallback: none for a classifier)."""
        return await asyncio.to_thread(self.score_ids, [self.ids(t) for t in trajs]), []

    async def close(self) -> None:
        pass
