"""TrainEngine: the torch side of the trainer — models, optimizers, one global batch of updates.

It knows nothing of the bus or asyncio (the role runs it in a worker thread) and is the same code
on one rank and on many (FSDP2, see dist.py). Every rank holds the whole batch; mini-batch j is
the j-th slice of a permutation seeded by (seed, version), so all ranks agree without talking,
and rank r trains the sequences r, r+W, ... of each mini-batch. Every rank runs the same number
of forward/backward calls (an empty share runs a zero-weight dummy), because each FSDP2 call is
a collective. Losses are token-level over the whole mini-batch: each rank divides by the
mini-batch's total valid tokens and the gradients are summed over ranks.

    grpo: advantages = group-normalized rewards, one per sequence
    ppo:  advantages = GAE over the critic's values (reward at the last token), whitened over the
          batch; the critic is trained with the clipped value loss by its own AdamW
Both use the same Clip-Higher policy loss, optional dual clip, k3 KL, TIS or decoupled-PPO corrections.

A mini-batch whose loss or gradient norm is not finite (on any rank) is skipped: no optimizer
steps, its gradients dropped, its metrics left out, the step counted in `skipped_nonfinite_steps`
(per version and in total) and logged as `nonfinite_step_skipped`. full_state(), the path of
every publish and checkpoint, refuses weights with a NaN or inf (NonFiniteWeightsError).
"""
from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import structlog

from laminar.roles.trainer.checkpoint import NonFiniteWeightsError, check_finite
from laminar.roles.trainer.dist import DistInfo, all_reduce_sums, broadcast_ints, shard

__all__ = ["NonFiniteWeightsError", "TrainEngine"]
log = structlog.get_logger("laminar.trainer.engine")


