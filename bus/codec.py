"""msgpack codec: event <-> list of frames.

Frame layout: [kind, body, *buffers]
  kind     ASCII kind tag, its own frame so a receiver can route (or drop) before decoding;
  body     msgpack [protocol_version, meta, fields]; meta carries envelope data (request id,
           deadline budget, sender) and fields the dataclass fields;
  buffers  raw bytes of every numpy array in the fields, in order. In the body an array is an
           ExtType(1, [index, dtype, shape]); a nested event is ExtType(2, [kind, fields]).

Decoding never trusts the peer: sizes, dtypes, shapes, kinds and field types are checked and any
violation raises a CodecError subclass that the receiver counts and drops.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Sequence

import msgpack
import numpy as np

from laminar.bus.errors import CodecError, MalformedFrame, OversizedFrame, ProtocolMismatch, UnknownKind
from laminar.protocol import PROTOCOL_VERSION, lookup
from laminar.protocol.registry import field_errors

EXT_ARRAY = 1
EXT_EVENT = 2
MAX_BODY_BYTES = 16 << 20
MAX_FRAMES = 1 << 16
_SAFE_DTYPE_KINDS = set("biuf")
_DTYPE_RE = re.compile(r"[<>|=]?[biuf][1-9][0-9]?")


def _fields(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def encode(obj: Any, meta: dict[str, Any] | None = None, version: int = PROTOCOL_VERSION) -> list:
    """Encode one event into frames (bytes / memoryviews, ready for send_multipart)."""
    buffers: list = []

    def default(v: Any) -> Any:
        if isinstance(v, np.ndarray):
            if v.dtype.kind not in _SAFE_DTYPE_KINDS:
                raise TypeError(f"array dtype {v.dtype} cannot travel on the bus")
            a = v if v.flags.c_contiguous else np.ascontiguousarray(v)  # (which makes 0-d arrays 1-d)
            buffers.append(memoryview(a.reshape(-1)).cast("B") if a.size else b"")
            head = msgpack.packb([len(buffers) - 1, a.dtype.str, list(a.shape)])
            return msgpack.ExtType(EXT_ARRAY, head)
        if dataclasses.is_dataclass(v) and hasattr(type(v), "kind"):
            return msgpack.ExtType(EXT_EVENT, msgpack.packb([type(v).kind, _fields(v)], default=default))
        if isinstance(v, (np.integer, np.floating, np.bool_)):
            return v.item()
        raise TypeError(f"cannot encode {type(v).__name__} on the bus")

    kind = type(obj).kind
    body = msgpack.packb([version, meta or {}, _fields(obj)], default=default)
    return [kind.encode("ascii"), body, *buffers]


def decode(frames: Sequence[bytes], max_body: int = MAX_BODY_BYTES) -> tuple[Any, dict[str, Any]]:
    """Decode frames into (event, meta). Raises a CodecError subclass on any bad input."""
    try:
        return _decode(frames, max_body)
    except CodecError:
        raise
    except Exception as exc:  # a check this codec missed must still never reach a receive loop raw
        raise MalformedFrame(f"undecodable frames: {type(exc).__name__}: {str(exc)[:200]}") from None


def _decode(frames: Sequence[bytes], max_body: int) -> tuple[Any, dict[str, Any]]:
    if len(frames) < 2:
        raise MalformedFrame(f"expected at least 2 frames (kind, body), got {len(frames)}")
    kind_raw, body = bytes(frames[0]), frames[1]
    if len(body) > max_body:
        raise OversizedFrame(f"body of {len(body)} bytes exceeds the limit of {max_body}")
    try:
        kind = kind_raw.decode("ascii")
    except UnicodeDecodeError:
        raise MalformedFrame("kind frame is not ASCII") from None
    cls = lookup(kind)
    if cls is None:
        raise UnknownKind(f"unknown message kind {kind[:64]!r}")
    buffers = frames[2:]
    # Two phases: unpack with extensions left opaque, read the envelope (so errors can still
    # name the request id), then resolve arrays and nested events with every check applied.
    try:
        top = msgpack.unpackb(body, strict_map_key=False)
    except Exception as exc:  # msgpack raises a zoo of types on garbage
        raise MalformedFrame(f"body is not valid msgpack: {type(exc).__name__}: {exc}") from None
    if not (isinstance(top, list) and len(top) == 3):
        raise MalformedFrame("body must be a 3-element array [version, meta, fields]")
    version, meta, fields = top
    if not isinstance(meta, dict):
        raise MalformedFrame("meta must be a map")
    try:
        if len(frames) > MAX_FRAMES:
            raise OversizedFrame(f"{len(frames)} frames exceeds the limit of {MAX_FRAMES}")
        if type(version) is not int or version != PROTOCOL_VERSION:  # True == 1.0 == 1 in Python
            raise ProtocolMismatch(version, PROTOCOL_VERSION)
        used: set[int] = set()
        obj = _build(cls, kind, _resolve(fields, buffers, used))
        if len(used) != len(buffers):
            raise MalformedFrame(f"{len(buffers) - len(used)} array frames not referenced by the body")
    except CodecError as exc:
        exc.meta = meta
        raise
    return obj, meta


def _resolve(v: Any, buffers: Sequence[bytes], used: set[int]) -> Any:
    if isinstance(v, msgpack.ExtType):
        if v.code == EXT_ARRAY:
            return _array(v.data, buffers, used)
        if v.code == EXT_EVENT:
            try:
                inner_kind, inner_fields = msgpack.unpackb(v.data, strict_map_key=False)
            except Exception:
                raise MalformedFrame("bad nested event") from None
            cls = lookup(inner_kind) if isinstance(inner_kind, str) else None
            return _build(cls, inner_kind, _resolve(inner_fields, buffers, used))
        raise MalformedFrame(f"unknown msgpack extension type {v.code}")
    if isinstance(v, list):
        return [_resolve(x, buffers, used) for x in v]
    if isinstance(v, dict):
        return {k: _resolve(x, buffers, used) for k, x in v.items()}
    return v


def _array(head: bytes, buffers: Sequence[bytes], used: set[int]) -> np.ndarray:
    try:
        index, dtype_str, shape = msgpack.unpackb(head)
    except Exception:
        raise MalformedFrame("bad array header") from None
    # Checked as a string before numpy parses it: np.dtype accepts None, sub-array and
    # deprecated spellings that have no business on the bus.
    if not (isinstance(dtype_str, str) and _DTYPE_RE.fullmatch(dtype_str)) or not isinstance(index, int):
        raise MalformedFrame(f"array dtype {str(dtype_str)[:32]!r} not allowed")
    try:
        dtype = np.dtype(dtype_str)
    except TypeError:  # e.g. 'i3'
        raise MalformedFrame(f"array dtype {dtype_str!r} not allowed") from None
    if not (0 <= index < len(buffers)) or index in used:
        raise MalformedFrame(f"array frame index {index} out of range or reused")
    if not isinstance(shape, list) or len(shape) > 32 or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise MalformedFrame("array shape must be a list of at most 32 non-negative ints")
    buf = buffers[index]
    if math.prod(shape) * dtype.itemsize != len(buf):  # exact Python ints: no overflow to lie with
        raise MalformedFrame(f"array frame {index}: {len(buf)} bytes do not match {dtype_str}{shape}")
    used.add(index)
    return np.frombuffer(buf, dtype=dtype).reshape(shape)


def _build(cls: type | None, kind: Any, fields: Any) -> Any:
    if cls is None:
        raise UnknownKind(f"unknown nested message kind {str(kind)[:64]!r}")
    if not isinstance(fields, dict):
        raise MalformedFrame(f"{kind}: fields must be a map")
    bad = field_errors(cls, fields)
    if bad:
        raise MalformedFrame(f"{kind}: wrong type for field(s) {', '.join(bad)}")
    try:
        return cls(**fields)
    except TypeError as exc:
        raise MalformedFrame(f"{kind}: {exc}") from None
