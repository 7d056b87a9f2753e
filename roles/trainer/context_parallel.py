"""Context parallelism, Ulysses style: one long sequence split across `context_parallel_size` ranks.

    setup(info, cp_size)                   # collective: the ranks' CP groups (rank = dp_rank x cp + cp_rank)
    enable(model)                          # the model's attention goes through `ulysses_attention`
    logp, ent = cp_logprobs(model, ids, att, info, packing=..., with_entropy=..., chunk_tokens=...)
    values = cp_values(critic, ids, att, info, packing=...)

The ranks of a CP group take the same micro-batch (micro_batches.py plans over the data-parallel
ranks, world_size / cp of them) and each forwards a contiguous 1/cp of its tokens: the packed row
(or the right-padded batch), padded to a multiple of cp. Everything outside attention is per
token, so each rank runs embeddings, norms, MLPs, the head and the chunked logprobs on its own
slice: activations and logits memory shrink by cp. Attention needs every token of a sequence: in
each layer an all-to-all turns [tokens / cp, all heads] into [all tokens, heads / cp], the
attention kernel of the model's own implementation (sdpa, eager, flash-attention, flex) runs on the
whole sequence for its heads, and a second all-to-all turns the output back. The mask is the one
the unsplit sequence would get (Hugging Face's `create_causal_mask` over the full row, so packing's
per-sequence block-diagonal mask and right padding are the same as at cp 1).

Why Ulysses and not ring attention: the attention kernel sees the whole sequence, so packing
(varlen flash-attention, flex's block mask, sdpa's block-diagonal mask) works unchanged and every
implementation is usable; the work of causal attention is balanced by construction (each rank has
all tokens of some heads, no zig-zag reordering); it is two all-to-alls per layer over gloo or NCCL,
of the q/k/v and output activations (4 x tokens x hidden / cp per rank, fixed per rank as cp grows
within a node's NVLink). Its limit: cp must divide the attention heads, and the key/value heads or
be a multiple of them (then each rank gets a copy of the one key/value head its queries use):
Qwen2.5-72B (64 heads, 8 key/value heads) takes cp up to 8. Ring attention scales past the head
count but needs its own kernels for packed rows and causal load balancing.

Logprobs: each rank computes its slice's logprobs (targets are the next tokens, read from the full
batch every rank holds) and the slices are all-gathered into the [B, T-1] layout the losses read.
Every rank of the group then computes the same loss from the same gathered tensor, so the gather's
backward just takes this rank's slice of the gradient (no communication); the all-to-alls send
each key/value gradient back to the rank whose tokens made it. Parameter gradients are this rank's
tokens' share; FSDP2 (sharded over all world_size ranks) averages them and the engine scales by
world_size, as without CP: the sum over every token of the mini-batch. Metrics every rank of a CP
group computes alike are divided by cp after the all-reduce (`dp_sums`).
"""
from __future__ import annotations

import copy
import math
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from laminar.roles.trainer.dist import all_reduce_sums
from laminar.roles.trainer.logprobs import chunkable_head, chunked_logprobs, full_logprobs
from laminar.roles.trainer.packing import pack, unpack

ATTN = "laminar_ulysses"


@dataclass
class CPContext:
    """What the attention of one CP forward needs: the group, and the unsplit sequence's mask."""
    group: object
    size: int
    rank: int
    inner: str              # the model's own attention implementation (sdpa, eager, flash_attention_2...)
    mask: object            # the full row's mask in that implementation's format (None: plain causal)
    position_ids: object    # [B, T] of the full row (flash-attention finds packed sequences from them)


def setup(info, cp_size: int) -> None:
    """Collective on every rank: record the CP layout on `info` and make the CP groups (consecutive
    ranks, so a group shares a host where it can)."""
    info.cp_size, info.cp_rank, info.cp_group = 1, 0, None
    if cp_size <= 1:
        return
    if info.world_size % cp_size:
        raise ValueError(f"context_parallel_size {cp_size} must divide world_size {info.world_size}")
    info.cp_size, info.cp_rank = cp_size, info.rank % cp_size
    for start in range(0, info.world_size, cp_size):
        group = dist.new_group(list(range(start, start + cp_size)))
        if start <= info.rank < start + cp_size:
            info.cp_group = group


