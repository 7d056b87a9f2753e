"""The partial pool's batch path (roles/partial_pool/columns.py) changes nothing the per-delta
rules would not: on random histories (gaps, retries, fences, another rollout's trajectories,
seq 0s), a batch it takes ends in the same book as the same batch cut into deltas and applied
one by one, and it declines every batch where the two could differ."""
from __future__ import annotations

import copy
import random

import numpy as np
import pytest
from laminar.bus.rpc import RequestError
from laminar.roles.partial_pool.columns import all_own, apply_continuing, check_batch, continues, unbatch
from laminar.roles.partial_pool.state import Outcome, PartialBook

from laminar.protocol import AppendDeltaBatch, TrajectorySpec


def spec(tid: str) -> TrajectorySpec:
    return TrajectorySpec(trajectory_id=tid, prompt_id=tid, group_id=tid, sample_index=0, group_size=1,
                          prompt_tokens=np.arange(4, dtype=np.int32))


def batch(rollout: str, items: list[tuple[str, int, int]], rng: random.Random, lineage: int = 3) -> AppendDeltaBatch:
    """items: (trajectory id, seq, epoch); random lengths and token values."""
    lens = [rng.randint(0, 5) for _ in items]
    n = sum(lens)
    return AppendDeltaBatch(
        rollout, [t for t, _, _ in items], np.array([s for _, s, _ in items], np.int64),
        np.full(len(items), 7, np.int64), np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
        np.array([rng.randint(0, 255) for _ in range(n)], np.int32), np.linspace(-1, 0, n).astype(np.float32),
        [spec(t) for t, s, _ in items if s == 0], np.array([e for _, _, e in items], np.int64),
        lineages=np.full(len(items), lineage, np.int64))


def snapshot(book: PartialBook) -> dict:
    out = {}
    for tid, e in book.entries.items():
        st = e.state() if e.spec is not None else None
        out[tid] = (e.owner, e.version, e.next_seq, e.epoch, e.lineage, e.ntokens, sorted(e.held), e.chunks,
                    None if st is None else (st.tokens.tolist(), st.logprobs.tolist()))
    return {"entries": out, "tokens": book.tokens, "chunks": {c: sorted(t) for c, t in book.chunk_live.items()}}


def general(book: PartialBook, req: AppendDeltaBatch, chunk: int) -> Outcome:
    out = book.apply(req.rollout_id, unbatch(req), checked=True)
    if len(out.applied) == len(req.trajectory_ids):
        book.add_chunk(chunk, req.trajectory_ids)
    return out


@pytest.mark.parametrize("seed", range(40))
def test_the_batch_path_ends_where_the_per_delta_rules_end(seed):
    rng = random.Random(seed)
    book = PartialBook(max_held=4)
    tids = [f"t{i}" for i in range(6)]
    nxt = dict.fromkeys(tids, 0)
    taken = 0
    for step in range(30):
        pick = rng.sample(tids, rng.randint(1, len(tids)))
        items = []
        for t in pick:
            seq = nxt[t] + rng.choice([0, 0, 0, 0, 1, -1]) if nxt[t] else rng.choice([0, 0, 1])
            items.append((t, max(seq, 0), book.entries[t].epoch if t in book.entries else 0))
        if rng.random() < 0.1:
            items.append(items[0])  # the same trajectory twice in one batch
        rollout = rng.choice(["r0", "r0", "r0", "r1"])
        req = batch(rollout, items, rng)
        if rng.random() < 0.1 and book.entries:  # another owner takes one over
            book.fence(rng.choice(list(book.entries)), "r1")
        fast_book, slow_book = copy.deepcopy(book), copy.deepcopy(book)
        found = continues(fast_book, req, None)
        slow = general(slow_book, req, step)
        if found is not None:
            taken += 1
            assert apply_continuing(fast_book, found, req, rollout, step) == len(req.trajectory_ids)
            assert len(slow.applied) == len(req.trajectory_ids) and not slow.rejected and not slow.held
            assert snapshot(fast_book) == snapshot(slow_book)
        book = slow_book
        for t in pick:
            if t in book.entries:
                nxt[t] = book.entries[t].next_seq
    assert taken, "no batch took the batch path: the test exercised nothing"


def test_another_rollouts_trajectory_goes_the_per_delta_way():
    rng = random.Random(0)
    book = PartialBook()
    book.apply("r0", unbatch(batch("r0", [("a", 0, 0), ("b", 0, 0)], rng)), checked=True)
    book.entries["b"].owner = "r1"
    req = batch("r0", [("a", 1, 0), ("b", 1, 0)], rng)
    assert continues(book, req, "rollout.r0") is None            # b is r1's: the rules decide
    assert continues(book, req, None) is not None                # no scoped key: no owner to check
    assert not all_own(book.entries, unbatch(req), "rollout.r0")
    book.entries["b"].owner = "r0"
    assert continues(book, req, "rollout.r0") is not None
    assert all_own(book.entries, unbatch(req), "rollout.r0")


@pytest.mark.parametrize("bad, match", [
    (dict(offsets=np.array([0, 3, 2, 5], np.int64)), "offsets"),
    (dict(seqs=np.array([1, -1, 1], np.int64)), "negative seq"),
    (dict(versions=np.zeros(2, np.int64)), "3 trajectory ids"),
    (dict(specs=[spec("x")]), "1 specs for 0 seq-0"),
    (dict(tokens=np.zeros((5, 1), np.int32)), "1-D"),
])
def test_malformed_columns_are_refused_before_anything_applies(bad, match):
    rng = random.Random(1)
    good = batch("r0", [("a", 1, 0), ("b", 1, 0), ("c", 1, 0)], rng)
    good = AppendDeltaBatch(good.rollout_id, good.trajectory_ids, good.seqs, good.versions,
                            np.array([0, 1, 2, 5], np.int64), np.arange(5, dtype=np.int32), np.zeros(5, np.float32),
                            [], good.epochs, lineages=good.lineages)
    fields = {**good.__dict__, **bad}
    with pytest.raises(RequestError, match=match):
        check_batch(AppendDeltaBatch(**fields))
