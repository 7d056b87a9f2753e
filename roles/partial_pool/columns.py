"""Columnar delta batches (AppendDeltaBatch) in the partial pool: their checks, done over the
whole batch at once, and the flush every rollout sends most often, applied without a Python
object per delta.

`check_batch` validates a request's columns with numpy (lengths, offsets, seqs, specs) before
anything of it is applied; `unbatch` then cuts it into deltas (views into the request's arrays)
for the general rules of state.py.

`continues(book, req, peer)` is the common case: every delta is the next seq of a live trajectory
the writer may write (its own, at its epoch or later), none waits behind held deltas, none repeats,
no loss mask, no observation spans, no routing. The checks are set operations over the batch
(C-level `map` over the entries, list and set comparisons): no rule of state.py or of the hand-outs
can refuse, hold or drop any of them, so the batch is applied in one tight loop (`apply_continuing`)
and stored as one chunk, with the same outcome as the general path. Anything else (a seq 0, a gap, a
fence, a duplicate, another's trajectory) goes the general way, delta by delta.
"""
from __future__ import annotations

from operator import attrgetter, le

import numpy as np
from laminar.bus.auth import owned_by_other
from laminar.bus.rpc import RequestError
from laminar.roles.partial_pool.state import Delta, Entry, PartialBook

from laminar.models.routing import split_rows
from laminar.protocol import AppendDeltaBatch

_TID, _OWNER, _SPEC = attrgetter("trajectory_id"), attrgetter("owner"), attrgetter("spec")
_NEXT, _HELD, _EPOCH = attrgetter("next_seq"), attrgetter("held"), attrgetter("epoch")


def check_batch(req: AppendDeltaBatch) -> None:
    """Raise `bad_request` unless the columns fit together (nothing of the request applied yet)."""
    n = len(req.trajectory_ids)
    cols = {"seqs": req.seqs, "versions": req.versions, "epochs": req.epochs, "lineages": req.lineages}
    lens = {k: len(v) for k, v in cols.items() if v is not None}
    off = req.offsets
    if any(v != n for v in lens.values()) or len(off) != n + 1 or any(
            v is not None and v.ndim != 1 for v in (*cols.values(), off)):
        raise RequestError("bad_request", f"{n} trajectory ids but " + ", ".join(f"{v} {k}" for k, v in lens.items())
                           + f" and {len(off)} offsets")
    if req.tokens.ndim != 1 or req.logprobs.ndim != 1 or (req.loss_mask is not None and req.loss_mask.ndim != 1):
        raise RequestError("bad_request", "tokens, logprobs and loss mask must be 1-D arrays")
    if len(off) and (off[0] != 0 or off[-1] != len(req.tokens) or len(req.logprobs) != len(req.tokens)
                     or bool((np.diff(off) < 0).any())):
        raise RequestError("bad_request", "offsets do not cut tokens and logprobs into deltas")
    if req.loss_mask is not None and len(req.loss_mask) != len(req.tokens):
        raise RequestError("bad_request", "loss mask and tokens differ in length")
    if n and bool((req.seqs < 0).any()):
        raise RequestError("bad_request", "negative seq")
    _check_spans(req, n)
    zeros = int(np.count_nonzero(req.seqs == 0)) if n else 0
    if zeros != len(req.specs):
        raise RequestError("bad_request", f"{len(req.specs)} specs for {zeros} seq-0 deltas")


def _check_spans(req: AppendDeltaBatch, n: int) -> None:
    """The observation spans columns: both or neither, (start, end) rows cut by n + 1 offsets."""
    spans, off = req.obs_spans, req.obs_offsets
    if spans is None and off is None:
        return
    if spans is None or off is None:
        raise RequestError("bad_request", "obs_spans and obs_offsets come together")
    if spans.ndim != 2 or spans.shape[1] != 2:
        raise RequestError("bad_request", f"obs_spans of shape {spans.shape} are not (start, end) rows")
    if off.ndim != 1 or len(off) != n + 1 or off[0] != 0 or off[-1] != len(spans) or bool((np.diff(off) < 0).any()):
        raise RequestError("bad_request", "obs_offsets do not cut obs_spans into deltas")


def _masks(req: AppendDeltaBatch, off: list[int], n: int) -> list:
    """Each delta's loss mask (a view), None where it is all 1 (what a sender means by none)."""
    if req.loss_mask is None:
        return [None] * n
    mask = req.loss_mask.astype(np.uint8, copy=False)
    return [None if bool(mask[a:b].all()) else mask[a:b] for a, b in zip(off, off[1:], strict=False)]


