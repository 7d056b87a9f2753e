"""Which sequences of a mini-batch each data-parallel rank trains, and in which micro-batch.

Every rank holds the whole batch and computes the same plan from the sequences' lengths (no
communication). Two rules shape it:

- Every rank runs the same number of micro-batches: each forward/backward is a chain of FSDP2
  collectives, so a rank that ran one more would wait forever. A rank with nothing left in a round
  gets an empty micro-batch (the engine forwards one short sequence with weight 0).
- Ranks run their k-th micro-batches in lockstep (every layer's all-gather and reduce-scatter is a
  meeting point), so a step costs the sum over rounds of the slowest rank's micro-batch. Dealing a
  long-tailed batch by count (`round_robin`: rank r takes sequences r, r+W, ...) puts the 16K
  responses on whichever ranks they fall to, and the others wait at every collective.

The balanced plan (`tokens`, `attention`) cuts the mini-batch into W x M bins with a Karmarkar-Karp
partition of the sequences' costs (the largest differencing method, k-way, as verl's
`balance_batch`): M is the fewest micro-batches per rank for which every bin holds at most
`max_seqs` sequences and at most `max_tokens` tokens (a single longer sequence is a bin of its own).
The bins, heaviest first, fill round 0 across the W ranks, then round 1, ... (a snake order, so no
rank always gets a round's heaviest bin): every round's bins are about equal, and so are the ranks'
totals. Right-padded micro-batches (packing off) under a token budget are cut differently: a bin of
mixed lengths pays for its longest, so there a bin takes neighbours in length order and the bins
are dealt to ranks heaviest first (`_padded_plan`). A sequence's cost is its tokens, or with
`attention` L + L^2 / A, where A = parameters / (layers x hidden): a forward costs about 2 N L
for the weights plus 2 x layers x hidden x L^2 for causal attention.

The plan's `rank_imbalance` (max / mean of the ranks' tokens) and `step_imbalance` (the sum over
rounds of the largest micro-batch / the sum of the rounds' means: what lockstep costs over perfect
balance) are the trainer's metrics of the same names.
"""
from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class MicroBatchPlan:
    """Every rank's micro-batches of one mini-batch (indices of the batch's sequences)."""
    ranks: list[list[list[int]]]  # ranks[r][k]: rank r's k-th micro-batch; the same count for every r
    tokens: list[list[int]]       # tokens[r][k]: its tokens (sum of the sequences' lengths)

    def rank_imbalance(self) -> float:
        """max / mean of the ranks' tokens (1.0 for an empty mini-batch)."""
        per_rank = [sum(t) for t in self.tokens]
        mean = sum(per_rank) / len(per_rank)
        return max(per_rank) / mean if mean > 0 else 1.0

    def step_imbalance(self) -> float:
        """sum over rounds of the largest micro-batch's tokens / sum of the rounds' mean tokens."""
        rounds = list(zip(*self.tokens, strict=True))
        top = sum(max(r) for r in rounds)
        mean = sum(sum(r) / len(r) for r in rounds)
        return top / mean if mean > 0 else 1.0


def plan_micro_batches(idx: Sequence[int], lengths: Sequence[int], world: int, max_seqs: int,
                       max_tokens: int | None = None, balance: str = "tokens", padded: bool = False,
                       attention_tokens: float | None = None) -> MicroBatchPlan:
    """The plan of the mini-batch `idx` (sequence indices; `lengths[j]` = tokens of `idx[j]`) over
    `world` ranks (module docstring). `padded`: a micro-batch's tokens for the budget are its count
    x its longest (right-padded), else their sum (packed)."""
    if balance == "round_robin":
        shares = [_split(list(range(r, len(idx), world)), lengths, max_seqs, max_tokens, padded) for r in range(world)]
        if max_tokens is None:  # as it always was: the same number of count-cut micro-batches everywhere
            rounds = math.ceil(math.ceil(len(idx) / world) / max_seqs) if idx else 0
        else:
            rounds = max(len(s) for s in shares)
        bins = [[s[k] if k < len(s) else [] for k in range(rounds)] for s in shares]
    elif balance in ("tokens", "attention"):
        if balance == "attention" and not attention_tokens:
            raise ValueError("micro_batch_balance 'attention' needs the model's attention_tokens")
        costs = [float(n) + (n * n / attention_tokens if balance == "attention" else 0.0) for n in lengths]
        bins = _balanced(costs, lengths, world, max_seqs, max_tokens, padded)
    else:
        raise ValueError(f"micro_batch_balance must be tokens, attention or round_robin, got {balance!r}")
    ranks = [[[idx[j] for j in b] for b in rank] for rank in bins]
    tokens = [[sum(lengths[j] for j in b) for b in rank] for rank in bins]
    return MicroBatchPlan(ranks, tokens)


def _fits(b: list[int], lengths: Sequence[int], max_seqs: int, max_tokens: int | None, padded: bool) -> bool:
    if len(b) > max_seqs:
        return False
    if max_tokens is None or len(b) <= 1:
        return True
    used = len(b) * max(lengths[j] for j in b) if padded else sum(lengths[j] for j in b)
    return used <= max_tokens


