"""TrainEngine: the torch side of the trainer — one global batch of updates on a set of models.

It knows nothing of the bus or asyncio (the role runs it in a worker thread) and is the same code
on one rank and on many (FSDP2, see dist.py). It wires three parts and keeps the update:

    model_set.py  ModelSet (`models`): the policy, reference, lag copy and critic with their
                  optimizers; load, the state that leaves (publish, checkpoint) and comes back
    forwards.py   Forwards (`forwards`): the batch's micro-batch plans, inputs and forward passes
    mismatch.py   the train-inference mismatch of each version (`mismatch_*` metrics)
    engine.py     the update: order, advantages, losses, the mini-batch loop, optimizer steps

Every rank holds the whole batch; mini-batch j is the j-th slice of a permutation seeded by
(seed, version), so all ranks agree without talking. Which of its sequences each rank trains, in
which micro-batch, is a plan every rank computes alike (micro_batches.py): by default a balanced
partition of their tokens, reported as `rank_imbalance` and `step_imbalance`. Every rank runs the
same number of forward/backward calls (an empty micro-batch runs a zero-weight dummy), because
each FSDP2 call is a collective. Losses are token-level over the whole mini-batch: each rank
divides by the mini-batch's total valid tokens and the gradients are summed over ranks. Logprobs
are computed in chunks of tokens from the last hidden state (logprobs.py), for the policy, the
reference, the proximal and the lag model.

    grpo: advantages = group-normalized rewards, one per sequence; groups whose rewards are all
          equal are left out (skip_uniform_groups), and a batch of only such groups makes no step
    ppo:  advantages = GAE over the critic's values (reward at the last token), whitened over the
          batch; the critic is trained with the clipped value loss by its own AdamW
Both use the same Clip-Higher policy loss (clipped_policy_loss), optional dual clip, k3 KL, TIS
or decoupled-PPO corrections: train() prepares what they share, then _train_grpo or _train_ppo runs
the shared mini-batch loop (_minibatch_steps) with its own micro-batch step. With `packing`, each
micro-batch is forwarded as one packed row (packing.py) and mapped back to the padded layout.

A mini-batch whose loss or gradient norm is not finite (on any rank) is skipped: no optimizer
steps, its gradients dropped, its metrics left out, the step counted in `skipped_nonfinite_steps`
(per version and in total) and logged as `nonfinite_step_skipped`. Weights with a NaN or inf
never leave (ModelSet.full_state, NonFiniteWeightsError).

Mixture-of-experts policies (`moe`, routing_replay.py): the routers of the policy, reference and
previous-version models read the routing each micro-batch stages (Forwards.inputs); with routing_replay
every logprob pass routes tokens to the experts the rollout's engine chose. The load-balancing loss
is added to the policy loss; the routing metrics (disagreement with the rollout's choice, bytes per
trajectory) join the version's.

LoRA (`lora`, lora.py): ModelSet holds the base and its adapter; the update trains the adapter
alone and takes the KL term's reference from the same model with the adapter off. Everything else
(FSDP2, packing, chunked logprobs, the non-finite guard, the mismatch) runs as for full weights.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import structlog
from laminar.roles.trainer.checkpoint import NonFiniteWeightsError
from laminar.roles.trainer.context_parallel import dp_sums
from laminar.roles.trainer.dist import DistInfo, all_gather_objects, all_reduce_sums
from laminar.roles.trainer.forwards import Forwards
from laminar.roles.trainer.mismatch import Mismatch, measure_before_update, measure_forward
from laminar.roles.trainer.model_set import ModelSet

from laminar.algorithms.grpo import clipped_policy_loss, group_advantages
from laminar.algorithms.off_policy import ratio_distribution, sequence_log_ratio
from laminar.algorithms.ppo import sequence_gae, value_loss

__all__ = ["NonFiniteWeightsError", "TrainEngine"]
log = structlog.get_logger("laminar.trainer.engine")


def _reward_spread(group) -> bool:
    """Whether a GRPO group carries a signal: two samples or more, not all of the same reward."""
    rewards = [t.reward for t in group]
    return len(rewards) > 1 and max(rewards) > min(rewards)


@dataclass
class _Batch:
    """One global batch on its way through `train`: what GRPO's and PPO's steps share."""
    trajs: list
    order: list[int]           # the batch's permutation (mini-batch j = its j-th slice)
    per: dict                  # per-token arrays per trajectory: beh, prox, ref (and ppo's val, adv, ret)
    version: int
    needs_prox: bool           # the ratio's old policy is the recomputed proximal logprobs
    mismatch: Mismatch
    stepped_any: bool = False  # until the first optimizer step the training forward is at version - 1


class TrainEngine:
    """One global batch of GRPO or PPO updates (`train`) on the models of a ModelSet (`models`),
    forwarded by `forwards` (Forwards), with the batch's mismatch measured by mismatch.py. Owns
    the update's own state: the non-finite step count and the overlapped publish's hook. The
    role's calls on the models' lifecycle (load, state, restore: engine_api.py's TrainEngineAPI)
    pass through to `models`."""

    def __init__(self, settings, seed: int, device, info: DistInfo | None = None):
        self.settings, self.seed, self.device = settings, seed, device
        self.info = info or DistInfo()
        self.skipped_nonfinite_steps = 0  # over the engine's life (this process)
        # called once before the next optimizer step writes the parameters (an overlapped
        # publish's PendingPublish.guard: publishing.py)
        self.before_update: Callable[[], None] | None = None
        # packed micro-batches (no compute on padding): on by default on a GPU, off on the CPU
        perf = settings.performance
        packing = perf.packing if perf.packing is not None else device.type == "cuda"
        self.models = ModelSet(settings, seed, device, self.info, packing)
        self.forwards = Forwards(settings, device, self.info, packing, self.models)

    # -- the models' lifecycle (ModelSet) ------------------------------------------------------
    @property
    def params(self) -> int | None:
        """The policy's parameter count (None until `load`)."""
        return self.models.params

    def load(self) -> None:
        """Build the models and optimizers (ModelSet.load)."""
        self.models.load()

    def restore(self, parts: dict | None) -> None:
        """Take a checkpoint's full state dicts (ModelSet.restore)."""
        self.models.restore(parts)

    def full_state(self, with_optimizer: bool = False) -> dict | None:
        """Full state dicts on rank 0, refused when not finite (ModelSet.full_state)."""
        return self.models.full_state(with_optimizer)

    def publish_state(self) -> dict:
        """This rank's policy tensors for a sharded publish (ModelSet.publish_state)."""
        return self.models.publish_state()

    def save_sharded(self, root, version: int, state: dict, keep: int):
        """Collective: every rank writes its shards (ModelSet.save_sharded)."""
        return self.models.save_sharded(root, version, state, keep)

    def restore_sharded(self, path) -> None:
        """Collective: every rank reads its shards (ModelSet.restore_sharded)."""
        self.models.restore_sharded(path)

    def manifest_fields(self) -> dict:
        """What a published version says it holds beyond its tensors (ModelSet.manifest_fields)."""
        return self.models.manifest_fields()

    # -- one global batch ------------------------------------------------------------------------
    def train(self, groups, version: int) -> dict:
        """All updates of one global batch (every rank calls it with the same groups): what both
        algorithms share (order, behaviour/proximal/reference logprobs, mismatch), then GRPO's or
        PPO's mini-batch steps."""
        import torch  # late: torch; configs validate without it
        c = self.settings
        self._set_lr(version)
        if self.models.moe is not None:  # the routing disagreement is measured on samples of the weights held
            self.models.moe.weights_version = version - 1
        self.forwards.new_batch()
        signal, flat = [], []  # groups with and without a signal (GRPO: zero advantages)
        for g in groups:
            (signal if _reward_spread(g) else flat).append(g)
        uniform = len(flat)
        left_out: list = []  # trained on by no one, but their mismatch is measured all the same
        if c.algorithm == "grpo" and c.loss.skip_uniform_groups:
            if not signal:
                return self._no_signal(groups, version)
            left_out = [t for g in flat for t in g]
            groups = signal
        trajs = [t for g in groups for t in g]
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + version)
        order = torch.randperm(len(trajs), generator=gen).tolist()
        per = {"beh": [np.asarray(t.logprobs, np.float32) for t in trajs]}
        needs_prox = c.loss.old_logprobs == "recompute" or c.loss.off_policy != "none"
        if needs_prox:
            per["prox"] = self.forwards.model_logprobs(self.models.model, trajs, order)
        mismatch = measure_before_update(self.models, self.forwards.model_logprobs, trajs, order, per, version - 1,
                                         left_out)
        if self.models.ref is not None:
            per["ref"] = self.forwards.model_logprobs(self.models.ref, trajs, order)
        elif c.loss.kl_coef > 0:  # LoRA: the reference is the base, the policy with its adapter off
            with self.models.model.disable_adapter():
                per["ref"] = self.forwards.model_logprobs(self.models.model, trajs, order)
        batch = _Batch(trajs, order, per, version, needs_prox, mismatch)
        ratios = self._ratio_distribution(trajs, per, version) if needs_prox else {}
        if c.algorithm == "ppo":
            return {**self._train_ppo(batch), **ratios}
        return {**self._train_grpo(batch, groups), "groups_uniform": float(uniform), "no_signal_steps": 0.0, **ratios}

    def _ratio_distribution(self, trajs, per, version: int) -> dict:
        """The batch's proximal / behaviour ratios (laminar/algorithms/off_policy.py), over every
        rank's sequences, by their staleness at this step (its weights are version - 1)."""
        rows = [(*sequence_log_ratio(p, t.logprobs, t.loss_mask), version - 1 - t.version)
                for t, p in zip(trajs, per["prox"], strict=True) if p is not None]
        if self.info.cp_rank:  # a CP group's ranks hold the same sequences: its first rank speaks for it
            rows = []
        rows = [r for part in all_gather_objects(self.info, rows) for r in part]
        return ratio_distribution([(lr, n) for lr, n, _ in rows], [s for *_, s in rows])

    def lr_at(self, version: int) -> float:
        """The policy's learning rate for the batch that makes `version` (lr_warmup_versions)."""
        c = self.settings
        o = c.optimizer
        return o.lr * (min(1.0, version / o.warmup_versions) if o.warmup_versions else 1.0)

    def _set_lr(self, version: int) -> None:
        for group in self.models.opt.param_groups:
            group["lr"] = self.lr_at(version)

    def _no_signal(self, groups, version: int) -> dict:
        """A GRPO batch whose every group has equal rewards: no forward/backward, no optimizer step
        (the weights stay as they are); the mismatch of its samples is still measured."""
        mismatch = measure_before_update(self.models, self.forwards.model_logprobs, [], [], {}, version - 1,
                                         [t for g in groups for t in g])
        return {"advantage_abs_mean": 0.0, "grad_norm": 0.0, "grad_norm_max": 0.0, "tokens": 0.0,
                "response_tokens": 0.0, "skipped_nonfinite_steps": 0.0, "groups_uniform": float(len(groups)),
                "no_signal_steps": 1.0, **mismatch.metrics(self.info)}

    def _train_grpo(self, b: _Batch, groups) -> dict:
        """GRPO: one advantage per sequence (its group-normalized reward), the clipped policy loss."""
        import torch  # late: torch; configs validate without it

        c = self.settings
        seq_adv = np.concatenate(group_advantages([[t.reward for t in g] for g in groups], 1e-6,
                                                  c.loss.adv_std_normalize))
        out = {"advantage_abs_mean": float(np.abs(seq_adv).mean())}

        def micro(idx, ids, att, mask, ex, ntok) -> dict[str, float]:
            adv = torch.as_tensor(seq_adv[idx or [0]], device=self.device)
            return self._policy_backward(b, idx, ids, att, mask, ex, adv, ntok)

        out.update(self._minibatch_steps(b, micro))
        return out

    def _train_ppo(self, b: _Batch) -> dict:
        """PPO: per-token GAE advantages over the critic's values; the same clipped policy loss,
        plus the critic's clipped value loss (its own optimizer, stepped with the policy's)."""
        c = self.settings
        out = self._gae(b.trajs, b.order, b.per)

        def micro(idx, ids, att, mask, ex, ntok) -> dict[str, float]:
            m = self._policy_backward(b, idx, ids, att, mask, ex, ex["adv"], ntok)
            with self.forwards.autocast():
                values = self.forwards.values(ids, att)
            vl = value_loss(values, ex["val"], ex["ret"], mask, c.ppo.value_clip, num_tokens=ntok)
            (vl * self._grad_scale()).backward()
            m["value_loss"] = float(vl.detach())
            return m

        out.update(self._minibatch_steps(b, micro))
        return out

    def _policy_backward(self, b: _Batch, idx, ids, att, mask, ex, adv, ntok: int) -> dict[str, float]:
        """The policy's forward and backward of one micro-batch (both algorithms): the clipped
        policy loss (Clip-Higher, dual clip, TIS/decoupled, k3 KL) over the advantages `adv`.
        Until the batch's first optimizer step, the forward also measures the mismatch."""
        c = self.settings
        with self.forwards.autocast():
            logp, ent = self.forwards.logprobs(self.models.model, ids, att, with_entropy=c.logging.entropy)
        if not b.needs_prox and not b.stepped_any and idx:
            measure_forward(b.mismatch, b.trajs, idx, logp, b.version - 1)
        old = ex["prox"] if b.needs_prox else ex["beh"]
        lc = c.loss
        loss, m = clipped_policy_loss(logp, old, adv, mask, eps_low=lc.eps_low, eps_high=lc.eps_high,
                                      behaviour_logp=ex["beh"], off_policy=lc.off_policy, is_cap=lc.is_cap,
                                      ref_logp=ex.get("ref"), kl_coef=lc.kl_coef, num_tokens=ntok, entropy=ent,
                                      dual_clip=lc.dual_clip_c if lc.dual_clip else None, is_level=lc.is_level,
                                      is_low=lc.is_low)
        if self.models.moe is not None:  # the load-balancing loss of this forward's routers
            loss = loss + self.models.moe.aux_term(float(mask.sum()) / ntok, m)
        (loss * self._grad_scale()).backward()
        return m

    def _grad_scale(self) -> float:
        return float(self.info.world_size)  # FSDP2 averages gradients over ranks; we want their sum

    def _minibatch_steps(self, b: _Batch, micro) -> dict:
        """The mini-batch loop both algorithms share: for each mini-batch, `micro(idx, ids, att,
        mask, extras, ntok) -> metrics` runs forward and backward of each of this rank's
        micro-batches, then one optimizer step of each model (skipped when not finite).
        Returns the token-weighted metrics, gradient norms, token counts, the ranks' balance and
        the mismatch."""
        trajs = b.trajs
        valid = [int(t.loss_mask.sum()) if t.loss_mask is not None else len(t.response_tokens) for t in trajs]
        totals: dict[str, float] = defaultdict(float)
        norms, vnorms, skipped = [], [], 0
        balance: dict[str, list[float]] = defaultdict(list)  # the plans' facts (the same on every rank)
        pairs = list(self.models.pairs().values())
        for mb in self.forwards.minibatches(b.order):
            ntok = sum(valid[i] for i in mb)
            if not mb or ntok == 0:
                continue
            for _, o in pairs:
                o.zero_grad(set_to_none=True)
            mb_totals: dict[str, float] = defaultdict(float)
            finite = True
            plan = self.forwards.plan(trajs, mb)
            balance["rank"].append(plan.rank_imbalance())
            balance["step"].append(plan.step_imbalance())
            balance["micro"].append(float(len(plan.ranks[0])))
            for idx in plan.ranks[self.info.dp_rank]:
                ids, att, mask, ex = self.forwards.inputs(trajs, idx, b.per)
                m = micro(idx, ids, att, mask, ex, ntok)
                finite = finite and all(math.isfinite(v) for v in m.values())
                for k, v in m.items():
                    mb_totals[k] += v * ntok
                if idx:
                    totals["tokens"] += float(att.sum())
            mb_norms, stepped = self._step(pairs, finite)
            b.stepped_any = b.stepped_any or stepped
            if stepped and self.models.moe is not None:
                self.models.moe.weights_version = None  # the weights moved on: no sample is of them any more
            if not stepped:
                skipped += 1
                log.warning("nonfinite_step_skipped", version=b.version, loss_finite=finite,
                            grad_norms=[round(n, 6) if math.isfinite(n) else str(n) for n in mb_norms],
                            skipped_total=self.skipped_nonfinite_steps)
                continue
            norms.append(mb_norms[0])
            if self.models.critic is not None:
                vnorms.append(mb_norms[1])
            for k, v in mb_totals.items():
                totals[k] += v
            totals["response_tokens"] += ntok
        totals = dp_sums(self.info, dict(totals))  # a CP group's ranks hold the same values
        tokens, counted = totals.pop("tokens", 0.0), totals.pop("response_tokens", 0.0)
        counted /= self.info.dp_size  # every data-parallel rank added each mini-batch's ntok
        out = {k: v / max(counted, 1.0) for k, v in totals.items()}
        out.update(grad_norm=float(np.mean(norms)) if norms else 0.0, grad_norm_max=float(max(norms, default=0.0)),
                   tokens=tokens, response_tokens=counted, skipped_nonfinite_steps=float(skipped))
        if vnorms:
            out["critic_grad_norm"] = float(np.mean(vnorms))
        if balance:  # means over the version's mini-batches; micro-batches: each rank's count, summed
            out.update(rank_imbalance=float(np.mean(balance["rank"])), step_imbalance=float(np.mean(balance["step"])),
                       micro_batches=float(sum(balance["micro"])))
        out.update(b.mismatch.metrics(self.info))
        if self.models.moe is not None:
            out.update(self.models.moe.metrics(self.info, trajs))
        return out

    def _gae(self, trajs, order, per) -> dict:
        """Old values, GAE advantages and returns of this rank's sequences into `per`."""
        c = self.settings
        per["val"] = self.forwards.per_token(self.forwards.values, trajs, order)
        per["adv"], per["ret"] = [None] * len(trajs), [None] * len(trajs)
        s = {"n": 0.0, "sum": 0.0, "sq": 0.0}
        for i, v in enumerate(per["val"]):
            if v is None:
                continue
            t = trajs[i]
            per["adv"][i], per["ret"][i] = sequence_gae(t.reward, v, c.ppo.gamma, c.ppo.lam, t.loss_mask)
            m = np.ones(len(v), np.float32) if t.loss_mask is None else np.asarray(t.loss_mask, np.float32)
            a = per["adv"][i]
            s["n"] += float(m.sum())
            s["sum"] += float((a * m).sum())
            s["sq"] += float((a * a * m).sum())
        s = all_reduce_sums(self.info, s)
        mean = s["sum"] / max(s["n"], 1.0)
        std = math.sqrt(max(s["sq"] / max(s["n"], 1.0) - mean * mean, 0.0))
        if c.ppo.whiten_advantages:
            per["adv"] = [None if a is None else ((a - mean) / (std + 1e-6)).astype(np.float32) for a in per["adv"]]
        return {"advantage_mean_raw": mean, "advantage_std_raw": std}

    # -- the optimizer step --------------------------------------------------------------------
    def _step(self, pairs, losses_finite: bool) -> tuple[list[float], bool]:
        """One optimizer step of each (module, optimizer) after clipping its gradients, unless a
        loss of this mini-batch (on any rank) or a gradient norm is not finite: then no step, the
        gradients are dropped and the skip counted. Returns (pre-clip norms, stepped)."""
        import torch  # late: torch; configs validate without it
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
        hook, self.before_update = self.before_update, None
        if hook is not None:  # an overlapped publish still copies the weights this step overwrites
            hook()
        for (_, opt), params, norm in zip(pairs, grads, norms, strict=False):
            torch.nn.utils.clip_grads_with_norm_(params, self.settings.optimizer.max_grad_norm, norm)
            opt.step()
        return values, True
