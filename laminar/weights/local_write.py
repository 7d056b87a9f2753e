"""Write a state dict as a complete version into a relay's shared-memory store, in-process.

What a relay does when the last chunk of a version arrives, minus the network: used to seed a
host's store with initial weights (warm starts) and by tests that exercise the rollout's pull
without running a relay chain.
"""
from __future__ import annotations

from collections.abc import Mapping

from laminar.weights.manifest import CHUNK_BYTES_DEFAULT, build_manifest, checksum, chunk_count, chunk_range
from laminar.weights.store import ShmStore


def write_version(store: ShmStore, state_dict: Mapping, version: int,
                  chunk_bytes: int = CHUNK_BYTES_DEFAULT) -> None:
    import torch
    items = list(state_dict.items())
    m = build_manifest([(k, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for k, t in items], version,
                       chunk_bytes)
    with store.cond:
        vb = store.begin(m)
    flat = torch.frombuffer(vb.buf, dtype=torch.uint8)
    for (_, t), off, n in zip(items, m.offsets, m.nbytes, strict=True):
        flat[off:off + n].copy_(t.detach().contiguous().view(-1).view(torch.uint8))
    sums = [checksum(vb.view[slice(*chunk_range(m, i))]) for i in range(chunk_count(m))]
    with store.cond:
        vb.mark_all(sums)
        store.commit(vb)