def check_heads(config, cp_size: int) -> None:
    """Refuse a model whose heads cannot be split cp ways (naming the setting)."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    if heads % cp_size:
        raise ValueError(f"context_parallel_size {cp_size} must divide the model's {heads} attention heads")
    if kv % cp_size and cp_size % kv:
        raise ValueError(f"context_parallel_size {cp_size} must divide the model's {kv} key/value heads or be a "
                         f"multiple of them")


def enable(model, cp_size: int) -> None:
    """Route `model`'s attention through `ulysses_attention` (its own implementation runs inside)."""
    from transformers import AttentionInterface  # late: transformers, only with context parallelism
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    body = getattr(base, "model", base)
    config = body.config
    check_heads(config, cp_size)
    AttentionInterface.register(ATTN, ulysses_attention)
    inner = config._attn_implementation or "sdpa"
    if inner != ATTN:
        base._laminar_cp_inner = inner
        body._laminar_cp_inner = inner
    target = body if hasattr(body, "set_attn_implementation") else base
    target.set_attn_implementation(ATTN)


def dp_sums(info, values: dict[str, float]) -> dict[str, float]:
    """Sums over the ranks of values every rank of a CP group holds alike: the sum over data-parallel ranks."""
    out = all_reduce_sums(info, values)
    cp = getattr(info, "cp_size", 1)
    return {k: v / cp for k, v in out.items()} if cp > 1 else out


# -- the collectives (autograd-aware) ----------------------------------------------------------------
def _a2a(x, scatter: int, gather: int, group, size: int):
    """Split `x` into `size` pieces along `scatter`, send piece j to rank j, concatenate what arrives along `gather`."""
    send = torch.stack([c.contiguous() for c in x.chunk(size, dim=scatter)])
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter, gather, group, size):
        ctx.args = (scatter, gather, group, size)
        return _a2a(x, scatter, gather, group, size)

    @staticmethod
    def backward(ctx, grad):
        scatter, gather, group, size = ctx.args
        return _a2a(grad, gather, scatter, group, size), None, None, None, None


class _GatherSeq(torch.autograd.Function):
    """All-gather along dim 1; the backward keeps this rank's slice (every rank's loss is the same)."""

    @staticmethod
    def forward(ctx, x, group, size, rank):
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.rank, ctx.t = rank, x.shape[1]
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        s = ctx.rank * ctx.t
        return grad[:, s:s + ctx.t].contiguous(), None, None, None


@torch._dynamo.disable
def all_to_all(x, scatter: int, gather: int, cp: CPContext):
    return _AllToAll.apply(x, scatter, gather, cp.group, cp.size)


@torch._dynamo.disable
def gather_seq(x, cp: CPContext):
    return _GatherSeq.apply(x, cp.group, cp.size, cp.rank)


# -- attention ---------------------------------------------------------------------------------------
def _inner_attention(module, name: str):
    from transformers import AttentionInterface  # late: transformers, only with context parallelism
    if name == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return AttentionInterface._global_mapping[name]


def ulysses_attention(module, query, key, value, attention_mask, laminar_cp: CPContext | None = None, **kwargs):
    """Hugging Face attention interface: q [B, H, t, D], k/v [B, KV, t, D] of this rank's t tokens ->
    output [B, t, H, D], attention computed over the whole sequence for H / cp heads."""
    cp = laminar_cp
    if cp is None:
        raise RuntimeError("context parallel attention called outside a CP forward (cp_logprobs / cp_values)")
    kv = key.shape[1]
    groups = None
    if kv % cp.size:  # fewer key/value heads than ranks: each rank gets the one its queries use
        rep = cp.size // kv
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
        groups = query.shape[1] // cp.size
    q, k, v = (all_to_all(t, 1, 2, cp) for t in (query, key, value))
    if cp.position_ids is not None and "position_ids" in kwargs:
        kwargs["position_ids"] = cp.position_ids
    fn = _inner_attention(module, cp.inner)
    saved = module.num_key_value_groups
    if groups is not None:
        module.num_key_value_groups = groups
    try:
        out, _ = fn(module, q, k, v, cp.mask, **kwargs)   # [B, T, H / cp, D]
    finally:
        module.num_key_value_groups = saved
    return all_to_all(out, 1, 2, cp), None               # [B, t, H, D]


