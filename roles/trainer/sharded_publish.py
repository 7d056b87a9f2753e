"""Sharded publish: every rank of an FSDP2 trainer copies its own shards into one staging slot.

    sp = ShardedPublish(info, publisher)          # publisher: rank 0's WeightPublisher; None elsewhere
    sp.publish(engine.publish_state(), version)   # every rank, together (a collective)

Under FSDP2 a parameter is a DTensor sharded on dim 0: rank r holds rows [o_r, o_r + n_r), and
those rows are one contiguous byte range of the tensor in the published layout, at
`offset + o_r * row_bytes`. So the ranks write their shards side by side into the staging the
master relay is fed from, and nothing is gathered: the trainer's stall is one (pinned, on a GPU)
copy of 1/N of the weights, cast to the serving dtype on each rank's own device first. The
version is byte-for-byte what a publish of the gathered state dict gives (same layout, same
bytes; tests/integration/test_sharded_publish.py).

Modes, decided collectively at the first publish:
- `shared` (every rank on rank 0's host): rank 0's publisher keeps its two staging slots as
  /dev/shm files (`staging_prefix`); every rank maps both once per layout (and page-locks its
  mapping for CUDA once), and rank 0 unlinks the names as soon as all have mapped them, so a
  killed trainer leaves nothing behind. A probe file decides it: a rank that cannot read rank 0's
  probe is on another host (or another /dev/shm).
- `gather` (ranks on several hosts): tensor by tensor, each rank casts its shard on its device,
  the shards are gathered to rank 0 in the serving dtype (half the bytes of fp32 for bf16), and
  rank 0 copies the tensor into its staging; peak extra memory is one tensor. Missing here: the
  ranks of other hosts sending their byte ranges straight to the master relay, which would
  assemble and verify one version (docs/gpu.md, "Sharded publish across hosts").

One publish (shared mode):
  1. rank 0: `begin()` picks a free slot; it broadcasts {slot files, slot, dtype, chunk bytes,
     total bytes} (or the error that stopped it, so that every rank raises);
  2. every rank: the same layout from the global shapes (checked against rank 0's size), then
     its copy jobs, copied and waited for (staging.py);
  3. an all-reduce of (failed, non-finite) over the ranks: everyone learns whether the version
     is whole and finite; weights with a NaN or inf are refused on every rank
     (NonFiniteWeightsError), as full_state() refuses them;
  4. rank 0: `commit()` hands the version to the sender.
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


def staging_prefix(root: Path = SHM) -> str:
    """A fresh name prefix for a trainer's shared staging files (top-level /dev/shm files, so a
    supervisor's sweep of a dead process group removes any that were still named)."""
    return str(root / f"laminar-staging-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def shard_rows(t) -> tuple[object, int] | None:
    """(local tensor, first global row) when this rank's part of DTensor `t` is a range of whole
    dim-0 rows that it alone writes (Shard(0) on every sharded mesh dim; on a replicated mesh dim
    only coordinate 0 writes: its local part is None then). None: not a row range (gather it)."""
    from torch.distributed.tensor import Replicate, Shard
    if any(not (isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0)) for p in t.placements):
        return None
    if t.ndim == 0:
        return None
    coord = t.device_mesh.get_coordinate() or []
    writes = all(c == 0 for c, p in zip(coord, t.placements, strict=True) if isinstance(p, Replicate))
    local = t.to_local()
    return (local if writes else None), _first_row(t, local)