class TrainEngine:
    def __init__(self, cfg, seed: int, device, info: DistInfo | None = None):
        self.cfg, self.seed, self.device = cfg, seed, device
        self.info = info or DistInfo()
        self.skipped_nonfinite_steps = 0  # over the engine's life (this process)

    # -- models --------------------------------------------------------------------------------
    def load(self) -> None:
        import torch
        from laminar.algorithms.ppo import load_critic
        from laminar.models.loading import load_causal_lm
        c = self.cfg
        self.model = load_causal_lm(c.model_dir, self.device)
        self.params = sum(p.numel() for p in self.model.parameters())
        shard(self.model, self.info, self.device)
        self.ref = None
        if c.kl_coef > 0:
            self.ref = load_causal_lm(c.model_dir, self.device, train=False)
            self.ref.requires_grad_(False)
            shard(self.ref, self.info, self.device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=c.lr, weight_decay=c.weight_decay)
        self.critic = self.critic_opt = None
        if c.algorithm == "ppo":
            self.critic = load_critic(c.model_dir, self.device)
            shard(self.critic, self.info, self.device)
            self.critic_opt = torch.optim.AdamW(self.critic.parameters(), lr=c.critic_lr, weight_decay=c.weight_decay)

    def _pairs(self) -> dict:
        out = {"model": (self.model, self.opt)}
        if self.critic is not None:
            out["critic"] = (self.critic, self.critic_opt)
        return out

    def full_state(self, with_optimizer: bool = False) -> dict | None:
        """Full (unsharded) state dicts, {part: state_dict}, on rank 0 (None elsewhere). A
        collective under FSDP2; on one rank the model's own tensors (no copy)."""
        if not self.info.enabled:
            parts = {}
            for name, (m, o) in self._pairs().items():
                parts[name] = m.state_dict()
                if with_optimizer:
                    parts[f"{name}_optimizer" if name != "model" else "optimizer"] = o.state_dict()
            self._check_weights(parts)
            return parts
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        parts = {}
        for name, (m, o) in self._pairs().items():
            parts[name] = get_model_state_dict(m, options=opts)
            if with_optimizer:
                parts[f"{name}_optimizer" if name != "model" else "optimizer"] = get_optimizer_state_dict(m, o, options=opts)
        if not self.info.is_main:
            return None
        self._check_weights(parts)
        return parts

    def _check_weights(self, parts: dict) -> None:
        """Weights with a NaN or inf never leave the trainer (publish or checkpoint)."""
        check_finite({n: parts[n] for n in self._pairs() if n in parts}, "publish or checkpoint the weights")

    def restore(self, parts: dict | None) -> None:
        """Load full state dicts (read by rank 0; the others receive them by broadcast)."""
        if not self.info.enabled:
            for name, (m, o) in self._pairs().items():
                if name != "model" and name not in parts:
                    continue  # e.g. a GRPO checkpoint resumed with PPO: the critic starts fresh
                m.load_state_dict(parts[name])
                o.load_state_dict(parts["optimizer" if name == "model" else f"{name}_optimizer"])
            return
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)
        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, cpu_offload=True)
        parts = parts or {}
        flags = broadcast_ints(self.info, [int(n in parts) for n in self._pairs()])  # rank 0 read the files
        have = {n for n, flag in zip(self._pairs(), flags) if flag}
        for name, (m, o) in self._pairs().items():
            if name != "model" and name not in have:
                continue
            set_model_state_dict(m, parts.get(name, {}), options=opts)
            set_optimizer_state_dict(m, o, parts.get("optimizer" if name == "model" else f"{name}_optimizer", {}), options=opts)

    # -- one global batch ------------------------------------------------------------------------
    def train(self, groups, version: int) -> dict:
        """All updates of one global batch (every rank calls it with the same groups)."""
        import torch
        from laminar.algorithms.grpo import group_advantages, grpo_loss, token_logprobs
        c = self.cfg
        trajs = [t for g in groups for t in g]
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + version)
        order = torch.randperm(len(trajs), generator=gen).tolist()
        per = {"beh": [np.asarray(t.logprobs, np.float32) for t in trajs]}
        needs_prox = c.old_logprobs == "recompute" or c.off_policy != "none"
        if needs_prox:
            per["prox"] = self._per_token(lambda i, a: token_logprobs(self.model, i, a)[0], trajs, order)
        if self.ref is not None:
            per["ref"] = self._per_token(lambda i, a: token_logprobs(self.ref, i, a)[0], trajs, order)
        out: dict[str, float] = {}
        if c.algorithm == "ppo":
            out.update(self._gae(trajs, order, per))
            seq_adv = None
        else:
            seq_adv = np.concatenate(group_advantages([[t.reward for t in g] for g in groups], 1e-6, c.adv_std_normalize))
            out["advantage_abs_mean"] = float(np.abs(seq_adv).mean())
        valid = [int(t.loss_mask.sum()) if t.loss_mask is not None else len(t.response_tokens) for t in trajs]
        scale = float(self.info.world_size)  # FSDP2 averages gradients over ranks; we want their sum
        totals: dict[str, float] = defaultdict(float)
        norms, vnorms, skipped = [], [], 0
        pairs = list(self._pairs().values())
        for mb in self._minibatches(order):
            ntok = sum(valid[i] for i in mb)
            if not mb or ntok == 0:
                continue
            for _, o in pairs:
                o.zero_grad(set_to_none=True)
            mb_totals: dict[str, float] = defaultdict(float)
            finite = True
            for idx in self._chunks(mb):
                ids, att, mask, ex = self._inputs(trajs, idx, per)
                with self._autocast():
                    logp, ent = token_logprobs(self.model, ids, att, with_entropy=c.entropy_metric)
                old = ex["prox"] if needs_prox else ex["beh"]
                adv = ex["adv"] if seq_adv is None else torch.as_tensor(seq_adv[idx or [0]], device=self.device)
                loss, m = grpo_loss(logp, old, adv, mask, eps_low=c.eps_low, eps_high=c.eps_high,
                                    behaviour_logp=ex["beh"], off_policy=c.off_policy, is_cap=c.is_cap,
                                    ref_logp=ex.get("ref"), kl_coef=c.kl_coef, num_tokens=ntok, entropy=ent,
                                    dual_clip=c.dual_clip_c if c.dual_clip else None)
                (loss * scale).backward()
                if self.critic is not None:
                    from laminar.algorithms.ppo import value_loss
                    with self._autocast():
                        values = self.critic(ids, att)[:, :-1]
                    vl = value_loss(values, ex["val"], ex["ret"], mask, c.value_clip, num_tokens=ntok)
                    (vl * scale).backward()
                    m["value_loss"] = float(vl.detach())
                finite = finite and all(math.isfinite(v) for v in m.values())
                for k, v in m.items():
                    mb_totals[k] += v * ntok
                if idx:
                    totals["tokens"] += float(att.sum())
            mb_norms, stepped = self._step(pairs, finite)
            if not stepped:
                skipped += 1
                log.warning("nonfinite_step_skipped", version=version, loss_finite=finite,
                            grad_norms=[round(n, 6) if math.isfinite(n) else str(n) for n in mb_norms],
                            skipped_total=self.skipped_nonfinite_steps)
                continue
            norms.append(mb_norms[0])
            if self.critic is not None:
                vnorms.append(mb_norms[1])
            for k, v in mb_totals.items():
                totals[k] += v
            totals["response_tokens"] += ntok
        totals = all_reduce_sums(self.info, dict(totals))
        tokens, counted = totals.pop("tokens", 0.0), totals.pop("response_tokens", 0.0)
        counted /= self.info.world_size  # every rank added each mini-batch's ntok
        out.update({k: v / max(counted, 1.0) for k, v in totals.items()})
        out.update(grad_norm=float(np.mean(norms)) if norms else 0.0, grad_norm_max=float(max(norms, default=0.0)),
                   tokens=tokens, response_tokens=counted, skipped_nonfinite_steps=float(skipped))
        if vnorms:
            out["critic_grad_norm"] = float(np.mean(vnorms))
        return out

    def _gae(self, trajs, order, per) -> dict:
        """Old values, GAE advantages and returns of this rank's sequences into `per`."""
        from laminar.algorithms.ppo import sequence_gae
        c = self.cfg
        per["val"] = self._per_token(lambda i, a: self.critic(i, a)[:, :-1], trajs, order)
        per["adv"], per["ret"] = [None] * len(trajs), [None] * len(trajs)
        s = {"n": 0.0, "sum": 0.0, "sq": 0.0}
        for i, v in enumerate(per["val"]):
            if v is None:
                continue
            t = trajs[i]
            per["adv"][i], per["ret"][i] = sequence_gae(t.reward, v, c.gamma, c.lam, t.loss_mask)
            m = np.ones(len(v), np.float32) if t.loss_mask is None else np.asarray(t.loss_mask, np.float32)
            a = per["adv"][i]
            s["n"] += float(m.sum())
            s["sum"] += float((a * m).sum())
            s["sq"] += float((a * a * m).sum())
        s = all_reduce_sums(self.info, s)
        mean = s["sum"] / max(s["n"], 1.0)
        std = math.sqrt(max(s["sq"] / max(s["n"], 1.0) - mean * mean, 0.0))
        if c.whiten_advantages:
            per["adv"] = [None if a is None else ((a - mean) / (std + 1e-6)).astype(np.float32) for a in per["adv"]]
        return {"advantage_mean_raw": mean, "advantage_std_raw": std}

    # -- helpers -------------------------------------------------------------------------------
    def _chunks(self, idx: list[int]) -> list[list[int]]:
        """This rank's micro-batches of `idx`; the same count on every rank (some may be empty)."""
        W, r, mbs = self.info.world_size, self.info.rank, self.cfg.micro_batch_size
        share = idx[r::W]
        rounds = math.ceil(math.ceil(len(idx) / W) / mbs)
        return [share[j * mbs:(j + 1) * mbs] for j in range(rounds)]

    def _inputs(self, trajs, idx, per=None):
        from laminar.algorithms.grpo import collate
        take = idx if idx else [0]  # an empty share forwards one sequence with weight 0
        ids, att, mask, ex = collate([trajs[i].spec.prompt_tokens for i in take], [trajs[i].response_tokens for i in take],
                                     {k: [v[i] for i in take] for k, v in (per or {}).items()},
                                     [trajs[i].loss_mask for i in take])
        if not idx:
            mask.zero_()
        d = self.device
        return ids.to(d), att.to(d), mask.to(d), {k: v.to(d) for k, v in ex.items()}

    def _per_token(self, fn, trajs, order: list[int]) -> list:
        """fn(ids, att) -> [b, T-1] under no_grad, for this rank's sequences of every mini-batch;
        one float32 array per owned response (None for the others)."""
        import torch
        from laminar.algorithms.grpo import response_logprobs
        out: list = [None] * len(trajs)
        with torch.no_grad(), self._autocast():
            for mb in self._minibatches(order):
                for idx in self._chunks(mb):
                    ids, att, _, _ = self._inputs(trajs, idx)
                    vals = fn(ids, att)
                    if idx:
                        arrs = response_logprobs(vals, [len(trajs[i].spec.prompt_tokens) for i in idx],
                                                 [len(trajs[i].response_tokens) for i in idx])
                        for i, a in zip(idx, arrs):
                            out[i] = a
        return out

    def _autocast(self):
        """bfloat16 compute under autocast; parameters, gradients and Adam states stay float32."""
        import torch
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.dtype == "bfloat16")

    def _minibatches(self, order: list[int]) -> list[list[int]]:
        return [m.tolist() for m in np.array_split(np.array(order, dtype=np.int64), self.cfg.minibatch_steps)]

    def _step(self, pairs, losses_finite: bool) -> tuple[list[float], bool]:
        """One optimizer step of each (module, optimizer) after clipping its gradients, unless a
        loss of this mini-batch (on any rank) or a gradient norm is not finite: then no step, the
        gradients are dropped and the skip counted. Returns (pre-clip norms, stepped)."""
        import torch
        grads, norms = [], []
        for module, _ in pairs:
            params = [p for p in module.parameters() if p.grad is not None]
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
            if hasattr(norm, "full_tensor"):
                norm = norm.full_tensor()  # the global norm: every rank sees the same value
            grads.append(params)
            norms.append(norm)
        values = [float(n) for n in norms]
        bad = not losses_finite or not all(math.isfinite(v) for v in values)
        if self.info.enabled:  # a NaN loss on one rank skips the step on all of them
            bad = all_reduce_sums(self.info, {"nonfinite": float(bad)})["nonfinite"] > 0
        if bad:
            for _, opt in pairs:
                opt.zero_grad(set_to_none=True)
            self.skipped_nonfinite_steps += 1
            return values, False
        for (_, opt), params, norm in zip(pairs, grads, norms):
            torch.nn.utils.clip_grads_with_norm_(params, self.cfg.max_grad_norm, norm)
            opt.step()
        return values, True
