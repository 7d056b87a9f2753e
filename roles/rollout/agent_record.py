"""How an agent episode's calls and segments sit in its trajectory (roles/rollout/agent.py), read back from
what the trajectory carries anyway, so a moved episode knows them too.

Each recorded call is one observation span (its new context tokens, empty for the first call) and
then choice 0's sampled tokens. A *segment* starts where a call rewrote the history and the
episode is configured to keep going (`on_rewrite: segment`): its whole rendered context is
appended as one observation, marked by an empty span right before it, at the same offset (a call
always samples at least one token, so no other pair of spans touches). From there on a call must
extend the segment's tokens, not the whole recording; the engine still sees the whole recording,
earlier segments first, so the trajectory stays one token sequence the engine saw and produced.

    segment_start(spans)  response offset where the current segment's context begins (None: the prompt)
    calls(spans)          calls recorded (segment markers left out)
    turns(spans, n)       (start, end) of each call's sampled tokens, in order
"""
from __future__ import annotations


def _markers(spans: list[tuple[int, int]]) -> list[int]:
    """Indices of the segment markers: an empty span followed by a span at its offset."""
    return [k for k in range(len(spans) - 1) if spans[k][0] == spans[k][1] == spans[k + 1][0]]


def segment_start(spans: list[tuple[int, int]]) -> int | None:
    marks = _markers(spans)
    return spans[marks[-1]][0] if marks else None


def calls(spans: list[tuple[int, int]]) -> int:
    return len(spans) - len(_markers(spans))


def turns(spans: list[tuple[int, int]], n_tokens: int) -> list[tuple[int, int]]:
    """Where each call's sampled tokens lie: from its observation's end to the next span's start."""
    marks = set(_markers(spans))
    out = []
    for k, (_, end) in enumerate(spans):
        if k in marks:
            continue
        out.append((end, spans[k + 1][0] if k + 1 < len(spans) else n_tokens))
    return out
