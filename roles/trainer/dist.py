"""Multi-rank trainer plumbing: torch.distributed setup, FSDP2 sharding, and rank 0's commands.

A trainer of `world_size` ranks is `world_size` trainer role processes (ids 0..W-1 by default),
each started by laminar-node from the cluster file; they meet at `dist_address` (rank 0's host).
NCCL carries the FSDP2 collectives on GPUs, gloo on CPUs. Only rank 0 talks to the bus: it
samples the experience buffer, publishes weights, writes metrics and checkpoints. The other
ranks follow a tiny command stream that rank 0 broadcasts over a separate gloo group:

    header  int64[4] = [op, version, cursor, payload bytes]       op: TRAIN | STOP
    payload the Samples event, encoded by the bus codec (no pickle), as one uint8 tensor

After a TRAIN every rank runs the same collectives in the same order: the mini-batch steps, the
full-state-dict gather for publishing, and (every checkpoint_every versions) the checkpoint
gather. A dead rank turns every other rank's next collective into an error, so the whole trainer
fails and is restarted together, and resumes from the newest complete checkpoint.

The rendezvous store (torch.distributed's TCPStore, on rank 0) has no authentication, so it
listens only on the address the ranks meet at (`dist_address`; by default rank 0's host
`address` from cluster.hosts, i.e. its cluster interface), never on every interface as PyTorch's
`tcp://` rendezvous does: rank 0 binds the socket itself and hands it to the store. The
collectives' own connections (gloo, NCCL) pick their interface by GLOO_SOCKET_IFNAME and
NCCL_SOCKET_IFNAME; set those to the same interface (docs/security.md).
"""
from __future__ import annotations

import socket
import struct
from dataclasses import dataclass
from datetime import timedelta

from laminar.bus.codec import decode, encode

from laminar.threads import exit_without_teardown

OP_TRAIN, OP_STOP = 1, 2


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    control: object = None  # the gloo group of the command stream

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def store_bind_host(address: str) -> str:
    """The numeric address rank 0's store listens on: the host part of `address`, resolved."""
    host, port = _split(address)
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0]


def rendezvous_store(rank: int, world_size: int, address: str, timeout_s: float):
    """The TCPStore the ranks meet at: rank 0 listens on `address` only (see the module docstring)."""
    import torch.distributed as dist  # late: torch; configs validate without it
    host, port = _split(address)
    timeout = timedelta(seconds=timeout_s)
    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, timeout=timeout)
    bind = store_bind_host(address)
    sock = socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((bind, port))
        sock.listen(max(128, world_size))
        store = dist.TCPStore(host, port, world_size, True, timeout=timeout, wait_for_workers=False,
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now
    return store


def init(rank: int, world_size: int, address: str, device, timeout_s: float) -> DistInfo:
    """Join the process group (blocks until every rank arrived) and make the control group."""
    import torch.distributed as dist  # late: torch; configs validate without it
    if world_size <= 1:
        return DistInfo()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        import torch  # late: torch; configs validate without it
        torch.cuda.set_device(device)
    store = rendezvous_store(rank, world_size, address, timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    exit_without_teardown("joined a torch.distributed process group")  # its native threads abort at teardown
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) if backend != "gloo" else None
    return DistInfo(rank, world_size, control)


def shutdown(info: DistInfo) -> None:
    """Leave the process group together: without the barrier a rank may tear gloo down while a
    peer (rank 0 hosts the rendezvous store) is still in its last collective or already gone,
    and gloo's threads then abort the process ("terminate called without an active exception").
    The barrier runs on the gloo control group (a CPU collective, also under NCCL)."""
    import torch.distributed as dist  # late: torch; configs validate without it
    if info.enabled and dist.is_initialized():
        try:
            dist.barrier(group=info.control)
        finally:
            dist.destroy_process_group()


def shard(model, info: DistInfo, device, param_dtype=None) -> None:
    """FSDP2: one shard unit per decoder layer, then the root (embeddings, norm, head). With
    `param_dtype` (bfloat16), FSDP2's mixed precision: the sharded parameters, their gradients and
    Adam's states stay float32 (master weights), each unit's all-gathered parameters are cast to
    `param_dtype` for compute, and gradients are reduced in float32."""
    if not info.enabled:
        return
    import torch  # late: torch; configs validate without it
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(device.type, (info.world_size,))
    kw = {}
    if param_dtype is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under peft's LoRA wrapper
    backbone = getattr(base, "model", base)
    for layer in getattr(backbone, "layers", []):
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)


