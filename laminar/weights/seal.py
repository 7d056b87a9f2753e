"""Seals: what makes a version the trainer's, whoever relayed it.

A seal is a list of *pieces* of a version's flat buffer, (offset, length, BLAKE3 digest of those
bytes), together with the version's manifest digest (wire.manifest_digest: run, lineage, number
and the whole layout), signed with Ed25519 by the trainer's signing key. Only trainer hosts hold
that key (`weights.key_secret`, bus/auth.py); every relay and rollout holds its public half
(`weights.key`). A version is the trainer's when its seals verify and their pieces cover every
tensor byte of it, each piece's bytes matching its digest; bytes no piece covers (alignment
padding between tensors) must be zero.

- A trainer publishing from one host seals its version once, at the end: one seal whose pieces
  are the chunks. The publisher computes each chunk's digest as it sends it, so sealing costs one
  signature; relays compute the same digests as the chunks arrive (they check them against the
  CHUNK header's), so checking costs one signature check and a comparison.
- A trainer whose ranks span hosts: each host seals its own byte ranges (the pieces of its part)
  and sends that seal at PART_END; the master relay checks the ranges' digests as they arrive,
  and the version's seals are every host's. A relay further down hashes the pieces once more at
  the end (they are not its chunks), a second pass over the bytes for multi-host versions only.

With no keys configured (auth off) seals are made and checked without signatures: the digests
still catch corruption, nothing catches a forger (there is no key to forge against).
"""
from __future__ import annotations

import hmac
import os

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from laminar.weights.manifest import chunk_range
from laminar.weights.wire import content_digest, manifest_digest

CONTEXT = b"laminar weights seal v1\0"
SIGNATURE_BYTES = 64


class SealError(ValueError):
    """A seal that is malformed, signed by another key, about another version, or whose pieces
    overlap, fall outside the version or leave tensor bytes uncovered."""


class Signer:
    """The trainer's signing key (the Ed25519 secret of `weights.key_secret`)."""

    def __init__(self, secret: bytes):
        self._key = Ed25519PrivateKey.from_private_bytes(bytes(secret))
        self.public = Verifier(self._key.public_key().public_bytes_raw())

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)


class Verifier:
    """The public half of the trainer's signing key (`weights.key`), held by every host."""

    def __init__(self, public: bytes):
        self.raw = bytes(public)
        self._key = Ed25519PublicKey.from_public_bytes(self.raw)

    def verify(self, signature: bytes, data: bytes) -> None:
        try:
            self._key.verify(bytes(signature), data)
        except (InvalidSignature, ValueError):
            raise SealError("signature does not verify with the trainer's public key (weights.key)") from None


def verify_signature(verifier: Verifier, signature: bytes, data: bytes) -> None:
    if len(signature) != SIGNATURE_BYTES:
        raise SealError("no signature")
    verifier.verify(signature, data)


def make_seal(signer: Signer | None, mdigest: bytes, pieces) -> bytes:
    """A seal over `pieces` [(offset, length, digest)] of the version whose digest is `mdigest`
    (unsigned without a signer: auth off)."""
    body = msgpack.packb([bytes(mdigest), [[int(o), int(n), bytes(d)] for o, n, d in pieces]])
    return msgpack.packb([body, signer.sign(CONTEXT + body) if signer is not None else b""])


def open_seal(blob: bytes, verifier: Verifier | None, mdigest: bytes) -> list[tuple[int, int, bytes]]:
    """The pieces of a seal, after checking its signature (with a verifier) and that it is about
    the version whose digest is `mdigest`."""
    try:
        body, sig = msgpack.unpackb(blob)
        md, raw = msgpack.unpackb(body)
        pieces = [(int(o), int(n), bytes(d)) for o, n, d in raw]
    except Exception as exc:  # msgpack raises a zoo of types on garbage
        raise SealError(f"malformed seal: {type(exc).__name__}") from None
    if verifier is not None:
        verify_signature(verifier, sig, CONTEXT + body)
    if not hmac.compare_digest(bytes(md), bytes(mdigest)):
        raise SealError("seal of another version (run, lineage, number or layout differ)")
    return pieces


def chunk_pieces(m, digests) -> list[tuple[int, int, bytes]]:
    """A whole version's pieces: its chunks, with their digests."""
    out = []
    for i, d in enumerate(digests):
        start, n = chunk_range(m, i)
        out.append((start, n, bytes(d)))
    return out


def seal_whole(vb, signer: Signer | None) -> list[bytes]:
    """The seals of a whole version held in a VersionBuffer (made once): one seal over every
    chunk's digest (those a sender computed as it sent them; any missing ones are computed here)."""
    if not vb.sealed:
        vb.digests = [d or content_digest(vb.chunk(i)) for i, d in enumerate(vb.digests)]
        vb.seals = [make_seal(signer, manifest_digest(vb.manifest), chunk_pieces(vb.manifest, vb.digests))]
        vb.sealed = True
    return vb.seals


