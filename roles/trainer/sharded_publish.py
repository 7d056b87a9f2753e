"""Sharded publish: every rank of an FSDP2 trainer copies its own shards into one staging slot.

    sp = ShardedPublish(info, publisher)          # publisher: rank 0's WeightPublisher; None elsewhere
    sp.publish(engine.publish_state(), version)   # every rank, together (a collective)

Under FSDP2 a parameter is a DTensor sharded on dim 0: rank r holds rows [o_r, o_r + n_r), and
those rows are one contiguous byte range of the tensor in the published layout, at
`offset + o_r * row_bytes`. So the ranks write their shards side by side into the staging the
master relay is fed from, and nothing is gathered: the trainer's stall is one (pinned, on a GPU)
copy of 1/N of the weights, cast to the serving dtype on each rank's own device first. The
version is byte-for-byte what a publish of the gathered state dict gives (same layout, same
bytes; tests/integration/trainer/test_sharded_publish.py).

Modes, decided collectively at the first publish:
- `shared` (every rank on rank 0's host): rank 0's publisher keeps its two staging slots as
  /dev/shm files (`staging_prefix`); every rank maps both once per layout (and page-locks its
  mapping for CUDA once), and rank 0 unlinks the names as soon as all have mapped them, so a
  killed trainer leaves nothing behind.
- `hosts` (ranks on several hosts): the ranks of each host write their rows into that host's
  staging, owned by the host's lowest rank (its *leader*: rank 0's publisher on rank 0's host, a
  part publisher of its own, made by `make_publisher`, on every other host). Each leader commits
  the byte ranges its host's ranks wrote, and its publisher, a part upstream, sends just those to
  the master relay, which assembles one version from every host's part and verifies it
  (laminar/weights/part_receiver.py). Nothing is gathered and nothing crosses hosts but the
  ranges.
Which rank is on which host is decided by probe files: every rank writes one in /dev/shm, and a
rank's leader is the lowest rank whose probe it can read (`shared` when that is rank 0 for all;
`one_rank_per_host` makes every rank a host of its own: tests and benchmarks on one machine).

One publish:
  1. rank 0: `begin()` picks a free slot; it broadcasts {slot files, slot, dtype, chunk bytes,
     total bytes, the master relay, run and lineage} (or the error that stopped it, so that every
     rank raises); in `hosts` mode every other leader then begins a slot of its own publisher,
     and the leaders' answers are all-gathered;
  2. every rank: the same layout from the global shapes (checked against rank 0's size), then
     its copy jobs, copied and waited for (staging.py);
  3. an all-reduce of (failed, non-finite) over the ranks: everyone learns whether the version
     is whole and finite; weights with a NaN or inf are refused on every rank
     (NonFiniteWeightsError), as full_state() refuses them;
  4. rank 0 (`shared`) or every leader (`hosts`, with its host's byte ranges, all-gathered
     before step 3): `commit()` hands the version to the sender.
Tensors that are not dim-0 row ranges (another placement, a Partial) are gathered by every rank
(`full_tensor`, a collective in the same order on all ranks) and copied by rank 0; plain tensors
(buffers, the same on every rank) are copied by rank 0.
"""
from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from laminar.roles.trainer import dist
from laminar.roles.trainer.checkpoint import NonFiniteWeightsError

from laminar.weights.publisher import publish_layout
from laminar.weights.pull import copy_kind, torch_dtype
from laminar.weights.staging import StagingCopier, map_shared_staging

SHM = Path("/dev/shm")
FINAL_PART_S = 60.0  # how long a host leader's close waits for its part of the last version


def staging_prefix(root: Path = SHM) -> str:
    """A fresh name prefix for a trainer's shared staging files (top-level /dev/shm files, so a
    supervisor's sweep of a dead process group removes any that were still named)."""
    return str(root / f"laminar-staging-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _row_ranges(t) -> bool:
    """Whether every rank's part of DTensor `t` is a range of whole dim-0 rows (Shard(0) or
    Replicate on every mesh dim): decided by placements alone, the same on every rank."""
    from torch.distributed.tensor import Replicate, Shard  # late: torch; configs validate without it
    return t.ndim > 0 and all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0) for p in t.placements)


def _gathered(items, layout) -> list:
    """(tensor, dtype, offset) of the DTensors that are not row ranges: gathered (a collective)."""
    from torch.distributed.tensor import DTensor  # late: torch; configs validate without it
    return [(t, torch_dtype(dt), off) for (_, t), dt, off in zip(items, layout.dtypes, layout.offsets, strict=True)
            if isinstance(t, DTensor) and not _row_ranges(t)]


