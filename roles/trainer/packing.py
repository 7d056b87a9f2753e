"""Sequence packing: one micro-batch forwarded as a single row, without padding.

The trainer's micro-batches are right-padded `prompt + response` sequences ([B, T], see
batching.py). Padded, a micro-batch of 4 sequences whose lengths range from 300
to 1,280 tokens spends up to half of its forward and backward on pad tokens. Packed, the B
sequences are laid end to end in one row of N = sum(lengths) tokens with per-sequence positions
(0, 1, ..., L_b - 1 for each sequence) and no attention mask; the model then attends within each
sequence only:

    Hugging Face transformers reads packed sequences from `position_ids` when `attention_mask` is
    None and there is no KV cache (use_cache=False: an eval-mode model would make one): with
    `flash_attention_2` it calls flash-attention's varlen kernel (cu_seqlens from the position
    resets), with `sdpa` and `eager` it builds a block-diagonal causal mask. The second is the
    CPU path, and the two give the same values up to float rounding.

The per-token results (logprobs, entropies, critic values) are mapped back to the padded target
layout [B, T-1] (0 at positions past a sequence's end), so every loss, mask and metric downstream
is the padded path's code, unchanged: the packed and padded paths give the same per-token
logprobs and losses within float tolerance (tests/unit/roles/trainer/test_packing.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from laminar.roles.trainer.logprobs import token_logprobs


@dataclass
class Packed:
    input_ids: object     # [1, N] long: the sequences end to end
    position_ids: object  # [1, N] long: 0..L_b-1 per sequence
    index: object         # [B, T-1] long: packed position of each padded target position (0 where none)
    valid: object         # [B, T-1] bool: target positions inside their sequence (t < L_b - 1)


def pack(input_ids, attention_mask) -> Packed:
    """Pack a right-padded batch (the layout of `collate`): each row's first L_b tokens."""
    import torch  # late: torch; configs validate without it
    lens = attention_mask.sum(1).long()
    B, T = input_ids.shape
    packed = input_ids[attention_mask.bool()][None]
    positions = torch.cat([torch.arange(int(n), device=input_ids.device) for n in lens])[None]
    offsets = torch.cumsum(lens, 0) - lens
    t = torch.arange(T - 1, device=input_ids.device)[None]
    valid = t < (lens[:, None] - 1)
    index = torch.where(valid, offsets[:, None] + t, torch.zeros_like(t))
    return Packed(packed, positions, index, valid)


def unpack(values, p: Packed):
    """[1, N'] per-position values (N' >= N-1; position k of the row) -> the padded target layout
    [B, T-1], 0 where a padded position has no token."""
    import torch  # late: torch; configs validate without it
    out = values[0][p.index]
    return torch.where(p.valid, out, torch.zeros_like(out))


def packed_token_logprobs(model, input_ids, attention_mask, with_entropy: bool = False, chunk_tokens: int = 0):
    """`token_logprobs` of a right-padded batch, computed on its packed row (chunked as asked):
    ([B, T-1] logprobs, [B, T-1] entropies or None), the same layout and math as the padded forward."""
    p = pack(input_ids, attention_mask)
    logp, ent = token_logprobs(model, p.input_ids, None, with_entropy=with_entropy, chunk_tokens=chunk_tokens,
                               position_ids=p.position_ids)
    return unpack(logp, p), (unpack(ent, p) if ent is not None else None)


def packed_values(critic, input_ids, attention_mask):
    """The critic's values [B, T-1] (state before each target token) from the packed row."""
    p = pack(input_ids, attention_mask)
    return unpack(critic(p.input_ids, None, position_ids=p.position_ids, use_cache=False), p)