def pieces_of(m, seals, verifier: Verifier | None, mdigest: bytes) -> list[tuple[int, int, bytes]]:
    """Every seal's pieces, sorted, checked to be disjoint, inside the version and each inside
    one chunk; raises SealError."""
    if not seals:
        raise SealError("the version carries no seal")
    pieces = sorted(p for blob in seals for p in open_seal(bytes(blob), verifier, mdigest))
    end = 0
    for off, n, _ in pieces:
        if n <= 0 or off < end or off + n > m.total_bytes or off // m.chunk_bytes != (off + n - 1) // m.chunk_bytes:
            raise SealError(f"piece [{off}, {off + n}) overlaps another, falls outside the version or spans chunks")
        end = off + n
    return pieces


def gaps(m, pieces) -> list[tuple[int, int]]:
    """The byte ranges [start, end) no piece covers."""
    out, end = [], 0
    for off, n, _ in pieces:
        if off > end:
            out.append((end, off))
        end = off + n
    if m.total_bytes > end:
        out.append((end, m.total_bytes))
    return out


def uncovered_tensor_bytes(m, holes) -> str:
    """The first tensor byte range inside `holes`, named ("" when the holes are padding only)."""
    for name, off, n in sorted(zip(m.names, m.offsets, m.nbytes, strict=True), key=lambda t: t[1]):
        for start, end in holes:
            if start < off + n and off < end and n:
                return f"tensor {name!r} bytes [{max(start, off)}, {min(end, off + n)})"
    return ""


def check(m, seals, buf, verifier: Verifier | None, mdigest: bytes, known: dict | None = None) -> list[int]:
    """Indices of the chunks of `buf` whose bytes the seals do not vouch for ([]: the version is
    the trainer's, every byte of it). `known` maps (offset, length) to a digest already computed
    from those very bytes (a relay's chunk digests, the master's range digests): such pieces are
    compared, not hashed again. Raises SealError when the seals themselves are bad (see
    pieces_of) or leave tensor bytes uncovered."""
    pieces = pieces_of(m, seals, verifier, mdigest)
    holes = gaps(m, pieces)
    named = uncovered_tensor_bytes(m, holes)
    if named:
        raise SealError(f"no seal covers {named}")
    view, bad = memoryview(buf), set()
    for off, n, digest in pieces:
        got = (known or {}).get((off, n))
        if got is None:
            got = content_digest(view[off:off + n])
        if not hmac.compare_digest(got, digest):
            bad.add(off // m.chunk_bytes)
    for start, end in holes:  # alignment padding: zeros, as every publisher writes it
        if bytes(view[start:end]).count(0) != end - start:
            bad.update(range(start // m.chunk_bytes, (end - 1) // m.chunk_bytes + 1))
    return sorted(bad)


VERIFY_KEY_ENV = "LAMINAR_WEIGHTS_VERIFY_KEY"  # the public key (hex) an engine's worker processes check seals with


def arm_engine_checks(keys) -> bool:
    """Make the engine worker processes this process starts check every version's seals before
    they load it (laminar/weights/pull.py reads the key from the environment): rollouts and the
    evaluator call it before their engine starts. False with auth off (nothing to check with)."""
    verifier = verifier_of(keys)
    if verifier is None:
        return False
    os.environ[VERIFY_KEY_ENV] = verifier.raw.hex()
    return True


def verifier_of(keys) -> Verifier | None:
    """The trainer's public key from a process's keys (bus/auth.py CurveKeys); None with auth off.
    A cluster with keys must have one: its relays and rollouts would otherwise check nothing."""
    if keys is None:
        return None
    if keys.weights_public is None:
        raise FileNotFoundError(f"the key folder ({keys.public_dir}) has no weights.key: weight versions could not "
                                "be checked. Run `laminar-node keygen DIR --weights` where the keys are made, copy "
                                "weights.key to every host and weights.key_secret to the trainer's hosts only")
    return Verifier(keys.weights_public)


def signer_of(keys) -> Signer | None:
    """The trainer's signing key from its keys (loaded for the trainer scope only); None with auth off."""
    if keys is None:
        return None
    if keys.weights_secret is None:
        raise FileNotFoundError(f"the key folder ({keys.public_dir}) has no weights.key_secret: this trainer cannot "
                                "sign weight versions, and relays refuse unsigned ones. Copy weights.key_secret "
                                "(0600) to the trainer's hosts (or make it: `laminar-node keygen DIR --weights`)")
    return Signer(keys.weights_secret)
