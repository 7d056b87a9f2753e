"""Routing replay (R3) and the load-balancing loss of mixture-of-experts policies (docs/moe.md).

An MoE layer's router picks each token's top-k experts from its logits. The rollout's engine and
the trainer compute those logits with different kernels; where two experts' scores nearly tie, a
rounding difference flips the choice, the token goes through another sub-network, and the
trainer's logprob of a sampled token differs from the behaviour logprob far more than numerics
alone would make it. Routing replay makes the trainer evaluate the sub-network the engine ran: each
trajectory carries the experts the engine chose at every processed position (laminar/models/
routing.py), and the trainer's forward routes every token of prompt and response to those experts.

How the router's gradient is handled (as the published R3 method, Rollout Routing Replay, does):
replay fixes only *which* experts; their gate weights still come from the trainer's own router,
softmax(logits) at the replayed experts (renormalized over them when the model's `norm_topk_prob`
is set, as Qwen3-MoE's is). The mixture output is sum_k w_k(x) E_k(x) with the replayed k, so the
policy loss's gradient reaches the router weights through w_k exactly as it does without replay:
the router keeps learning to weigh the experts it is shown, it just cannot change the selection of
a replayed token. The selection was never differentiable anyway (a top-k). The load-balancing
loss (`router_aux_loss_coef`: Switch Transformer's E x sum_e f_e P_e per layer, averaged over
layers, f_e the share of the tokens' expert slots that went to e, P_e the mean router probability)
is taken over each micro-batch's training forward's real tokens, f_e counting the experts
actually used (replayed ones under replay), weighted by the micro-batch's share of the mini-batch's
tokens; its gradient flows through P_e. A product of per-micro-batch averages, it depends on how the
batch is cut into micro-batches and ranks (as any per-micro-batch balancing loss does).

Mechanism: `RoutingReplay.attach` replaces the forward of every supported router (Hugging Face's
softmax top-k routers: Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE) of the given models (policy,
reference, previous version) by one that reads the staged routing. The engine stages a
micro-batch's routing (`stage`) when it builds the micro-batch's inputs (TrainEngine._inputs); it
stays staged until the next micro-batch, so activation checkpointing's recomputation in the
backward sees the same routing. Rows are laid out as the router sees its input: padded (row b*T + t)
or packed (the sequences end to end). A position without a recorded row (a trajectory generated
without routing, the last token, padding) keeps the trainer's own top-k. Replay off, the routing is
still compared with the trainer's own choice (the version's `routing_disagree_*` metrics).

FSDP2: each decoder layer is one shard unit, and its 3-D expert tensors ([experts, ...]) are
sharded on their first dimension: each rank holds a share of the experts at rest, gathered for the
layer's forward like every other parameter (expert parallelism with token dispatch is not done).
The patched forward reads the router's weight at call time, so it sees the gathered tensor.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from laminar.roles.trainer.dist import DistInfo, all_reduce_sums

from laminar.models.routing import nbytes

SUPPORTED = {"Qwen2MoeTopKRouter": None, "Qwen3MoeTopKRouter": None, "OlmoeTopKRouter": None,
             "MixtralTopKRouter": True}  # class -> norm_topk_prob when the router has no such attribute
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def find_routers(model) -> list[tuple[int, torch.nn.Module]]:
    """(layer id, router) of every MoE layer, in layer order; ValueError for an unsupported router."""
    out = []
    for name, m in model.named_modules():
        cls = type(m).__name__
        if not cls.endswith("TopKRouter"):
            continue
        if cls not in SUPPORTED:
            raise ValueError(f"routing replay supports softmax top-k routers ({', '.join(sorted(SUPPORTED))}), "
                             f"not {cls} ({name})")
        layer = _LAYER.search(name)
        if layer is None:
            raise ValueError(f"router {name} is not inside a numbered decoder layer")
        out.append((int(layer.group(1)), m))
    return sorted(out, key=lambda x: x[0])


@dataclass
class Staged:
    """One micro-batch's recorded routing, as the routers see their rows."""
    idx: torch.Tensor                      # [layers, rows, top_k] long; -1: not recorded
    valid: torch.Tensor                    # [rows] bool: a real token (not padding)
    known: torch.Tensor                    # [rows] bool: a recorded row (every layer)
    differ: torch.Tensor                   # [rows] bool: some layer's own top-k differs from the recorded
    seen: set = field(default_factory=set)            # layers whose training forward was noted
    aux: list = field(default_factory=list)           # (probs, experts used) of the training forward's layers