def _first_row(t, local) -> int:
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        if tuple(shape) == tuple(local.shape):
            return int(offset[0])
    except ImportError:  # a private helper: fall back to torch.chunk's split (what FSDP2 uses)
        pass
    mesh, rows = t.device_mesh, t.shape[0]
    coord = mesh.get_coordinate() or []
    from torch.distributed.tensor import Shard
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
    import torch
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
    def __init__(self, info, publisher=None, probe_root: Path = SHM):
        self.info, self.publisher = info, publisher  # publisher on rank 0 only
        self.probe_root = probe_root
        self.mode: str | None = None  # "shared" | "gather", decided at the first publish
        self.copier = StagingCopier()
        self._maps: tuple[str, list] | None = None  # (slot file prefix, [mapping per slot]) on ranks > 0
        self._unlinked: str | None = None
        self.last_copy_bytes = 0  # bytes this rank copied in the last publish

    # -- mode --------------------------------------------------------------------------------
    def _decide_mode(self) -> str:
        """Collective: "shared" when every rank reads rank 0's probe file in /dev/shm."""
        path = token = None
        if self.info.is_main:
            token = uuid.uuid4().hex
            path = self.probe_root / f"laminar-probe-{token}"
            path.write_text(token)
        try:
            msg = json.loads(dist.broadcast_bytes(self.info, json.dumps({"path": str(path), "token": token}).encode()
                                                  if self.info.is_main else None))
            try:
                ok = Path(msg["path"]).read_text() == msg["token"]
            except OSError:
                ok = False
            far = dist.all_reduce_sums(self.info, {"far": float(not ok)})["far"]
        finally:
            if path is not None:
                path.unlink(missing_ok=True)
        mode = "shared" if far == 0 else "gather"
        if self.publisher is not None and mode == "gather":
            self.publisher.staging_prefix = None  # rank 0 alone writes: private memory suffices
        return mode

    # -- one publish -------------------------------------------------------------------------
    def publish(self, state: dict, version: int) -> None:
        """Every rank: publish `state` (this rank's model state dict: DTensor shards under
        FSDP2) as `version`. Returns when the version is the publisher's newest (rank 0) and
        this rank's bytes are in it."""
        if self.mode is None:
            self.mode = self._decide_mode()
        items = list(state.items())
        head = self._begin(items, version) if self.info.is_main else None
        msg = json.loads(dist.broadcast_bytes(self.info, json.dumps(head).encode() if head is not None else None))
        if "error" in msg:
            raise RuntimeError(f"sharded publish of version {version}: rank 0 failed: {msg['error']}")
        failed, bad = "", []
        try:
            layout = publish_layout(((k, t.dtype, t.shape, t.is_floating_point()) for k, t in items),
                                    msg["dtype"], msg["chunk_bytes"])
            if layout.total_bytes != msg["total_bytes"]:
                raise ValueError(f"layout of {layout.total_bytes} bytes, rank 0's has {msg['total_bytes']}")
            buf = self._slot_buffer(msg)
            jobs, gathered, bad = self._jobs(items, layout, buf, msg["slot"])
            if jobs:
                self.copier.copy(jobs, buf, key=msg["slot"])
            for step in gathered:  # collectives, in the same order on every rank
                step()
            self.last_copy_bytes = sum(t.numel() * dt.itemsize for t, dt, _ in jobs)
        except Exception as exc:  # noqa: BLE001  (every rank must reach the all-reduce below)
            failed = f"{type(exc).__name__}: {exc}"
        flags = dist.all_reduce_sums(self.info, {"failed": float(bool(failed)), "nonfinite": float(len(bad))})
        if flags["nonfinite"]:
            where = ", ".join(bad[:5]) if bad else "another rank's shards"
            raise NonFiniteWeightsError(f"refusing to publish version {version}: non-finite values in {where}")
        if flags["failed"]:
            raise RuntimeError(f"sharded publish of version {version} failed: {failed or 'on another rank'}")
        if self.info.is_main:
            self.publisher.commit(msg["slot"], layout, version)
            if self.mode == "shared" and self._unlinked != msg["files"]:
                self.publisher.unlink_staging()  # every rank has mapped both slots (they copied)
                self._unlinked = msg["files"]

    def _begin(self, items, version: int) -> dict:
        pub = self.publisher
        try:
            layout = pub.layout_of((k, t.dtype, t.shape, t.is_floating_point()) for k, t in items)
            _, slot = pub.begin(layout, version)
            if any(copy_kind(t) == "cuda" for _, t in items):
                pub.pin_slots()  # both at once: no later publish pays for a registration
            return {"slot": slot, "files": pub.slot_path(0) if self.mode == "shared" else "",
                    "paths": [pub.slot_path(i) for i in range(len(pub.slots))] if self.mode == "shared" else [],
                    "dtype": pub.publish_dtype, "chunk_bytes": pub.chunk_bytes, "total_bytes": layout.total_bytes}
        except Exception as exc:  # noqa: BLE001  (told to every rank, then raised)
            return {"error": f"{type(exc).__name__}: {exc}"}

    def _slot_buffer(self, msg: dict):
        """The staging slot this rank writes: rank 0's own; the shared file elsewhere (mapped
        once per layout, both slots, the previous mappings dropped)."""
        if self.info.is_main:
            self.copier = self.publisher.copier  # one registration per slot buffer in this process
            return self.publisher.slots[msg["slot"]]
        if self.mode != "shared":
            return None
        if self._maps is None or self._maps[0] != msg["files"]:
            self._drop_maps()
            self._maps = (msg["files"], [map_shared_staging(p, msg["total_bytes"]) for p in msg["paths"]])
        return self._maps[1][msg["slot"]]

    def _jobs(self, items, layout, buf, slot):
        """(copy jobs of this rank, gather steps, names of the non-finite tensors it holds)."""
        from torch.distributed.tensor import DTensor
        main, shared = self.info.is_main, self.mode == "shared"
        jobs, gathered, checks = [], [], []
        for (name, t), dt_name, off in zip(items, layout.dtypes, layout.offsets, strict=True):
            dt = torch_dtype(dt_name)
            local = t.to_local() if isinstance(t, DTensor) else t
            if local.is_floating_point():
                checks.append((name, local))
            if not isinstance(t, DTensor):
                if main:  # the same on every rank (a buffer): rank 0 writes it
                    jobs.append((t, dt, off))
                continue
            rows = shard_rows(t) if shared else None
            if rows is None:
                gathered.append(self._gather_step(t, dt, off, buf, slot))
                continue
            mine, first = rows
            if mine is not None and mine.numel():
                row_bytes = dt.itemsize * mine[0].numel()
                jobs.append((mine.contiguous(), dt, off + first * row_bytes))
        return jobs, gathered, nonfinite(checks)

    def _gather_step(self, t, dt, off, buf, slot):
        """A collective: cast this rank's part on its device, gather the tensor to rank 0 (in the
        serving dtype), and rank 0 copies it into its staging."""
        def step() -> None:
            from torch.distributed.tensor import DTensor
            cast = DTensor.from_local(t.to_local().to(dt), t.device_mesh, t.placements, run_check=False,
                                      shape=t.shape, stride=t.stride())
            full = cast.full_tensor()
            if self.info.is_main:
                self.copier.copy([(full, dt, off)], buf, key=slot)
        return step

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
