"""Codec: every registered kind round-trips (property-based, strategies derived from the field
types, so kinds added later are covered automatically); bad input raises typed errors."""
from __future__ import annotations

import dataclasses
import typing
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from laminar.bus.codec import MAX_BODY_BYTES, decode, encode
from laminar.bus.errors import MalformedFrame, OversizedFrame, ProtocolMismatch, UnknownKind
from laminar.protocol import PROTOCOL_VERSION, Ping, registered_kinds

scalars = st.one_of(st.integers(-2**40, 2**40), st.floats(allow_nan=False), st.text(max_size=8), st.booleans(), st.none())
arrays = st.sampled_from([np.int32, np.float32, np.uint8, np.int64]).flatmap(
    lambda dt: st.tuples(st.integers(0, 3), st.integers(1, 4)).map(
        lambda s: (np.arange(s[0] * s[1]) % 100).astype(dt).reshape(s) if s[0] else np.zeros(0, dt)))


def strategy(tp: Any, depth: int = 0) -> st.SearchStrategy:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return scalars
    if origin in (typing.Union, getattr(__import__("types"), "UnionType")):
        return st.one_of(*(strategy(a, depth) for a in args))
    if tp is type(None):
        return st.none()
    if tp is int:
        return st.integers(-2**40, 2**40)
    if tp is float:
        return st.floats(allow_nan=False, allow_infinity=False)
    if tp is str:
        return st.text(max_size=12)
    if tp is bytes:
        return st.binary(max_size=16)
    if tp is bool:
        return st.booleans()
    if tp is np.ndarray:
        return arrays
    if origin is list:
        return st.lists(strategy(args[0], depth + 1), max_size=2 if depth < 2 else 0)
    if origin is dict:
        return st.dictionaries(st.text(max_size=6), strategy(args[1], depth + 1) if args else scalars, max_size=3)
    if dataclasses.is_dataclass(tp):
        return event_strategy(tp, depth + 1)
    raise AssertionError(f"no strategy for {tp}")


def event_strategy(cls: type, depth: int = 0) -> st.SearchStrategy:
    hints = typing.get_type_hints(cls)
    return st.builds(cls, **{f.name: strategy(hints[f.name], depth) for f in dataclasses.fields(cls)})


def same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("kind", sorted(registered_kinds()))
def test_round_trip_every_kind(kind):
    cls = registered_kinds()[kind]

    @settings(max_examples=25, deadline=None)
    @given(ev=event_strategy(cls), rid=st.integers(0, 2**31))
    def check(ev, rid):
        frames = [bytes(f) for f in encode(ev, {"rid": rid})]
        assert frames[0] == kind.encode()
        back, meta = decode(frames)
        assert same(ev, back) and meta == {"rid": rid}
    check()


def frames_of(ev=None, meta=None, version=PROTOCOL_VERSION):
    return [bytes(f) for f in encode(ev or Ping(seq=1, array=np.arange(4, dtype=np.float32)), meta, version)]


def test_bad_input_raises_typed_errors():
    good = frames_of()
    with pytest.raises(MalformedFrame):
        decode(good[:1])                                            # too few frames
    with pytest.raises(MalformedFrame):
        decode([good[0], b"\xc1\xff garbage"])                      # not msgpack
    with pytest.raises(MalformedFrame):
        decode([good[0], good[1][:5], good[2]])                     # truncated body
    with pytest.raises(OversizedFrame):
        decode([good[0], b"\x00" * (MAX_BODY_BYTES + 1)])
    with pytest.raises(UnknownKind):
        decode([b"no.such.kind", good[1]])
    with pytest.raises(MalformedFrame):
        decode([good[0], good[1], good[2][:-1]])                    # array bytes do not match shape
    with pytest.raises(MalformedFrame):
        decode(good + [b"extra"])                                   # unreferenced array frame
    with pytest.raises(MalformedFrame):
        decode([good[0], good[1]])                                  # array index out of range
    obj_header = msgpack.ExtType(1, msgpack.packb([0, "|O", [1]]))
    with pytest.raises(MalformedFrame):
        decode([b"ping", msgpack.packb([PROTOCOL_VERSION, {}, {"seq": 1, "array": obj_header}]), b"\x00" * 8])
    with pytest.raises(MalformedFrame, match="seq"):
        decode([b"ping", msgpack.packb([PROTOCOL_VERSION, {}, {"seq": "one"}])])  # wrong field type
    with pytest.raises(MalformedFrame):
        decode([b"ping", msgpack.packb([PROTOCOL_VERSION, {}, {"seq": 1, "nope": 2}])])  # unknown field


def test_wrong_protocol_version_names_both_and_keeps_request_id():
    with pytest.raises(ProtocolMismatch, match=f"peer speaks protocol 2, this side speaks protocol {PROTOCOL_VERSION}") as e:
        decode(frames_of(meta={"rid": 42}, version=2))
    assert e.value.meta == {"rid": 42}