class RoutingReplay:
    """The patched routers of one trainer's models, and what they measure (module docstring)."""

    def __init__(self, routers: list[tuple[int, torch.nn.Module]], replay: bool, aux_coef: float):
        self.layer_ids = [lid for lid, _ in routers]
        first = routers[0][1]
        self.top_k, self.experts = int(first.top_k), int(first.weight.shape[0])
        self.replay, self.aux_coef = replay, aux_coef
        self.staged: Staged | None = None
        self.counts: dict[str, float] = {}

    @classmethod
    def attach(cls, settings, models: list, model_config) -> RoutingReplay | None:
        """Patch the routers of `models` (the policy first); None for a dense policy (ValueError when
        routing replay was asked for on one). `settings`: the trainer's `moe` section."""
        routers = find_routers(models[0])
        if not routers:
            if settings.routing_replay:
                raise ValueError("roles.trainer.moe.routing_replay: the policy has no mixture-of-experts router")
            return None
        coef = settings.router_aux_loss_coef
        if coef is None:
            coef = float(getattr(model_config, "router_aux_loss_coef", 0.0) or 0.0)
        self = cls(routers, settings.routing_replay, coef)
        for model in models:
            mine = find_routers(model)
            if [lid for lid, _ in mine] != self.layer_ids:
                raise ValueError("every model the trainer forwards must have the policy's MoE layers")
            for index, (_, router) in enumerate(mine):
                router.forward = self._forward_of(index, router)
        return self

    # -- staging ---------------------------------------------------------------------------------
    def stage(self, routings: list, lengths: list[int], width: int, packed: bool, device) -> None:
        """The routing of a micro-batch of sequences (prompt + response) of `lengths`, padded to
        `width` (or packed): each trajectory's rows (None: none recorded) at its positions."""
        self.clear()
        n_rows = sum(lengths) if packed else len(lengths) * width
        idx = np.full((len(self.layer_ids), n_rows, self.top_k), -1, np.int64)
        valid = np.zeros(n_rows, bool)
        off = 0
        for b, (rows, n) in enumerate(zip(routings, lengths, strict=True)):
            start = off if packed else b * width
            valid[start:start + n] = True
            if rows is not None and len(rows):
                r = np.asarray(rows)
                if r.shape[1:] != (len(self.layer_ids), self.top_k):
                    raise ValueError(f"routing rows of shape {r.shape[1:]} for a model of {len(self.layer_ids)} "
                                     f"MoE layers and top-{self.top_k}")
                k = min(len(r), n)
                idx[:, start:start + k] = np.moveaxis(r[:k], 1, 0)
            off += n
        t = torch.from_numpy(idx).to(device)
        known = (t >= 0).all(-1).all(0)
        self.staged = Staged(t, torch.from_numpy(valid).to(device), known, torch.zeros_like(known))

    def clear(self) -> None:
        """Forget the staged micro-batch (its token-level disagreement is counted now)."""
        st, self.staged = self.staged, None
        if st is not None and st.seen:
            c = self.counts
            c["rows"] = c.get("rows", 0.0) + float(st.valid.sum())
            c["recorded"] = c.get("recorded", 0.0) + float((st.valid & st.known).sum())
            c["differ"] = c.get("differ", 0.0) + float(st.differ.sum())

    # -- the routers' forward --------------------------------------------------------------------
    def _forward_of(self, index: int, router):
        norm = getattr(router, "norm_topk_prob", SUPPORTED[type(router).__name__])

        def forward(hidden_states):
            h = hidden_states.reshape(-1, router.weight.shape[1])
            logits = F.linear(h, router.weight)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            own = torch.topk(probs, self.top_k, dim=-1).indices
            use = self._experts(index, own, probs)
            weights = probs.gather(-1, use)
            if norm:
                weights = weights / weights.sum(-1, keepdim=True)
            return logits, weights.to(logits.dtype), use
        return forward

    def _experts(self, index: int, own: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """The experts each row uses: the recorded ones under replay where there are some, else the
        router's own; notes the training forward's choices (metrics, auxiliary loss)."""
        st = self.staged
        if st is None:
            return own
        if st.idx.shape[1] != own.shape[0]:
            raise RuntimeError(f"staged routing has {st.idx.shape[1]} rows, the router sees {own.shape[0]} "
                               f"(a forward without its micro-batch's routing)")
        rec = st.idx[index]
        use = torch.where(st.known[:, None], rec, own) if self.replay else own
        if torch.is_grad_enabled() and index not in st.seen:  # the training forward, not a recomputation
            st.seen.add(index)
            with torch.no_grad():
                mask = st.valid & st.known
                differ = (torch.sort(rec, -1).values != torch.sort(own, -1).values).any(-1) & mask
                st.differ |= differ
                c = self.counts
                c["layer_rows"] = c.get("layer_rows", 0.0) + float(mask.sum())
                c["layer_differ"] = c.get("layer_differ", 0.0) + float(differ.sum())
            if self.aux_coef:
                st.aux.append((probs, use))
        return use

    # -- the auxiliary loss ----------------------------------------------------------------------
    def aux_term(self, share: float, metrics: dict) -> torch.Tensor | float:
        """The load-balancing loss of the staged micro-batch's training forward (module docstring),
        times the coefficient and `share` (its part of the mini-batch's tokens); 0 when off."""
        st = self.staged
        if not self.aux_coef or st is None or not st.aux:
            return 0.0
        aux = torch.stack([self._balance(probs, use, st.valid) for probs, use in st.aux]).mean()
        st.aux = []
        metrics["moe_aux_loss"] = float(aux.detach())
        return self.aux_coef * share * aux

    def _balance(self, probs: torch.Tensor, use: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        v = valid.to(probs.dtype)
        n = v.sum().clamp_min(1.0)
        counts = torch.zeros(self.experts, dtype=probs.dtype, device=probs.device)
        counts.scatter_add_(0, use.reshape(-1), v.repeat_interleave(self.top_k))
        p_mean = (probs * v[:, None]).sum(0) / n
        return self.experts * (counts / n * p_mean).sum()

    # -- per version -----------------------------------------------------------------------------
    def metrics(self, info: DistInfo, trajs) -> dict[str, float]:
        """The version's routing metrics (summed over ranks), then reset."""
        self.clear()
        c, self.counts = self.counts, {}
        s = all_reduce_sums(info, {k: c.get(k, 0.0) for k in ("rows", "recorded", "differ", "layer_rows",
                                                                "layer_differ")})
        sizes = [nbytes(t.routing) for t in trajs if t.routing is not None]
        out = {"routing_trajectories": float(len(sizes)),
               "routing_bytes_per_trajectory": float(np.mean(sizes)) if sizes else 0.0}
        if s["rows"]:
            out["routing_unreplayed_share" if self.replay else "routing_unrecorded_share"] = \
                1.0 - s["recorded"] / s["rows"]
        if s["recorded"]:
            out["routing_disagree_token_share"] = s["differ"] / s["recorded"]
        if s["layer_rows"]:
            out["routing_disagree_layer_share"] = s["layer_differ"] / s["layer_rows"]
        return out
