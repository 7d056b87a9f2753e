"""Kinds of the weight relay tier (docs/architecture.md §6; docs/weights.md): the manifest, chain
management and relay reports.

Data plane vs control plane: weight bytes never travel on the bus. They go over the chunk
transport (laminar/weights/transport) as raw frames; only the `Manifest` crosses that wire as an
event (encoded with the bus codec), and it is also what a relay writes next to a version in
shared memory. Everything else here is control traffic on the bus:

  request/reply (must arrive)                        pub/sub (superseded by the next one)
  RelayJoin      relay   -> manager  ChainAssignment  WeightsVersion  `weights.version`
  SetDownstream  manager -> relay    Ack              RelayProgress   `relay.progress.<id>`
  LinkDown       relay/publisher -> manager  MasterInfo   ChainState  `weights.chain`
  MasterQuery    publisher -> manager  MasterInfo
"""
from __future__ import annotations

from dataclasses import field

from laminar.protocol.registry import event

__all__ = [
    "Manifest", "RelayJoin", "ChainAssignment", "SetDownstream", "LinkDown", "MasterQuery",
    "MasterInfo", "WeightsVersion", "RelayProgress", "ChainState",
]


@event("weights.manifest")
class Manifest:
    """One weight version: the layout of its flat buffer and a checksum per chunk. A version is
    named by (run_id, lineage, version): a new lineage replaces an older one whatever the numbers.

    Tensor i occupies bytes [offsets[i], offsets[i] + nbytes[i]) of the flat buffer, with dtype
    `dtypes[i]` (torch dtype name without the `torch.` prefix) and shape `shapes[i]`. Chunk j is
    bytes [j * chunk_bytes, min(total_bytes, (j + 1) * chunk_bytes)); `checksums[j]` is its
    xxh3-64 digest (empty while a version is still being produced chunk by chunk). `macs` is
    no longer written (chunk protocol 2 kept keyed chunk MACs there). `seals` are what make the
    version the trainer's: signed lists of the buffer's pieces and their digests
    (laminar/weights/seal.py), written by a relay with the version once they verified; empty
    in an OFFER.

    `content` says what the tensors are: "full" (every weight of the model) or "lora" (a peft LoRA
    adapter, in peft's file naming, for the base whose identity is `base_id`,
    laminar/models/loading.py `base_identity`; `adapter_config` is its adapter_config.json text).
    """
    version: int
    total_bytes: int
    chunk_bytes: int
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    offsets: list[int]
    nbytes: list[int]
    checksums: list[int] = field(default_factory=list)
    lineage: int = 0       # the trainer's lineage epoch (advanced by every trainer start or resume)
    run_id: str = ""       # the run the lineage belongs to (docs/weights.md)
    macs: list[bytes] = field(default_factory=list)
    seals: list[bytes] = field(default_factory=list)
    content: str = "full"  # "full" weights or a "lora" adapter (docs/lora.md)
    adapter_config: str = ""   # kind lora: peft's adapter_config.json, as JSON text
    base_id: str = ""      # kind lora: the identity of the base weights the adapter applies to


@event("relay.join")
class RelayJoin:
    """A relay announces itself to the manager; it is appended to the chain's tail."""
    relay_id: str
    host: str
    data_address: str      # host:port of its chunk listener
    control_address: str   # its request/reply server (SetDownstream)
    version: int = -1      # newest complete version it already holds (after a restart)
    link_key: bytes = b""  # a fresh key per join: the manager proves to this relay which upstream it named


@event("relay.assignment")
class ChainAssignment:
    epoch: int
    upstream_id: str       # "" for the master (the trainer's publisher feeds it)
    is_master: bool


@event("relay.set_downstream")
class SetDownstream:
    """Manager -> relay: forward to this relay from now on (address "" = you are the tail). `token`
    proves to the downstream that the manager named this relay its upstream at `epoch`
    (laminar/weights/handshake.py `link_token`, under the downstream's link key)."""
    epoch: int
    downstream_id: str
    address: str
    token: bytes = b""


@event("relay.link_down")
class LinkDown:
    """A sender lost its downstream (`peer`); the manager checks it and repairs the chain."""
    reporter: str          # relay id, or "publisher"
    peer: str
    epoch: int
    detail: str = ""


@event("relay.master_query")
class MasterQuery:
    pass


@event("relay.master")
class MasterInfo:
    """Where the trainer's publisher sends (address "" = no relay alive yet)."""
    epoch: int
    relay_id: str
    address: str


@event("weights.version")
class WeightsVersion:
    """Published on `weights.version` whenever a relay makes a version visible."""
    relay_id: str
    host: str
    version: int
    total_bytes: int
    shm_dir: str
    lineage: int = 0
    run_id: str = ""


@event("relay.progress")
class RelayProgress:
    """Published on `relay.progress.<id>` as chunks arrive (rate-limited) and on completion."""
    relay_id: str
    version: int           # version being received (or the newest complete one when idle)
    chunks_have: int
    chunks_total: int
    complete_version: int
    corrupt_chunks: int
    upstream: str
    downstream: str


@event("weights.chain")
class ChainState:
    """The manager's chain, republished on every change (and periodically)."""
    epoch: int
    order: list[str]
    master_id: str
    master_address: str
    last_repair_s: float = 0.0