# -- forwards ----------------------------------------------------------------------------------------
def _context(model, info, row_ids, positions, mask2d) -> CPContext:
    """The CP context of one forward: the group and the full row's mask in the inner implementation's format."""

    from transformers.masking_utils import create_causal_mask  # late: transformers, only under CP
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    body = getattr(base, "model", base)
    inner = getattr(body, "_laminar_cp_inner", None) or getattr(base, "_laminar_cp_inner", "sdpa")
    config = copy.copy(body.config)
    config._attn_implementation = inner
    dtype = next(p for p in model.parameters()).dtype
    embeds = torch.empty((*row_ids.shape, 1), dtype=dtype if dtype.is_floating_point else torch.float32,
                         device=row_ids.device)
    mask = create_causal_mask(config=config, inputs_embeds=embeds, attention_mask=mask2d, past_key_values=None,
                              position_ids=positions)
    return CPContext(info.cp_group, info.cp_size, info.cp_rank, inner, mask, positions)


def _layout(ids, att, packing: bool, cp: int):
    """(row ids [B, N'], positions [B, N'], 2-D mask or None, Packed or None, N): the packed row or
    the padded batch, padded to N' = a multiple of cp (a pad segment of its own when packed)."""
    if packing:
        p = pack(ids, att)
        row, pos, mask2d = p.input_ids, p.position_ids, None
    else:
        p, row, mask2d = None, ids, att
        pos = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
    n = row.shape[1]
    extra = math.ceil(n / cp) * cp - n
    if extra:
        row = torch.cat([row, row.new_zeros((row.shape[0], extra))], 1)
        more = torch.arange(extra, device=row.device) + (0 if packing else n)
        pos = torch.cat([pos, more.expand(row.shape[0], -1)], 1)
        if mask2d is not None:
            mask2d = torch.cat([mask2d, mask2d.new_zeros((row.shape[0], extra))], 1)
    return row, pos, mask2d, p, n


def cp_logprobs(model, ids, att, info, *, packing: bool, with_entropy: bool = False, chunk_tokens: int = 0):
    """`token_logprobs` (or `packed_token_logprobs`) of a right-padded micro-batch, computed with its
    tokens split over the CP group: ([B, T-1] logprobs, [B, T-1] entropies or None) on every rank."""
    row, pos, mask2d, packed, n = _layout(ids, att, packing, info.cp_size)
    cp = _context(model, info, row, pos, mask2d)
    t = row.shape[1] // cp.size
    s = cp.rank * t
    targets = torch.cat([row[:, 1:], row.new_zeros((row.shape[0], 1))], 1)[:, s:s + t]
    head = chunkable_head(model) if chunk_tokens > 0 else _linear_head(model)
    if head is None:
        raise ValueError("context_parallel_size > 1 needs a Linear output head (see roles/trainer/logprobs.py)")
    out = {}

    def head_forward(hidden):  # [B, t, H] -> [B, t] logprobs of this rank's positions
        h = hidden.reshape(-1, hidden.shape[-1])
        tg = targets.reshape(-1)
        if chunk_tokens > 0:
            lp, ent = chunked_logprobs(h, head.weight, tg, chunk_tokens, with_entropy, bias=head.bias)
        else:
            lp, ent = full_logprobs(h, head.weight, tg, with_entropy, bias=head.bias)
        out["entropy"] = ent.view(targets.shape) if ent is not None else None
        return lp.view(targets.shape)

    head.forward = head_forward  # this call only (an instance attribute over the class's method)
    try:
        local = model(input_ids=row[:, s:s + t], position_ids=pos[:, s:s + t], use_cache=False,
                      laminar_cp=cp).logits
    finally:
        del head.forward
    logp = gather_seq(local, cp)[:, :n - 1]
    ent = out.get("entropy")
    if ent is not None:
        with torch.no_grad():
            ent = gather_seq(ent, cp)[:, :n - 1]
    if packed is not None:
        return unpack(logp, packed), (unpack(ent, packed) if ent is not None else None)
    return logp, ent


def _linear_head(model):
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head if isinstance(head, torch.nn.Linear) else None


def cp_values(critic, ids, att, info, *, packing: bool):
    """The critic's values [B, T-1] of a right-padded micro-batch, its tokens split over the CP group."""
    row, pos, mask2d, packed, n = _layout(ids, att, packing, info.cp_size)
    cp = _context(critic.model, info, row, pos, mask2d)
    t = row.shape[1] // cp.size
    s = cp.rank * t
    local = critic(row[:, s:s + t], None, position_ids=pos[:, s:s + t], use_cache=False, laminar_cp=cp)
    values = gather_seq(local, cp)[:, :n - 1]
    return unpack(values, packed) if packed is not None else values