# -- command stream -------------------------------------------------------------------------------
def _pack(frames) -> bytes:
    parts = [bytes(f) for f in frames]
    return struct.pack(f"<I{len(parts)}Q", len(parts), *map(len, parts)) + b"".join(parts)


def _unpack(blob: bytes) -> list[bytes]:
    (n,) = struct.unpack_from("<I", blob)
    lens = struct.unpack_from(f"<{n}Q", blob, 4)
    out, off = [], 4 + 8 * n
    for ln in lens:
        out.append(blob[off:off + ln])
        off += ln
    return out


def send_command(info: DistInfo, op: int, version: int = 0, cursor: int = 0, samples=None) -> None:
    """Rank 0: broadcast one command (and its batch) to the other ranks."""
    import torch  # late: torch; configs validate without it
    import torch.distributed as dist
    blob = _pack(encode(samples)) if samples is not None else b""
    dist.broadcast(torch.tensor([op, version, cursor, len(blob)], dtype=torch.int64), 0, group=info.control)
    if blob:
        dist.broadcast(torch.frombuffer(bytearray(blob), dtype=torch.uint8), 0, group=info.control)


def recv_command(info: DistInfo):
    """Other ranks: (op, version, cursor, Samples | None), blocking until rank 0 sends."""
    import torch  # late: torch; configs validate without it
    import torch.distributed as dist
    head = torch.zeros(4, dtype=torch.int64)
    dist.broadcast(head, 0, group=info.control)
    op, version, cursor, n = (int(x) for x in head)
    samples = None
    if n:
        buf = torch.empty(n, dtype=torch.uint8)
        dist.broadcast(buf, 0, group=info.control)
        # rank 0's own batch, not a peer's input: the bus's per-message limits do not apply
        samples, _ = decode(_unpack(buf.numpy().tobytes()), max_body=1 << 40, max_frames=1 << 30,
                            max_containers=1 << 30)
    return op, version, cursor, samples


def broadcast_ints(info: DistInfo, values: list[int]) -> list[int]:
    """Rank 0's values on every rank (e.g. the resumed version and cursor)."""
    import torch  # late: torch; configs validate without it
    import torch.distributed as dist
    if not info.enabled:
        return values
    t = torch.tensor(values, dtype=torch.int64)
    dist.broadcast(t, 0, group=info.control)
    return [int(x) for x in t]


def all_reduce_sums(info: DistInfo, values: dict[str, float]) -> dict[str, float]:
    """Sum each value over the ranks (keys must be the same on every rank)."""
    import torch  # late: torch; configs validate without it
    import torch.distributed as dist
    if not info.enabled:
        return values
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t, group=info.control)
    return dict(zip(keys, t.tolist(), strict=False))


def broadcast_bytes(info: DistInfo, blob: bytes | None) -> bytes:
    """Rank 0's `blob` on every rank (the others pass None): a path, a small JSON header."""
    import torch  # late: torch; configs validate without it
    import torch.distributed as dist
    if not info.enabled:
        return blob or b""
    head = torch.tensor([len(blob) if info.is_main and blob else 0], dtype=torch.int64)
    dist.broadcast(head, 0, group=info.control)
    n = int(head[0])
    if not n:
        return b""
    buf = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if info.is_main else torch.empty(n, dtype=torch.uint8)
    dist.broadcast(buf, 0, group=info.control)
    return buf.numpy().tobytes()


def all_gather_objects(info: DistInfo, obj) -> list:
    """Every rank's `obj` (small, picklable: the trainer's own ranks trust each other) on every rank."""
    import torch.distributed as dist  # late: torch; configs validate without it
    if not info.enabled:
        return [obj]
    out: list = [None] * info.world_size
    dist.all_gather_object(out, obj, group=info.control)
    return out
