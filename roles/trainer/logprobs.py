"""Per-token logprobs and entropies of a causal LM, computed without its [tokens, vocabulary] logits.

The losses need one logprob per target token, not the logits. The plain way, the model's logits in
float32 and then a log-softmax of the same size, costs 2 x N x V x 4 bytes before the backward: a
32,768-token sequence with Qwen2.5's 151,936-token vocabulary needs 19.9 GB for each of the two.
Here the model runs as usual up to its last hidden state h [N, H], and the output head (W [V, H],
the optional bias b) is applied `chunk_tokens` positions at a time, in the forward and again in the
backward (a custom autograd function that recomputes each chunk's logits):

    forward, per chunk:   z = h_c W^T + b (the compute dtype, then float32)
                          lse = logsumexp(z);  logp = z[target] - lse;  entropy = -sum softmax(z) (z - lse)
    backward, per chunk:  z again;  dz = g (onehot(target) - softmax(z));  dh_c = dz W;  dW += dz^T h_c

Saved for the backward: h, W, the targets and lse (N floats), so memory grows with chunk x V, not
N x V. The compute dtype is what autocast would use for the head's matmul (bf16 logits under bf16
autocast, as the unchunked path gets them), the log-softmax is float32 in both paths, and in float32
the two agree within 1e-5 (values and gradients; tests/unit/roles/trainer/test_logprobs_chunked.py). The entropy
is a metric: it is not differentiated.

How the head is reached: the model's own forward is called, with the head's forward replaced for
that one call by a function that takes the hidden states and returns the logprobs. So everything a
forward does still happens: FSDP2's hooks gather the root's parameters (the head among them) and
reduce-scatter their gradients exactly as for the full logits, activation checkpointing and
torch.compile of the decoder layers are untouched. Hugging Face's Qwen2 and Llama forwards hand the
head's output back as `logits` unchanged; a model whose forward post-processes its logits (Gemma's
soft-capping, a logit scale) or whose head is not a Linear gets the unchunked path, logged once.
`chunk_tokens=0` is the unchunked path itself (the trainer's setting `logprob_chunk_tokens`).

LoRA or any other change of the model plugs in below `token_logprobs`: it only needs the model's
forward and its output embeddings (`get_output_embeddings()`).
"""
from __future__ import annotations

from functools import cache

import structlog
import torch  # at the top: the module defines an autograd Function (only the torch engine imports it)
import torch.nn.functional as F

log = structlog.get_logger("laminar.trainer.logprobs")

POSTPROCESSED_LOGITS = ("final_logit_softcapping", "logit_scale", "logits_scaling")  # config fields


def token_logprobs(model, input_ids, attention_mask, with_entropy: bool = False, chunk_tokens: int = 0,
                   position_ids=None):
    """log p(input_ids[:, t+1] | input_ids[:, :t+1]) for t < T-1 -> [B, T-1] float32 (and the entropy
    of each predictive distribution when asked, not differentiated). `chunk_tokens` > 0: computed
    from the last hidden state that many positions at a time (module docstring); 0: from the logits.
    `position_ids` (with `attention_mask` None): a packed row (packing.py)."""
    kw = {"use_cache": False}
    if position_ids is not None:
        kw["position_ids"] = position_ids
    head = chunkable_head(model) if chunk_tokens > 0 else None
    if head is None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, **kw).logits[:, :-1].float()
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        if not with_entropy:
            return logp, None
        with torch.no_grad():
            ent = -(logp_all.exp() * logp_all).sum(-1)
        return logp, ent
    targets = input_ids[:, 1:]
    out = {}

    def head_forward(hidden):  # [B, T, H] -> [B, T-1] logprobs, handed back as the model's "logits"
        h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
        lp, out["entropy"] = chunked_logprobs(h, head.weight, targets.reshape(-1), chunk_tokens, with_entropy,
                                              bias=head.bias)
        return lp.view(targets.shape)

    head.forward = head_forward  # this call only (an instance attribute over the class's method)
    try:
        logp = model(input_ids=input_ids, attention_mask=attention_mask, **kw).logits
    finally:
        del head.forward
    ent = out.get("entropy")
    return logp, (ent.view(targets.shape) if ent is not None else None)