def _spans(req: AppendDeltaBatch, n: int) -> list:
    """Each delta's observation spans (a view), None where it has none."""
    if req.obs_spans is None:
        return [None] * n
    spans, off = req.obs_spans.astype(np.int32, copy=False), req.obs_offsets.tolist()
    return [spans[a:b] if b > a else None for a, b in zip(off, off[1:], strict=False)]


def unbatch(req: AppendDeltaBatch) -> list[Delta]:
    """The request's deltas (checked: check_batch), as views into its arrays."""
    check_batch(req)
    n = len(req.trajectory_ids)
    try:
        routing = split_rows(req.routing, req.routing_offsets, n)
    except ValueError as exc:
        raise RequestError("bad_request", str(exc)) from None
    seqs, versions, off = req.seqs.tolist(), req.versions.tolist(), req.offsets.tolist()
    epochs = req.epochs.tolist() if req.epochs is not None else [0] * n
    lineages = req.lineages.tolist() if req.lineages is not None else [-1] * n
    specs = iter(req.specs)
    toks, lps = req.tokens.astype(np.int32, copy=False), req.logprobs.astype(np.float32, copy=False)
    return [Delta(tid, seq, toks[a:b], lps[a:b], v, next(specs) if seq == 0 else None, mask, spans, ep, lin, rows)
            for tid, seq, v, ep, lin, a, b, rows, mask, spans in zip(
                req.trajectory_ids, seqs, versions, epochs, lineages, off, off[1:], routing, _masks(req, off, n),
                _spans(req, n), strict=False)]


def continues(book: PartialBook, req: AppendDeltaBatch, peer: str | None) -> list[Entry] | None:
    """The entries the batch's deltas continue, in order, when it is the common case (module
    docstring); None otherwise. `req` is checked (check_batch)."""
    n = len(req.trajectory_ids)
    if not n or req.specs or req.loss_mask is not None or req.obs_spans is not None or req.routing is not None:
        return None  # routing rows follow their entry's on the general path (Entry.routing_misfit)
    found = list(map(book.entries.get, req.trajectory_ids))
    if None in found or None in map(_SPEC, found) or any(map(_HELD, found)):
        return None
    if list(map(_NEXT, found)) != req.seqs.tolist() or len(set(req.trajectory_ids)) != n:
        return None
    if req.epochs is not None and not all(map(le, map(_EPOCH, found), req.epochs.tolist())):
        return None
    if peer is not None and any(owned_by_other(peer, o) for o in set(map(_OWNER, found))):
        return None
    return found


def apply_continuing(book: PartialBook, found: list[Entry], req: AppendDeltaBatch, owner: str, chunk: int) -> int:
    """Apply a batch `continues` accepted, as one chunk of the store (book.add_chunk's bookkeeping
    folded in: every trajectory of it is live); the number of deltas applied."""
    toks, lps = req.tokens.astype(np.int32, copy=False), req.logprobs.astype(np.float32, copy=False)
    off = req.offsets.tolist()
    lineages = req.lineages.tolist() if req.lineages is not None else [-1] * len(found)
    for e, v, lin, a, b in zip(found, req.versions.tolist(), lineages, off, off[1:], strict=False):
        e.tokens.append(toks[a:b])
        e.logprobs.append(lps[a:b])
        e.masks.append(None)
        e.chunks.append(chunk)
        e.owner, e.version, e.next_seq, e.ntokens = owner, v, e.next_seq + 1, e.ntokens + b - a
        if lin >= 0:
            e.lineage = lin
    book.tokens += off[-1]
    book.chunk_live[chunk], book.chunk_done[chunk] = set(req.trajectory_ids), []
    return len(found)


def all_own(entries: dict, deltas: list, peer: str) -> bool:
    """Whether every delta continues a live trajectory `peer` may write (its own): then the
    ownership rules have nothing to refuse and no hand-out to check (`apply` still refuses an
    older epoch). C-level passes over the batch (map, set), no Python call per delta."""
    found = list(map(entries.get, map(_TID, deltas)))
    if None in found or None in map(_SPEC, found):
        return False
    return not any(owned_by_other(peer, owner) for owner in set(map(_OWNER, found)))
