"""Write a state dict as a complete version into a relay's shared-memory store, in-process.

What a relay does when the last chunk of a version arrives, minus the network: used to seed a
host's store with initial weights (warm starts), by the scale simulator's stand-in trainer, and
by tests that exercise the rollout's pull without running a relay chain. The version is sealed
like a published one (laminar/weights/seal.py): with `signer` (the trainer's signing key) a
rollout holding the public key loads it; without, only readers that check no signatures do.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from laminar.weights import seal, wire
from laminar.weights.manifest import CHUNK_BYTES_DEFAULT, build_manifest, checksum
from laminar.weights.store import ShmStore, VersionBuffer


def begin_local(store: ShmStore, m) -> VersionBuffer | None:
    """The buffer to write version m into, or None when the store holds it (or newer) already."""
    with store.cond:
        kind, vb = store.begin(m)
    return vb if kind == "take" else None


def commit_local(store: ShmStore, vb: VersionBuffer, signer: seal.Signer | None = None) -> None:
    """Checksum, seal and make visible a version whose bytes were written into `vb`."""
    sums = [checksum(vb.chunk(i)) for i in range(vb.n)]
    digests = [wire.content_digest(vb.chunk(i)) for i in range(vb.n)]
    sealed = seal.make_seal(signer, wire.manifest_digest(vb.manifest), seal.chunk_pieces(vb.manifest, digests))
    with store.cond:
        vb.mark_all(sums)
        vb.digests, vb.seals, vb.sealed = digests, [sealed], True
        store.commit(vb)


def write_version(store: ShmStore, state_dict: Mapping, version: int,
                  chunk_bytes: int = CHUNK_BYTES_DEFAULT, signer: seal.Signer | None = None,
                  fields: dict | None = None) -> None:
    """`fields`: what the manifest says beyond the tensors (a LoRA adapter's kind, adapter_config, base_id)."""
    import torch  # late: torch; configs validate without it
    items = list(state_dict.items())
    m = build_manifest([(k, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for k, t in items], version,
                       chunk_bytes)
    if fields:
        m = dataclasses.replace(m, **fields)
    vb = begin_local(store, m)
    if vb is None:
        return
    flat = torch.frombuffer(vb.buf, dtype=torch.uint8)
    for (_, t), off, n in zip(items, m.offsets, m.nbytes, strict=True):
        flat[off:off + n].copy_(t.detach().contiguous().view(-1).view(torch.uint8))
    commit_local(store, vb, signer)
