"""Manifest arithmetic: layout and alignment, chunk ranges, validation, wire round trip, checksums."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from laminar.weights.manifest import (
    ALIGN,
    build_manifest,
    checksum,
    chunk_count,
    chunk_range,
    manifest_from_bytes,
    manifest_to_bytes,
    same_layout,
    validate,
    verify,
    with_version,
)

SPECS = [("a", "float32", (3, 5)), ("b", "bfloat16", (7,)), ("c", "int64", ()), ("d", "uint8", (0, 4))]


def test_layout_is_aligned_ordered_and_sized():
    m = build_manifest(SPECS, version=3, chunk_bytes=64)
    assert m.names == ["a", "b", "c", "d"] and m.version == 3
    assert m.nbytes == [60, 14, 8, 0]
    assert all(off % ALIGN == 0 for off in m.offsets)
    assert m.offsets == [0, 64, 128, 192]
    assert m.total_bytes == 192
    validate(m)


@given(st.integers(1, 10_000), st.integers(1, 5000))
def test_chunks_tile_the_buffer_exactly(total_elems, chunk_bytes):
    m = build_manifest([("x", "uint8", (total_elems,))], 0, chunk_bytes)
    covered = 0
    for i in range(chunk_count(m)):
        s, n = chunk_range(m, i)
        assert s == covered and 0 < n <= chunk_bytes
        covered += n
    assert covered == m.total_bytes
    with pytest.raises(IndexError):
        chunk_range(m, chunk_count(m))


def test_roundtrip_through_bytes_keeps_every_field():
    m = with_version(build_manifest(SPECS, 0, 100), 9, [1, 2**64 - 1])
    assert chunk_count(m) == 2
    back = manifest_from_bytes(manifest_to_bytes(m))
    assert back == m and same_layout(back, m)


@pytest.mark.parametrize("change", [
    dict(offsets=[1, 64, 128, 192]),          # misaligned
    dict(nbytes=[61, 14, 8, 0]),              # size does not match dtype x shape
    dict(dtypes=["complex64", "bfloat16", "int64", "uint8"]),
    dict(total_bytes=100),                    # tensor beyond the buffer
    dict(checksums=[1, 2, 3, 4, 5, 6, 7]),     # wrong checksum count
    dict(names=["a", "b"]),                   # ragged fields
])
def test_validate_rejects_inconsistent_manifests(change):
    m = dataclasses.replace(build_manifest(SPECS, 0, 64), **change)
    with pytest.raises(ValueError):
        validate(m)
    with pytest.raises(ValueError):
        manifest_from_bytes(manifest_to_bytes(m))


def test_garbage_is_not_a_manifest():
    for junk in (
        b"",
        b"\x93\x01\x02",
        b"not msgpack at all \xff\xfe",
        manifest_to_bytes(build_manifest(SPECS, 0))[:-3],
    ):
        with pytest.raises(ValueError):
            manifest_from_bytes(junk)


def test_unsupported_dtype_and_duplicates_are_refused():
    with pytest.raises(ValueError, match="not supported"):
        build_manifest([("x", "complex64", (2,))], 0)
    with pytest.raises(ValueError, match="duplicate"):
        build_manifest([("x", "float32", (2,)), ("x", "float32", (2,))], 0)


def test_verify_finds_exactly_the_corrupted_chunk():
    m = build_manifest([("x", "uint8", (1000,))], 0, chunk_bytes=128)
    buf = bytearray(np.random.default_rng(0).integers(0, 256, m.total_bytes, dtype=np.uint8).tobytes())
    sums = [checksum(memoryview(buf)[s:s + n]) for s, n in map(lambda i: chunk_range(m, i), range(chunk_count(m)))]
    m = with_version(m, 0, sums)
    assert verify(m, buf) == []
    buf[5 * 128 + 17] ^= 1
    assert verify(m, buf) == [5]