def _split(share: list[int], lengths, max_seqs: int, max_tokens: int | None, padded: bool) -> list[list[int]]:
    """A rank's sequences, in order, cut into micro-batches that fit."""
    out: list[list[int]] = []
    for j in share:
        if out and _fits(out[-1] + [j], lengths, max_seqs, max_tokens, padded):
            out[-1].append(j)
        else:
            out.append([j])
    return out


def _balanced(costs: list[float], lengths, world: int, max_seqs: int, max_tokens: int | None,
              padded: bool) -> list[list[list[int]]]:
    """bins[r][k] (positions in the mini-batch) from the fewest rounds M whose W x M bins fit."""
    n = len(costs)
    if n == 0:
        return [[] for _ in range(world)]
    if padded and max_tokens is not None:
        return _padded_plan(costs, lengths, world, max_seqs, max_tokens)
    rounds = max(1, math.ceil(n / (world * max_seqs)))
    if max_tokens is not None:  # a bin holds up to max_tokens, or one longer sequence alone
        rounds = max(rounds, math.ceil(sum(min(L, max_tokens) for L in lengths) / (world * max_tokens)))

    def fit(m: int):
        trial = karmarkar_karp(costs, world * m)
        return trial if all(_fits(p, lengths, max_seqs, max_tokens, padded) for p in trial) else None

    # the fewest rounds that fit: try M, M+1, M+3, M+7, ... then bisect the last gap. With W x M >= n
    # every bin holds one sequence, which always fits, so this ends (fitting is monotone in M up to
    # the partition's rounding: the plan found fits, it may be a round longer than the fewest)
    most = max(rounds, math.ceil(n / world))
    lo, step = rounds, 1
    parts = fit(lo)
    while parts is None:
        hi = min(most, lo + step)
        parts = fit(hi)
        if parts is None:
            lo, step = hi + 1, step * 2
            continue
        while lo < hi:  # parts fit at hi, nothing below lo does
            mid = (lo + hi) // 2
            trial = fit(mid)
            if trial is None:
                lo = mid + 1
            else:
                hi, parts = mid, trial
        lo = hi
    parts = sorted((sorted(p) for p in parts), key=lambda p: (-sum(costs[j] for j in p), p[:1]))
    bins: list[list[list[int]]] = [[] for _ in range(world)]
    for k in range(lo):
        row = parts[k * world:(k + 1) * world]
        order = range(world) if k % 2 == 0 else range(world - 1, -1, -1)
        for r, p in zip(order, row, strict=True):
            bins[r].append(p)
    return bins


def _padded_plan(costs: list[float], lengths, world: int, max_seqs: int, max_tokens: int) -> list[list[list[int]]]:
    """Right-padded micro-batches under a budget: bins of neighbours in length order (longest first,
    as many as fit beside the first; the heaviest halved while the last round has free slots),
    dealt heaviest first, each to the lightest rank with fewer than M = ceil(bins / W); every rank
    runs its heaviest first (rounds pair heavy with heavy)."""
    order = sorted(range(len(lengths)), key=lambda j: (-lengths[j], j))
    parts, i = [], 0
    while i < len(order):
        take = max(1, min(max_seqs, max_tokens // lengths[order[i]]))
        parts.append(order[i:i + take])
        i += take
    rounds = math.ceil(len(parts) / world)
    while len(parts) < world * rounds:  # free slots in the last round: halve the heaviest bins into them
        splittable = [p for p in parts if len(p) > 1]
        if not splittable:
            break
        top = max(splittable, key=lambda p: sum(costs[j] for j in p))
        parts.remove(top)
        parts += [top[::2], top[1::2]]
    weight = [sum(costs[j] for j in p) for p in parts]
    bins: list[list[list[int]]] = [[] for _ in range(world)]
    load = [0.0] * world
    for b in sorted(range(len(parts)), key=lambda b: (-weight[b], b)):
        r = min((r for r in range(world) if len(bins[r]) < rounds), key=lambda r: (load[r], r))
        bins[r].append(sorted(parts[b]))
        load[r] += weight[b]
    return [rank + [[] for _ in range(rounds - len(rank))] for rank in bins]


def karmarkar_karp(costs: Sequence[float], k: int) -> list[list[int]]:
    """k parts of range(len(costs)) with near-equal sums (the largest differencing method): every
    item starts as a k-tuple of parts (itself and k-1 empty ones); the two tuples with the largest
    spread (max - min part sum) are merged, the heaviest part of one with the lightest of the other,
    until one tuple is left. With k >= len(costs) every item gets a part of its own."""
    tie = itertools.count()  # equal spreads merge in a fixed order: every rank computes the same plan
    heap = []
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        parts = [[float(costs[i]), [i]]] + [[0.0, []] for _ in range(k - 1)]  # heaviest first
        heapq.heappush(heap, (-float(costs[i]), next(tie), parts))
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        for pa, pb in zip(a, reversed(b), strict=True):  # a's heaviest with b's lightest (both kept sorted)
            pa[0] += pb[0]
            pa[1].extend(pb[1])
        a.sort(key=lambda p: -p[0])
        heapq.heappush(heap, (-(a[0][0] - a[-1][0]), next(tie), a))
    return [p for _, p in heap[0][2]]
