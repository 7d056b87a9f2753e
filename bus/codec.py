"""msgpack codec: event <-> list of frames.

Frame layout: [kind, body, *buffers]
  kind     ASCII kind tag, its own frame so a receiver can route (or drop) before decoding;
  body     msgpack [protocol_version, meta, fields]; meta carries envelope data (request id,
           deadline budget, sender) and fields the dataclass fields;
  buffers  raw bytes of every numpy array in the fields, in order. In the body an array is an
           ExtType(1, [index, dtype, shape]); a nested event is ExtType(2, [kind, fields]).

Decoding never trusts the peer: sizes, dtypes, shapes, kinds and field types are checked and any
violation raises a CodecError subclass that the receiver counts and drops.

Cost of a refusal. A msgpack body can name far more Python objects than it has bytes (0x80, one
byte, is an empty map: a 64-byte dict), so the body's size alone does not bound what decoding it
allocates. The decoder therefore bounds, *while unpacking*: the frame count (checked first, before
the body is read), the length of every array, map, string and extension (msgpack refuses a header
above its limit before allocating), the number of arrays and maps in one message, nested events
included (counted as msgpack builds them, so unpacking stops at the budget), and the nesting depth.
A hostile body therefore costs at most about MAX_CONTAINERS empty dicts plus one maximal list
(~9 MiB) and a few milliseconds, whatever its size; legitimate messages (a 4,096-trajectory
batch uses ~20k containers) stay far inside the budget. Trusted internal paths (the trainer's
own ranks) pass larger limits explicitly.

Cost of an accepted message (the hot path: every delta batch, event and reply). A body of this
protocol version is unpacked in one pass: msgpack calls back into Python only for arrays and
nested events (`ext_hook`) and to count containers, never per element, so a batch naming a
thousand trajectories costs what msgpack's C loop costs. Anything else (another version, an
envelope that is not [version, meta, fields], any error) is decoded again the careful way
(`_decode_checked`): the envelope first, so a refusal names the request id and the peer's version.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
from laminar.bus.errors import CodecError, MalformedFrame, OversizedFrame, ProtocolMismatch, UnknownKind

from laminar.protocol import PROTOCOL_VERSION, lookup
from laminar.protocol.registry import field_errors

EXT_ARRAY = 1
EXT_EVENT = 2
MAX_BODY_BYTES = 16 << 20
MAX_FRAMES = 1 << 16
MAX_CONTAINERS = 1 << 17  # arrays + maps in one message (nested events included); also each one's length
MAX_DEPTH = 32            # nesting of arrays, maps and events (a real message nests < 10 deep)
_SAFE_DTYPE_KINDS = set("biuf")
_DTYPE_RE = re.compile(r"[<>|=]?[biuf][1-9][0-9]?")


PACK_BUF_BYTES = 4096     # a packer's first buffer; it grows (doubling) for a larger body


def packb(o: Any, default=None) -> bytes:
    """msgpack bytes of `o` from a packer whose first buffer is small. msgpack's own `packb` starts
    each packer with 256 KiB: allocated and freed once per call, nested packs (an array's head, a
    nested event) inside an outer one, that pathologically cost the allocator (fresh pages each
    time) tens of µs per message, more than the packing itself."""
    return msgpack.Packer(default=default, buf_size=PACK_BUF_BYTES).pack(o)


_NAMES: dict[type, tuple[str, ...]] = {}  # each event class's field names (dataclasses.fields is slow)
_NAME_SETS: dict[type, frozenset[str]] = {}  # the same as sets (decoding: a message naming exactly these)


def _fields(obj: Any) -> dict[str, Any]:
    names = _NAMES.get(type(obj))
    if names is None:
        names = _NAMES[type(obj)] = tuple(f.name for f in dataclasses.fields(obj))
    return {n: getattr(obj, n) for n in names}


def encode(obj: Any, meta: dict[str, Any] | None = None, version: int = PROTOCOL_VERSION) -> list:
    """Encode one event into frames (bytes / memoryviews, ready for send_multipart)."""
    buffers: list = []

    def default(v: Any) -> Any:
        if isinstance(v, np.ndarray):
            if v.dtype.kind not in _SAFE_DTYPE_KINDS:
                raise TypeError(f"array dtype {v.dtype} cannot travel on the bus")
            a = v if v.flags.c_contiguous else np.ascontiguousarray(v)  # (which makes 0-d arrays 1-d)
            buffers.append(memoryview(a.reshape(-1)).cast("B") if a.size else b"")
            head = packb([len(buffers) - 1, a.dtype.str, list(a.shape)])
            return msgpack.ExtType(EXT_ARRAY, head)
        if dataclasses.is_dataclass(v) and hasattr(type(v), "kind"):
            return msgpack.ExtType(EXT_EVENT, packb([type(v).kind, _fields(v)], default))
        if isinstance(v, (np.integer, np.floating, np.bool_)):
            return v.item()
        raise TypeError(f"cannot encode {type(v).__name__} on the bus")

    kind = type(obj).kind
    body = packb([version, meta or {}, _fields(obj)], default)
    return [kind.encode("ascii"), body, *buffers]


def unpack_limits(max_body: int = MAX_BODY_BYTES, max_containers: int = MAX_CONTAINERS) -> dict[str, int]:
    """msgpack's own per-object limits: a header above them is refused before anything is allocated."""
    return dict(max_array_len=max_containers, max_map_len=max_containers, max_str_len=max_body,
                max_bin_len=max_body, max_ext_len=max_body)


