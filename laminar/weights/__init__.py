"""The weight data plane (docs/architecture.md §6; docs/weights.md, docs/shm.md): manifests, flat
buffers, shared-memory versions, the chunk protocol between relays, the trainer-side publisher and
the rollout-side local pull.

    trainer: WeightPublisher.publish(state_dict)   one copy into staging, sends in the background
       |  chunk transport (TCP default, UCX optional): every message MAC'd, every chunk digested,
       |  every version sealed with the trainer's signing key (wire.py, handshake.py, seal.py)
    master relay -> relay -> relay ...             roles/relay (chain order: roles/manager/chain)
       |  /dev/shm, newest complete version whose seals verified
    rollout: LocalWeights(dir).latest().tensors()  zero-copy (name, tensor) pairs

Nothing here imports torch at module import time; the publisher and the pull client import it
when they touch tensors, so relays stay torch-free.
"""
from laminar.weights.manifest import (
                                      ALIGN,
                                      CHUNK_BYTES_DEFAULT,
                                      build_manifest,
                                      checksum,
                                      chunk_count,
                                      chunk_range,
                                      manifest_from_bytes,
                                      manifest_to_bytes,
)

__all__ = ["ALIGN", "CHUNK_BYTES_DEFAULT", "build_manifest", "checksum", "chunk_count",
           "chunk_range", "manifest_from_bytes", "manifest_to_bytes"]
