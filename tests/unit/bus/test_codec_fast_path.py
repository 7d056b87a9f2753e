"""The codec's one-pass decoder (bus/codec.py `_decode_fast`) gives what the careful two-phase
decoder gives for every kind, builds events exactly as their constructor would, and the scoped
broker's remembered verdicts are the rule's own."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from laminar.bus import auth, codec
from laminar.bus.broker import Verdicts

from laminar.protocol import registered_kinds
from tests.support import same
from tests.unit.bus.test_codec import event_strategy


@pytest.mark.parametrize("kind", sorted(registered_kinds()))
def test_every_kind_builds_without_its_constructor_as_with_it(kind):
    """The fast build sets every field straight into the instance: valid only while no kind has a
    __post_init__ or a field outside __init__ (a kind added with one must make the codec call it)."""
    cls = registered_kinds()[kind]
    assert "__post_init__" not in vars(cls), f"{kind} has a __post_init__: the codec's fast build skips it"
    assert all(f.init for f in dataclasses.fields(cls)), f"{kind} has a field outside __init__"


@pytest.mark.parametrize("kind", sorted(registered_kinds()))
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fast_and_careful_decoders_agree(kind, data):
    ev = data.draw(event_strategy(registered_kinds()[kind]))
    frames = [bytes(f) for f in codec.encode(ev, {"rid": 7})]
    cls, name, body, buffers = codec._frames(frames, codec.MAX_BODY_BYTES, codec.MAX_FRAMES)
    fast, meta_f = codec._decode_fast(cls, name, body, buffers, codec.MAX_BODY_BYTES, codec.MAX_CONTAINERS)
    careful, meta_c = codec._decode_checked(cls, name, body, buffers, codec.MAX_BODY_BYTES, codec.MAX_CONTAINERS)
    assert type(fast) is type(careful) is type(ev)
    assert same(fast, careful) and same(fast, ev) and meta_f == meta_c == {"rid": 7}


def test_remembered_verdicts_are_the_rules_own_and_bounded():
    v = Verdicts(limit=4)
    cases = [("rollout.r0", b"ctrl.all"), ("rollout.r0", b"hb.rollout.r0"), ("rollout.r0", b"hb.rollout.r1"),
             ("operator", b"ctrl.all"), (None, b"weights.chain"), ("relay.x", b"weights.version.y"),
             ("rollout.r0", b"ctrl.all")]
    for who, topic in cases * 3:
        assert v.why(who, topic) == auth.topic_refusal(who, topic)
        assert len(v.decided) <= 4
    assert v.why("rollout.r0", b"ctrl.all")  # refused, from memory as when decided
