"""Forwards: how one batch's sequences go through the trainer's models (engine.py's data path).

    minibatches(order)    mini-batch j = the j-th slice of the batch's permutation
    plan / chunks         every rank's micro-batches of a mini-batch (micro_batches.py), made once
                          a batch and reused by every pass (`plans`; `new_batch` forgets them)
    inputs                a micro-batch collated (batching.py) onto the device, an empty one as
                          the batch's shortest sequence with weight 0; a mixture-of-experts
                          policy's recorded routing staged for its routers (routing_replay.py)
    logprobs / values     per-token logprobs (and entropies) or the critic's values [B, T-1]:
                          context-parallel (context_parallel.py), packed (packing.py: no compute
                          on padding) or padded, logprobs chunked (logprobs.py)
    model_logprobs        a model's no-grad logprobs of this rank's sequences (proximal,
                          reference, lag and the mismatch's passes), one array per response
    autocast              bfloat16 compute when `performance.dtype` says so

Nothing here computes a loss or steps an optimizer: that is the engine's update.
"""
from __future__ import annotations

import numpy as np
from laminar.roles.trainer.batching import collate, response_logprobs
from laminar.roles.trainer.context_parallel import cp_logprobs, cp_values
from laminar.roles.trainer.dist import DistInfo
from laminar.roles.trainer.logprobs import token_logprobs
from laminar.roles.trainer.micro_batches import MicroBatchPlan, plan_micro_batches
from laminar.roles.trainer.packing import packed_token_logprobs, packed_values

__all__ = ["Forwards"]


def _length(t) -> int:
    """Tokens a trajectory puts through the model: prompt + response."""
    return len(t.spec.prompt_tokens) + len(t.response_tokens)


class Forwards:
    """The micro-batch plans, inputs and forward passes of one batch over a ModelSet's models.
    Owns `packing` (micro-batches forwarded as one packed row) and `plans` (this batch's)."""

    def __init__(self, settings, device, info: DistInfo, packing: bool, models):
        self.settings, self.device, self.info = settings, device, info
        self.packing = packing
        self.models = models  # the engine's ModelSet: its critic, its MoE routing, its attention_tokens
        self.plans: dict[tuple[int, ...], MicroBatchPlan] = {}  # this batch's (every pass reuses them)

    def new_batch(self) -> None:
        """Forget the last batch's plans."""
        self.plans = {}

    def logprobs(self, model, ids, att, with_entropy: bool = False):
        """Per-token logprobs (and entropies) [B, T-1] of a right-padded micro-batch: from its
        packed row when packing is on (no compute on padding), else from the padded batch."""
        chunk = self.settings.performance.logprob_chunk_tokens
        if self.info.cp_size > 1:  # the tokens split over the CP group
            return cp_logprobs(model, ids, att, self.info, packing=self.packing, with_entropy=with_entropy,
                               chunk_tokens=chunk)
        if self.packing:
            return packed_token_logprobs(model, ids, att, with_entropy=with_entropy, chunk_tokens=chunk)
        return token_logprobs(model, ids, att, with_entropy=with_entropy, chunk_tokens=chunk)

    def values(self, ids, att):
        """The critic's values [B, T-1] of a right-padded micro-batch (packed when packing is on)."""
        if self.info.cp_size > 1:
            return cp_values(self.models.critic, ids, att, self.info, packing=self.packing)
        if self.packing:
            return packed_values(self.models.critic, ids, att)
        return self.models.critic(ids, att)[:, :-1]

    def plan(self, trajs, idx: list[int]) -> MicroBatchPlan:
        """Every rank's micro-batches of the mini-batch `idx` (the same on every rank; made once a batch)."""
        c, lengths = self.settings, [_length(trajs[i]) for i in idx]
        key = (*idx, -1, *lengths)  # the plan is a function of these alone
        if key not in self.plans:
            p = c.performance
            self.plans[key] = plan_micro_batches(idx, lengths, self.info.dp_size, p.micro_batch_size,
                                                 p.max_tokens_per_micro_batch, p.micro_batch_balance,
                                                 padded=not self.packing,
                                                 attention_tokens=self.models.attention_tokens)
        return self.plans[key]

    def chunks(self, trajs, idx: list[int]) -> list[list[int]]:
        """This rank's micro-batches of `idx`; the same count on every rank (some may be empty)."""
        return self.plan(trajs, idx).ranks[self.info.dp_rank]

    def inputs(self, trajs, idx, per=None):
        """The micro-batch `idx` on the device: (ids, att, mask, extras) with `per`'s per-token
        arrays in extras."""
        # an empty micro-batch forwards the batch's shortest sequence with weight 0
        take = idx if idx else [min(range(len(trajs)), key=lambda i: _length(trajs[i]))]
        ids, att, mask, ex = collate([trajs[i].spec.prompt_tokens for i in take],
                                     [trajs[i].response_tokens for i in take],
                                     {k: [v[i] for i in take] for k, v in (per or {}).items()},
                                     [trajs[i].loss_mask for i in take])
        if not idx:
            mask.zero_()
        d = self.device
        if self.models.moe is not None:  # this micro-batch's recorded routing, for its routers
            self.models.moe.stage([trajs[i].routing for i in take], [_length(trajs[i]) for i in take],
                                  ids.shape[1], self.packing, d, [trajs[i].version for i in take])
        return ids.to(d), att.to(d), mask.to(d), {k: v.to(d) for k, v in ex.items()}

    def model_logprobs(self, model, trajs, order: list[int]) -> list:
        """The no-grad per-token logprobs of `model` for this rank's sequences of `order` (the
        proximal, reference and lag passes, and the mismatch's own forwards)."""
        return self.per_token(lambda i, a: self.logprobs(model, i, a)[0], trajs, order)

    def per_token(self, fn, trajs, order: list[int]) -> list:
        """fn(ids, att) -> [b, T-1] under no_grad, for this rank's sequences of every mini-batch;
        one float32 array per owned response (None for the others)."""
        import torch  # late: torch; configs validate without it
        out: list = [None] * len(trajs)
        with torch.no_grad(), self.autocast():
            for mb in self.minibatches(order):
                for idx in self.chunks(trajs, mb):
                    ids, att, _, _ = self.inputs(trajs, idx)
                    vals = fn(ids, att)
                    if idx:
                        arrs = response_logprobs(vals, [len(trajs[i].spec.prompt_tokens) for i in idx],
                                                 [len(trajs[i].response_tokens) for i in idx])
                        for i, a in zip(idx, arrs, strict=False):
                            out[i] = a
        return out

    def autocast(self):
        """bfloat16 compute under autocast; parameters, gradients and Adam states stay float32."""
        import torch  # late: torch; configs validate without it
        bf16 = self.settings.performance.dtype == "bfloat16"
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=bf16)

    def minibatches(self, order: list[int]) -> list[list[int]]:
        """The batch's mini-batches: `minibatch_steps` slices of its permutation `order`."""
        return [m.tolist() for m in np.array_split(np.array(order, dtype=np.int64), self.settings.minibatch_steps)]

