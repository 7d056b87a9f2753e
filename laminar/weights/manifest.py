"""Manifest arithmetic: the flat-buffer layout of a state dict, chunk ranges and checksums.

Layout: tensors are laid out in state-dict order, each at an offset aligned to ALIGN bytes so a
zero-copy view of any dtype is aligned. The buffer is cut into fixed-size chunks (the unit of
transfer, verification and resume); the last chunk may be short. A chunk's checksum is xxh3-64
(≈ 25 GB/s here, far above any link), computed once by the publisher and verified by every relay.

A version is named by its run, its lineage epoch and its number (`ident`); `supersedes` is the
one ordering relays and rollouts apply (docs/weights.md).

The layout depends only on names, dtypes and shapes, so it is computed from metadata and a
publisher reuses it (and its staging buffers) for every version of the same model.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import msgpack
import xxhash

from laminar.protocol import Manifest

ALIGN = 64
CHUNK_BYTES_DEFAULT = 16 << 20

# torch dtype name -> bytes per element (kept here so relays and tests need no torch)
DTYPE_SIZES = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "int16": 2,
    "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def build_manifest(specs: Iterable[tuple[str, str, Sequence[int]]], version: int,
                   chunk_bytes: int = CHUNK_BYTES_DEFAULT) -> Manifest:
    """A manifest (without checksums) for tensors given as (name, dtype name, shape)."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    names, dtypes, shapes, offsets, nbytes = [], [], [], [], []
    off = 0
    for name, dtype, shape in specs:
        if dtype not in DTYPE_SIZES:
            raise ValueError(f"tensor {name!r}: dtype {dtype!r} is not supported; known: {sorted(DTYPE_SIZES)}")
        n = DTYPE_SIZES[dtype]
        for d in shape:
            n *= int(d)
        off = _align(off)
        names.append(name); dtypes.append(dtype); shapes.append([int(d) for d in shape])
        offsets.append(off); nbytes.append(n)
        off += n
    if len(set(names)) != len(names):
        raise ValueError("duplicate tensor names in state dict")
    return Manifest(version=version, total_bytes=max(off, 1), chunk_bytes=chunk_bytes, names=names,
                    dtypes=dtypes, shapes=shapes, offsets=offsets, nbytes=nbytes)


def with_version(m: Manifest, version: int, checksums: list[int] | None = None) -> Manifest:
    return dataclasses.replace(m, version=version, checksums=list(checksums or []))


def with_lineage(m: Manifest, run_id: str, lineage: int) -> Manifest:
    return dataclasses.replace(m, run_id=run_id, lineage=int(lineage))


def ident(m: Manifest) -> tuple[str, int, int]:
    """What names a version: (run, lineage epoch, number). Equal idents are the same bytes."""
    return m.run_id, m.lineage, m.version


def same_lineage(a: Manifest, b: Manifest) -> bool:
    return (a.run_id, a.lineage) == (b.run_id, b.lineage)


def supersedes(new: Manifest, held: Manifest) -> bool:
    """Whether `new` replaces `held`: a newer lineage of the same run replaces whatever version
    number `held` has (a trainer resumed from an older checkpoint); another run's lineage is
    taken at once (a relay never serves two runs); within one lineage, a higher number wins."""
    if new.run_id != held.run_id:
        return True
    if new.lineage != held.lineage:
        return new.lineage > held.lineage
    return new.version > held.version


def same_layout(a: Manifest, b: Manifest) -> bool:
    return (a.total_bytes, a.chunk_bytes, a.names, a.dtypes, a.shapes, a.offsets) == \
           (b.total_bytes, b.chunk_bytes, b.names, b.dtypes, b.shapes, b.offsets)


def chunk_count(m: Manifest) -> int:
    return (m.total_bytes + m.chunk_bytes - 1) // m.chunk_bytes


def chunk_range(m: Manifest, i: int) -> tuple[int, int]:
    """(start, length) of chunk i."""
    n = chunk_count(m)
    if not 0 <= i < n:
        raise IndexError(f"chunk {i} out of range 0..{n - 1}")
    start = i * m.chunk_bytes
    return start, min(m.chunk_bytes, m.total_bytes - start)


def checksum(buf) -> int:
    return xxhash.xxh3_64_intdigest(buf)


def verify(m: Manifest, buf) -> list[int]:
    """Indices of chunks of `buf` whose checksum does not match the manifest (empty = intact)."""
    if len(m.checksums) != chunk_count(m):
        raise ValueError(f"manifest v{m.version} has {len(m.checksums)} checksums for {chunk_count(m)} chunks")
    view = memoryview(buf)
    bad = []
    for i, want in enumerate(m.checksums):
        s, n = chunk_range(m, i)
        if checksum(view[s:s + n]) != want:
            bad.append(i)
    return bad


def validate(m: Manifest) -> None:
    """Raise ValueError if a manifest from a peer is inconsistent (bounds, counts, overlaps)."""
    k = len(m.names)
    if not (len(m.dtypes) == len(m.shapes) == len(m.offsets) == len(m.nbytes) == k):
        raise ValueError("manifest field lengths differ")
    if m.chunk_bytes <= 0 or m.total_bytes <= 0 or m.version < 0 or m.lineage < 0:
        raise ValueError("manifest sizes/version/lineage must be positive")
    if m.checksums and len(m.checksums) != chunk_count(m):
        raise ValueError("manifest checksum count does not match its chunk count")
    end = 0
    for name, dtype, shape, off, n in zip(m.names, m.dtypes, m.shapes, m.offsets, m.nbytes):
        size = DTYPE_SIZES.get(dtype)
        if size is None:
            raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}")
        for d in shape:
            size *= d
        if size != n or off < end or off % ALIGN or off + n > m.total_bytes:
            raise ValueError(f"tensor {name!r}: bad extent (offset {off}, {n} bytes)")
        end = off + n


def manifest_to_bytes(m: Manifest) -> bytes:
    """One blob (the bus codec's frames, msgpack-framed) for the chunk wire and the shm file."""
    from laminar.bus.codec import encode
    return msgpack.packb([bytes(f) for f in encode(m)])


def manifest_from_bytes(data: bytes) -> Manifest:
    """Decode and validate; raises ValueError on anything that is not a sound manifest."""
    from laminar.bus.codec import decode
    from laminar.bus.errors import CodecError
    try:
        frames = msgpack.unpackb(data)
        m, _ = decode(frames)
    except (CodecError, ValueError, TypeError, msgpack.ExtraData) as exc:
        raise ValueError(f"bad manifest: {exc}") from None
    except Exception as exc:  # msgpack raises a zoo of types on garbage
        raise ValueError(f"bad manifest: {type(exc).__name__}: {exc}") from None
    if not isinstance(m, Manifest):
        raise ValueError(f"expected a manifest, got {type(m).kind!r}")
    validate(m)
    return m
