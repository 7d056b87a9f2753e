"""Exactly-once deltas: any duplication and reordering of a stream gives the in-order result."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from laminar.roles.partial_pool.state import PartialBook

from laminar.protocol import TokenDelta, TrajectorySpec


def stream(tid: str, sizes: list[int]) -> list[TokenDelta]:
    spec = TrajectorySpec(trajectory_id=tid, prompt_id="p", group_id="g", sample_index=0, group_size=1,
                          prompt_tokens=np.array([1, 2], np.int32))
    out, tok = [], 10
    for seq, n in enumerate(sizes):
        toks = np.arange(tok, tok + n, dtype=np.int32)
        tok += n
        out.append(TokenDelta(trajectory_id=tid, seq=seq, tokens=toks, logprobs=-toks.astype(np.float32) / 100,
                              version=3, spec=spec if seq == 0 else None))
    return out


def snapshot(book: PartialBook, tid: str):
    s = book.live()[tid].state()
    return s.tokens.tolist(), s.logprobs.tolist(), s.next_seq, s.version


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(0, 5), min_size=1, max_size=12), data=st.data())
def test_duplicates_and_reordering_equal_in_order(sizes, data):
    deltas = stream("t", sizes)
    ref = PartialBook()
    ref.apply("r", deltas)
    noisy = data.draw(st.permutations(deltas + data.draw(st.lists(st.sampled_from(deltas), max_size=10))))
    book = PartialBook()
    # deliver in random-sized batches, as several AppendDeltas calls would
    i = 0
    while i < len(noisy):
        k = data.draw(st.integers(1, 4))
        book.apply("r", noisy[i:i + k])
        i += k
    assert snapshot(book, "t") == snapshot(ref, "t")
    assert not book.live()["t"].held


def test_unknown_and_completed_trajectories():
    book = PartialBook(max_held=2)
    d = stream("t", [1, 1, 1, 1])
    out = book.apply("r", d[1:])                      # no seq 0 yet: held up to the bound
    assert out.held == 2 and "t" in out.rejected
    assert "t" not in book.live()
    book.apply("r", d[:1])
    assert book.live()["t"].next_seq == 3             # 0 applied, then the held 1 and 2
    book.complete("t")
    out = book.apply("r", d[3:])
    assert out.rejected == {"t": "trajectory already completed"}
    bad = TokenDelta(
        trajectory_id="u", seq=0, tokens=np.zeros(1, np.int32), logprobs=np.zeros(1, np.float32), version=0
    )
    assert book.apply("r", [bad]).rejected == {"u": "seq 0 must carry the trajectory's own spec"}


def test_malformed_deltas_change_nothing():
    """Arrays that do not fit together are rejected before any of the delta is applied, so a retry
    of the same bad request cannot pile up tokens (and a good delta after it still applies)."""
    import dataclasses
    book = PartialBook()
    good = stream("t", [2, 2])
    book.apply("r", good[:1])
    bads = [dataclasses.replace(good[1], obs_spans=np.array([1, 2, 3], np.int32)),
            dataclasses.replace(good[1], logprobs=np.zeros(5, np.float32)),
            dataclasses.replace(good[1], loss_mask=np.ones((2, 1), np.uint8)),
            dataclasses.replace(good[1], tokens=np.zeros((1, 2), np.int32)),
            dataclasses.replace(good[1], seq=-1)]
    for bad in bads:
        for _ in range(2):
            out = book.apply("r", [bad])
            assert list(out.rejected) == ["t"] and not out.applied
    s = book.live()["t"].state()
    assert s.tokens.tolist() == [10, 11] and s.next_seq == 1
    book.apply("r", good[1:])
    assert book.live()["t"].state().tokens.tolist() == [10, 11, 12, 13]