def chunkable_head(model):
    """The model's output head when its logits reach the caller as the head makes them (a Linear,
    no post-processing named in the config); None otherwise (then the unchunked path runs)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    cfg = getattr(model, "config", None)
    why = None
    if not isinstance(head, torch.nn.Linear):
        why = "the output head is not a Linear layer"
    else:
        for name in POSTPROCESSED_LOGITS:
            if getattr(cfg, name, None) not in (None, 1, 1.0):
                why = f"the model's config sets {name}"
    if why is not None:
        _warn_unchunked(type(model).__name__, why)
        return None
    return head


@cache
def _warn_unchunked(model_class: str, why: str) -> None:
    log.warning("logprobs_unchunked", model=model_class, reason=why)


def chunked_logprobs(hidden, weight, targets, chunk_tokens: int, with_entropy: bool = False, bias=None):
    """([N] float32 logprobs of `targets` under the head (weight [V, H], bias [V]) applied to hidden
    [N, H], [N] entropies or None), `chunk_tokens` rows of logits at a time, forward and backward."""
    dtype = _compute_dtype(hidden)
    logp, ent = _ChunkedHead.apply(hidden, weight, bias, targets, max(1, int(chunk_tokens)), dtype, with_entropy)
    return logp, (ent if with_entropy else None)


def full_logprobs(hidden, weight, targets, with_entropy: bool = False, bias=None):
    """The same from the full [N, V] float32 logits and log-softmax (the unchunked reference)."""
    logp_all = torch.log_softmax(F.linear(hidden, weight, bias).float(), dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logp, None
    with torch.no_grad():
        return logp, -(logp_all.exp() * logp_all).sum(-1)


def _compute_dtype(hidden) -> torch.dtype:
    """The head's matmul dtype: autocast's when it is on (as F.linear would run), else the input's."""
    dev = hidden.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype


def _logits(h, w, b, dtype):
    return F.linear(h.to(dtype), w, b).float()


class _ChunkedHead(torch.autograd.Function):
    """logsumexp-based logprobs (and entropies) of a Linear head, one chunk of rows at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk, dtype, with_entropy):
        n, dev = hidden.shape[0], hidden.device
        logp = torch.empty(n, dtype=torch.float32, device=dev)
        lse = torch.empty(n, dtype=torch.float32, device=dev)
        ent = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=dev)
        with torch.autocast(dev.type, enabled=False):
            w = weight.to(dtype)
            b = bias.to(dtype) if bias is not None else None
            for s in range(0, n, chunk):
                e = min(n, s + chunk)
                z = _logits(hidden[s:e], w, b, dtype)
                lz = torch.logsumexp(z, dim=-1)
                lse[s:e] = lz
                logp[s:e] = z.gather(-1, targets[s:e, None])[:, 0] - lz
                if with_entropy:
                    z.sub_(lz[:, None])  # the chunk's log-softmax
                    ent[s:e] = -(z.exp().mul_(z)).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.chunk, ctx.dtype = chunk, dtype
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, _grad_ent):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        chunk, dtype = ctx.chunk, ctx.dtype
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        n, dev = hidden.shape[0], hidden.device
        gh = torch.empty_like(hidden) if need_h else None
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=dev) if need_w else None
        gb = torch.zeros(weight.shape[0], dtype=torch.float32, device=dev) if need_b and bias is not None else None
        with torch.autocast(dev.type, enabled=False):
            w = weight.to(dtype)
            b = bias.to(dtype) if bias is not None else None
            for s in range(0, n, chunk):
                e = min(n, s + chunk)
                h = hidden[s:e].to(dtype)
                g = grad_logp[s:e].float()[:, None]
                dz = _logits(h, w, b, dtype).sub_(lse[s:e, None]).exp_().mul_(-g)  # -g softmax(z)
                dz.scatter_add_(-1, targets[s:e, None], g)                          # + g at the target
                if gb is not None:
                    gb += dz.sum(0)
                dz = dz.to(dtype)
                if gh is not None:
                    gh[s:e] = dz @ w
                if gw is not None:
                    if dtype == torch.float32:
                        gw.addmm_(dz.t(), h)
                    else:
                        gw += (dz.t() @ h).float()
        return (gh, gw.to(weight.dtype) if gw is not None else None,
                gb.to(bias.dtype) if gb is not None else None, None, None, None, None)