UNPACK_LIMITS = unpack_limits()
_ARRAY_HEAD_LIMITS = dict(max_array_len=64, max_map_len=0, max_str_len=64, max_bin_len=0, max_ext_len=0)


class _Budget:
    """Counts arrays and maps as msgpack builds them (its list/object hooks) across every unpack
    of one message; raising from a hook stops the unpack at once."""
    __slots__ = ("left", "limit", "kwargs")

    def __init__(self, max_body: int, max_containers: int):
        self.left = self.limit = max_containers
        limits = UNPACK_LIMITS if (max_body, max_containers) == (MAX_BODY_BYTES, MAX_CONTAINERS) else \
            unpack_limits(max_body, max_containers)
        self.kwargs = dict(limits, strict_map_key=False, list_hook=self._count, object_hook=self._count)

    def _count(self, v: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            raise OversizedFrame(f"message holds more than {self.limit} containers (arrays and maps)")
        return v

    def unpack(self, data: bytes) -> Any:
        return msgpack.unpackb(data, **self.kwargs)


class _Uncounted:
    """msgpack's limits without the container count (a body too small to exceed it)."""
    kwargs = dict(UNPACK_LIMITS, strict_map_key=False)


def decode(frames: Sequence[bytes], max_body: int = MAX_BODY_BYTES, max_frames: int = MAX_FRAMES,
           max_containers: int = MAX_CONTAINERS) -> tuple[Any, dict[str, Any]]:
    """Decode frames into (event, meta). Raises a CodecError subclass on any bad input."""
    try:
        cls, kind, body, buffers = _frames(frames, max_body, max_frames)
        if body[:2] == _ENVELOPE:  # [version, ...] of this protocol version: one pass (module docstring)
            try:
                return _decode_fast(cls, kind, body, buffers, max_body, max_containers)
            except Exception:  # noqa: BLE001 -- decoded again below, for the error that names the request
                pass
        return _decode_checked(cls, kind, body, buffers, max_body, max_containers)
    except CodecError:
        raise
    except Exception as exc:  # a check this codec missed must still never reach a receive loop raw
        raise MalformedFrame(f"undecodable frames: {type(exc).__name__}: {str(exc)[:200]}") from None


_KINDS: dict[bytes, tuple[type, str]] = {}  # kind frame -> (class, kind) of the kinds seen
_ENVELOPE = bytes([0x93, PROTOCOL_VERSION])  # msgpack: an array of 3 whose first item is the version


def _frames(frames: Sequence[bytes], max_body: int, max_frames: int) -> tuple[type, str, Any, Sequence[bytes]]:
    """The message's class, kind, body and array frames, after the checks that need no unpacking."""
    if len(frames) < 2:
        raise MalformedFrame(f"expected at least 2 frames (kind, body), got {len(frames)}")
    if len(frames) > max_frames:
        raise OversizedFrame(f"{len(frames)} frames exceeds the limit of {max_frames}")
    kind_raw, body = bytes(frames[0]), frames[1]
    if len(body) > max_body:
        raise OversizedFrame(f"body of {len(body)} bytes exceeds the limit of {max_body}")
    known = _KINDS.get(kind_raw)
    if known is not None:
        return known[0], known[1], body, frames[2:]
    try:
        kind = kind_raw.decode("ascii")
    except UnicodeDecodeError:
        raise MalformedFrame("kind frame is not ASCII") from None
    cls = lookup(kind)
    if cls is None:
        raise UnknownKind(f"unknown message kind {kind[:64]!r}")
    _KINDS[kind_raw] = (cls, kind)  # registered kinds only: a bounded map
    return cls, kind, body, frames[2:]


def _decode_fast(cls: type, kind: str, body, buffers: Sequence[bytes], max_body: int,
                 max_containers: int) -> tuple[Any, dict[str, Any]]:
    """One unpack, arrays and nested events resolved by msgpack's ext_hook as it meets them; raises
    on anything unusual (the caller then decodes the careful way)."""
    used: set[int] = set()
    # a body of fewer bytes than the budget cannot name more containers (one byte each at least,
    # nested events included: they are bytes of the body), so only a larger one is counted
    budget = _Budget(max_body, max_containers) if len(body) >= max_containers else _Uncounted
    depth = [0]

    def ext(code: int, data: bytes) -> Any:
        if code == EXT_ARRAY:
            return _array(data, buffers, used)
        if code != EXT_EVENT or depth[0] >= MAX_DEPTH // 2:
            raise MalformedFrame("not for the fast path")
        depth[0] += 1
        inner_kind, inner_fields = msgpack.unpackb(data, ext_hook=ext, **budget.kwargs)
        depth[0] -= 1
        _shallow(inner_fields, 2)
        return _build(lookup(inner_kind) if isinstance(inner_kind, str) else None, inner_kind, inner_fields)
    version, meta, fields = msgpack.unpackb(body, ext_hook=ext, **budget.kwargs)
    if type(version) is not int or version != PROTOCOL_VERSION or not isinstance(meta, dict):
        raise MalformedFrame("not for the fast path")
    _shallow(fields, 2)
    obj = _build(cls, kind, fields)
    if len(used) != len(buffers):
        raise MalformedFrame("not for the fast path")
    return obj, meta


_CONTAINERS = (list, dict)


def _shallow(v: Any, depth: int) -> None:
    """Raise unless lists and maps in `v` nest at most MAX_DEPTH deep (counting from `depth`).
    Looks inside a container only when it holds containers: one C-level pass over its items' types."""
    if depth > MAX_DEPTH:
        raise MalformedFrame(f"message nests deeper than {MAX_DEPTH} levels")
    items = v.values() if type(v) is dict else v
    kinds = set(map(type, items))
    if list in kinds or dict in kinds:
        for x in items:
            if type(x) in _CONTAINERS:
                _shallow(x, depth + 1)


def _decode_checked(cls: type, kind: str, body, buffers: Sequence[bytes], max_body: int,
                    max_containers: int) -> tuple[Any, dict[str, Any]]:
    budget = _Budget(max_body, max_containers)
    # Two phases: unpack with extensions left opaque, read the envelope (so errors can still
    # name the request id), then resolve arrays and nested events with every check applied.
    try:
        top = budget.unpack(body)
    except CodecError:
        raise
    except ValueError as exc:
        if "exceeds max_" in str(exc):  # a length header above unpack_limits(), refused unallocated
            raise OversizedFrame(f"body refused: {exc}") from None
        raise MalformedFrame(f"body is not valid msgpack: {type(exc).__name__}: {exc}") from None
    except Exception as exc:  # msgpack raises a zoo of types on garbage
        raise MalformedFrame(f"body is not valid msgpack: {type(exc).__name__}: {exc}") from None
    if not (isinstance(top, list) and len(top) == 3):
        raise MalformedFrame("body must be a 3-element array [version, meta, fields]")
    version, meta, fields = top
    if not isinstance(meta, dict):
        raise MalformedFrame("meta must be a map")
    try:
        if type(version) is not int or version != PROTOCOL_VERSION:  # True == 1.0 == 1 in Python
            raise ProtocolMismatch(version, PROTOCOL_VERSION)
        used: set[int] = set()
        obj = _build(cls, kind, _resolve(fields, buffers, used, budget, 2))
        if len(used) != len(buffers):
            raise MalformedFrame(f"{len(buffers) - len(used)} array frames not referenced by the body")
    except CodecError as exc:
        exc.meta = meta
        raise
    return obj, meta


def _resolve(v: Any, buffers: Sequence[bytes], used: set[int], budget: _Budget, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise MalformedFrame(f"message nests deeper than {MAX_DEPTH} levels")
    if isinstance(v, msgpack.ExtType):
        if v.code == EXT_ARRAY:
            return _array(v.data, buffers, used)
        if v.code == EXT_EVENT:
            try:
                inner_kind, inner_fields = budget.unpack(v.data)
            except CodecError:
                raise
            except Exception:
                raise MalformedFrame("bad nested event") from None
            cls = lookup(inner_kind) if isinstance(inner_kind, str) else None
            return _build(cls, inner_kind, _resolve(inner_fields, buffers, used, budget, depth + 2))
        raise MalformedFrame(f"unknown msgpack extension type {v.code}")
    if isinstance(v, list):
        return [_resolve(x, buffers, used, budget, depth + 1) for x in v]
    if isinstance(v, dict):
        return {k: _resolve(x, buffers, used, budget, depth + 1) for k, x in v.items()}
    return v


_DTYPES: dict[str, np.dtype] = {}  # dtype strings already checked and parsed (at most a few dozen)


def _dtype(dtype_str: Any) -> np.dtype:
    # Checked as a string before numpy parses it: np.dtype accepts None, sub-array and
    # deprecated spellings that have no business on the bus.
    if not (isinstance(dtype_str, str) and _DTYPE_RE.fullmatch(dtype_str)):
        raise MalformedFrame(f"array dtype {str(dtype_str)[:32]!r} not allowed")
    try:
        dtype = np.dtype(dtype_str)
    except TypeError:  # e.g. 'i3'
        raise MalformedFrame(f"array dtype {dtype_str!r} not allowed") from None
    if len(_DTYPES) < 256:
        _DTYPES[dtype_str] = dtype
    return dtype


def _array(head: bytes, buffers: Sequence[bytes], used: set[int]) -> np.ndarray:
    try:
        index, dtype_str, shape = msgpack.unpackb(head, **_ARRAY_HEAD_LIMITS)
    except Exception:
        raise MalformedFrame("bad array header") from None
    dtype = _DTYPES.get(dtype_str) if type(dtype_str) is str else None  # one seen (and checked) before
    if dtype is None:
        dtype = _dtype(dtype_str)
    if not isinstance(index, int):
        raise MalformedFrame(f"array dtype {str(dtype_str)[:32]!r} not allowed")
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
    names = _NAME_SETS.get(cls)
    if names is None:
        names = _NAME_SETS[cls] = frozenset(f.name for f in dataclasses.fields(cls))
    if fields.keys() == names:
        # every field, and only those (what `encode` writes): set as __init__ would, without its
        # frozen-dataclass setattr per field (the protocol's classes have no __post_init__)
        obj = object.__new__(cls)
        obj.__dict__.update(fields)
        return obj
    try:
        return cls(**fields)
    except TypeError as exc:
        raise MalformedFrame(f"{kind}: {exc}") from None