def shard_rows(t) -> tuple[object, int] | None:
    """(local tensor, first global row) when this rank's part of DTensor `t` is a range of whole
    dim-0 rows that it alone writes (Shard(0) on every sharded mesh dim; on a replicated mesh dim
    only coordinate 0 writes: its local part is None then). None: not a row range (gather it)."""
    from torch.distributed.tensor import Replicate  # late: torch; configs validate without it
    if not _row_ranges(t):
        return None
    coord = t.device_mesh.get_coordinate() or []
    writes = all(c == 0 for c, p in zip(coord, t.placements, strict=True) if isinstance(p, Replicate))
    local = t.to_local()
    return (local if writes else None), _first_row(t, local)


def _first_row(t, local) -> int:
    try:
        # late: torch; configs validate without it
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        if tuple(shape) == tuple(local.shape):
            return int(offset[0])
    except ImportError:  # a private helper: fall back to torch.chunk's split (what FSDP2 uses)
        pass
    mesh, rows = t.device_mesh, t.shape[0]
    coord = mesh.get_coordinate() or []
    from torch.distributed.tensor import Shard  # late: torch; configs validate without it
    start, size = 0, rows
    for c, p, n in zip(coord, t.placements, mesh.shape, strict=True):
        if isinstance(p, Shard):
            chunk = -(-size // n)
            start, size = start + min(c * chunk, size), max(0, min(chunk, size - c * chunk))
    if size != local.shape[0]:
        raise ValueError(f"cannot place a shard of {tuple(local.shape)} rows in {tuple(t.shape)}")
    return start


def nonfinite(named) -> list[str]:
    """Names of the (name, tensor) pairs holding a NaN or inf: one device sync per device in the
    common all-finite case, a per-tensor look only when something is off."""
    import torch  # late: torch; configs validate without it
    by_device: dict = {}
    for name, x in named:
        if x.numel():
            by_device.setdefault(x.device, []).append((name, x))
    bad = []
    for pairs in by_device.values():
        if not bool(torch.stack([torch.isfinite(x).all() for _, x in pairs]).all()):
            bad += [n for n, x in pairs if not bool(torch.isfinite(x).all())]
    return bad


class ShardedPublish:
    def __init__(self, info, publisher=None, probe_root: Path = SHM, make_publisher=None,
                 one_rank_per_host: bool = False):
        self.info, self.publisher = info, publisher  # rank 0's publisher on rank 0; None elsewhere
        self.probe_root = probe_root
        # a host leader > 0's own part publisher, made at its first publish (hosts mode)
        self.make_publisher, self._own_publisher = make_publisher, False
        self.one_rank_per_host = one_rank_per_host  # tests and benchmarks: hosts mode on one machine
        self.mode: str | None = None  # "shared" | "hosts", decided at the first publish
        self.hosts: list[int] = []    # each rank's host leader (the lowest rank of its host)
        self.copier = StagingCopier()
        self._maps: tuple[str, list] | None = None  # (slot file prefix, [mapping per slot]) on non-leaders
        self._unlinked: str | None = None
        self._ranges: list[tuple[int, int]] = []  # (offset, bytes) this rank wrote in the current publish
        self.last_copy_bytes = 0  # bytes this rank copied in the last publish

    @property
    def leader(self) -> int:
        return self.hosts[self.info.rank] if self.hosts else 0

    @property
    def is_leader(self) -> bool:
        return self.leader == self.info.rank

    # -- mode --------------------------------------------------------------------------------
    def _decide_mode(self) -> str:
        """Collective: each rank's host leader; "shared" when every rank is on rank 0's host."""
        if self.one_rank_per_host:
            self.hosts = list(range(self.info.world_size))
        else:
            token = uuid.uuid4().hex
            path = self.probe_root / f"laminar-probe-{token}"
            try:
                path.write_text(token)
                mine = (str(path), token)
            except OSError:  # still at the all-gather: the groups then disagree and every rank raises
                mine = (None, None)
            try:
                probes = dist.all_gather_objects(self.info, mine)
                seen = [r for r, (p, t) in enumerate(probes) if p and _reads(p, t)]
                # (an all-gather: every rank has read every probe before any is unlinked)
                self.hosts = dist.all_gather_objects(self.info, min(seen, default=self.info.rank))
            finally:
                path.unlink(missing_ok=True)
        if any(self.hosts[lead] != lead for lead in self.hosts):
            raise RuntimeError(f"sharded publish: inconsistent host groups {self.hosts} (a /dev/shm some ranks share "
                               "only in part?)")
        mode = "shared" if set(self.hosts) == {0} else "hosts"
        if mode == "hosts" and self.publisher is not None:
            self.publisher.become_part()
        return mode

    # -- one publish -------------------------------------------------------------------------
    def publish(self, state: dict, version: int) -> None:
        """Every rank: publish `state` (this rank's model state dict: DTensor shards under
        FSDP2) as `version`. Returns when the version is the newest of the publisher(s) and
        this rank's bytes are in it."""
        if self.mode is None:
            self.mode = self._decide_mode()
        items = list(state.items())
        head = self._begin(items, version) if self.info.is_main else None
        msg = json.loads(dist.broadcast_bytes(self.info, json.dumps(head).encode() if head is not None else None))
        if "error" in msg:
            raise RuntimeError(f"sharded publish of version {version}: rank 0 failed: {msg['error']}")
        if self.mode == "hosts":
            mine = self._begin_part(items, msg, version) if self.is_leader and not self.info.is_main else None
            heads = dist.all_gather_objects(self.info, mine)
            errors = [f"rank {r}: {h['error']}" for r, h in enumerate(heads) if h and "error" in h]
            if errors:
                raise RuntimeError(f"sharded publish of version {version}: a host leader failed: {'; '.join(errors)}")
            if self.leader:
                msg = {**msg, **heads[self.leader]}
        # the layout and which tensors are gathered are the same on every rank (global shapes and
        # placements): an error here is raised by every rank alike
        layout = publish_layout(((k, t.dtype, t.shape, t.is_floating_point()) for k, t in items),
                                msg["dtype"], msg["chunk_bytes"])
        if layout.total_bytes != msg["total_bytes"]:
            raise ValueError(f"layout of {layout.total_bytes} bytes, rank 0's has {msg['total_bytes']}")
        gather = _gathered(items, layout)
        failed, bad, self._ranges, buf = "", [], [], None
        try:
            buf = self._slot_buffer(msg)
            jobs, bad = self._jobs(items, layout)
            if jobs:
                self.copier.copy(jobs, buf, key=msg["slot"])
            self.last_copy_bytes = sum(t.numel() * dt.itemsize for t, dt, _ in jobs)
            self._ranges += [(off, t.numel() * dt.itemsize) for t, dt, off in jobs]
        except Exception as exc:  # noqa: BLE001  (every rank must reach the collectives below)
            failed = f"{type(exc).__name__}: {exc}"
        for t, dt, off in gather:  # collectives, in the same order on every rank, even after a failure
            try:
                self._gather(t, dt, off, None if failed else buf, msg["slot"])
            except Exception as exc:  # noqa: BLE001
                failed = failed or f"{type(exc).__name__}: {exc}"
        ranges = dist.all_gather_objects(self.info, self._ranges) if self.mode == "hosts" else None
        flags = dist.all_reduce_sums(self.info, {"failed": float(bool(failed)), "nonfinite": float(len(bad))})
        if flags["nonfinite"]:
            where = ", ".join(bad[:5]) if bad else "another rank's shards"
            raise NonFiniteWeightsError(f"refusing to publish version {version}: non-finite values in {where}")
        if flags["failed"]:
            raise RuntimeError(f"sharded publish of version {version} failed: {failed or 'on another rank'}")
        if not self.is_leader:
            return
        host = None
        if ranges is not None:
            host = [rg for r, rs in enumerate(ranges) if self.hosts[r] == self.info.rank for rg in rs]
        self.publisher.commit(msg["slot"], layout, version, ranges=host)
        if msg.get("paths") and self._unlinked != msg["files"]:
            self.publisher.unlink_staging()  # every rank of this host has mapped both slots (they copied)
            self._unlinked = msg["files"]

    def _begin(self, items, version: int) -> dict:
        pub = self.publisher
        try:
            layout = pub.layout_of((k, t.dtype, t.shape, t.is_floating_point()) for k, t in items)
            _, slot = pub.begin(layout, version)
            if any(copy_kind(t) == "cuda" for _, t in items):
                pub.pin_slots()  # both at once: no later publish pays for a registration
            return {"slot": slot, "dtype": pub.publish_dtype, "chunk_bytes": pub.chunk_bytes,
                    "total_bytes": layout.total_bytes, "target": list(pub.target) if pub.target else None,
                    "run_id": pub.run_id, "lineage": pub.lineage, **_slot_files(pub)}
        except Exception as exc:  # noqa: BLE001  (told to every rank, then raised)
            return {"error": f"{type(exc).__name__}: {exc}"}

    def _begin_part(self, items, msg: dict, version: int) -> dict:
        """A host leader > 0: begin a slot of its own part publisher, following rank 0's target,
        dtype, chunk size and lineage."""
        try:
            if self.publisher is None:
                if self.make_publisher is None:
                    raise RuntimeError("ranks on several hosts, but this host leader has no way to make a publisher")
                self.publisher, self._own_publisher = self.make_publisher(), True
            pub = self.publisher
            pub.become_part()
            pub.publish_dtype, pub.chunk_bytes = msg["dtype"], msg["chunk_bytes"]
            pub.run_id, pub.lineage = msg["run_id"], msg["lineage"]
            if msg.get("target"):  # every publish: it follows a new master, and reconnects a failed link
                pub.set_target(*msg["target"])
            layout = publish_layout(((k, t.dtype, t.shape, t.is_floating_point()) for k, t in items),
                                    msg["dtype"], msg["chunk_bytes"])
            _, slot = pub.begin(layout, version)
            if any(copy_kind(t) == "cuda" for _, t in items):
                pub.pin_slots()
            return {"slot": slot, **_slot_files(pub)}
        except Exception as exc:  # noqa: BLE001  (told to every rank, then raised)
            return {"error": f"{type(exc).__name__}: {exc}"}

    def _slot_buffer(self, msg: dict):
        """The staging slot this rank writes: a leader's own (rank 0's, or a host leader's part
        publisher's); its leader's shared file elsewhere (mapped once per layout, both slots, the
        previous mappings dropped)."""
        if self.is_leader:
            self.copier = self.publisher.copier  # one registration per slot buffer in this process
            return self.publisher.slots[msg["slot"]]
        if not msg.get("paths"):
            raise RuntimeError("the host leader's staging is not shared (no staging_prefix)")
        if self._maps is None or self._maps[0] != msg["files"]:
            self._drop_maps()
            self._maps = (msg["files"], [map_shared_staging(p, msg["total_bytes"]) for p in msg["paths"]])
        return self._maps[1][msg["slot"]]

    def _jobs(self, items, layout):
        """(copy jobs of this rank, names of the non-finite tensors it holds); the tensors that
        are not row ranges are left to `_gathered`."""
        from torch.distributed.tensor import DTensor  # late: torch; configs validate without it
        main = self.info.is_main
        jobs, checks = [], []
        for (name, t), dt_name, off in zip(items, layout.dtypes, layout.offsets, strict=True):
            dt = torch_dtype(dt_name)
            local = t.to_local() if isinstance(t, DTensor) else t
            if local.is_floating_point():
                checks.append((name, local))
            if not isinstance(t, DTensor):
                if main:  # the same on every rank (a buffer): rank 0 writes it
                    jobs.append((t, dt, off))
                continue
            if not _row_ranges(t):
                continue
            mine, first = shard_rows(t)
            if mine is not None and mine.numel():
                row_bytes = dt.itemsize * mine[0].numel()
                jobs.append((mine.contiguous(), dt, off + first * row_bytes))
        return jobs, nonfinite(checks)

    def _gather(self, t, dt, off, buf, slot) -> None:
        """A collective: cast this rank's part on its device, gather the tensor to rank 0 (in the
        serving dtype), and rank 0 copies it into its staging (so its host sends those bytes);
        with no `buf` (this rank failed already) only the collective."""
        from torch.distributed.tensor import DTensor  # late: torch; configs validate without it
        cast = DTensor.from_local(t.to_local().to(dt), t.device_mesh, t.placements, run_check=False,
                                  shape=t.shape, stride=t.stride())
        full = cast.full_tensor()
        if self.info.is_main and buf is not None:
            self.copier.copy([(full, dt, off)], buf, key=slot)
            self._ranges.append((off, full.numel() * dt.itemsize))

    def _drop_maps(self) -> None:
        if self._maps is not None:
            for i, buf in enumerate(self._maps[1]):
                self.copier.unpin(i)
                try:
                    buf.close()
                except BufferError:
                    pass
            self._maps = None

    def close(self) -> None:
        if not self.info.is_main:
            self._drop_maps()
        if self._own_publisher and self.publisher is not None:
            # a host leader's part publisher (rank 0's belongs to PublishLink): its part of the
            # last version must reach the master first, or that version is never whole there
            self.publisher.wait_delivered(self.publisher.version, FINAL_PART_S)
            self.publisher.close()
            self.publisher, self._own_publisher = None, False


def _reads(path: str, token: str) -> bool:
    try:
        return Path(path).read_text() == token
    except OSError:
        return False


def _slot_files(pub) -> dict:
    """The names of a publisher's shared staging slots, for the other ranks of its host to map
    (empty when its staging is private memory)."""
    if pub.slot_path(0) is None:
        return {"files": "", "paths": []}
    return {"files": pub.slot_path(0), "paths": [pub.slot_path(i) for i in range(len(pub.slots))]}
