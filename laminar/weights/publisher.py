"""WeightPublisher: the trainer's side of the relay tier. `publish()` costs one copy.

    pub = WeightPublisher(chunk_bytes=16 << 20, key=derive_key(secret), signer=Signer(weights_secret))
    pub.set_target("10.0.0.2:7000", "relay-0")     # the master relay (follow.py keeps it current)
    v = pub.publish(model.state_dict())            # returns after copying into staging
    pub.wait_delivered(v, timeout=30)              # optional: the master holds all of v

Staging: two buffers (private anonymous memory, pre-faulted), so publish() never waits for the
network: it writes into the buffer the background sender is *not* reading. If the sender is still
busy with an older version and another publish() comes, the pending (not yet started) version is
overwritten in place: the chain always moves to the newest weights and never queues stale ones.

The only work on the caller's thread is the copy (laminar/weights/staging.py: a plain memcpy per
contiguous CPU tensor, a cast and an asynchronous copy into page-locked staging on a stream of its
own for GPU tensors). Checksums are computed by the background sender chunk by chunk, just before
each chunk goes out (xxh3, ≈ 25 GB/s).

Several writers (the ranks of an FSDP2 trainer on one host, roles/trainer/sharded_publish.py):
with `staging_prefix` the two slots are /dev/shm files the other ranks map; `begin()` picks the
slot, every rank copies its shards into it, and `commit()` hands the version to the sender.

One host of several (`part=True`: an FSDP2 trainer whose ranks span hosts, mode `hosts` of
sharded_publish.py): `commit(..., ranges=...)` names the byte ranges this host's ranks wrote, and
the link is a PartSender (part_sender.py) that sends only those to the master relay, which
assembles the version from every host's part; `delivered` then means this host's part is in.

The background thread connects to the target, authenticates (as the trainer: with `signer`, the
trainer's signing key, it proves it holds it), and runs a Sender; when the link fails it calls
`on_link_down(peer)` and waits for `set_target` (the manager names the new master), or, with
`reconnect_s`, tries the same target again after that long. Each version is sealed with `signer`
(seal.py): the seal lists the digests of the chunks the sender hashed as it sent them, so
sealing costs one signature, not another pass over the bytes. A master relay that holds a newer
lineage of the run refuses the version: `refused` then says why (naming both lineages), the
version never counts as delivered, and `on_refused(why)` tells the owner (the trainer fails
loudly rather than train on while nothing it publishes reaches a rollout).

Every version carries the trainer's lineage (`run_id`, `lineage`: lineage.py's records, set
before the first publish). publish_async's in-flight copies are a PendingPublish (pending.py).

Threads: the trainer's (publish, publish_async, begin/commit, wait_*, set_target via follow.py,
close), the link thread `weight-publisher` (_link_loop, and the Sender it runs, through the
Source API: pick/acquire under `cond`, release, _delivered/_refused), and one
`weight-publish-copy` thread per publish_async with GPU tensors (the copies, then commit()).
Who guards what:

  cond (Condition)     stopped, target, _target_seq, _sender, part (set by become_part), layout,
                       slots, _generation, newest, busy_slot, version, delivered, refused. Waits on
                       it: the link loop (a new target, stop), wait_delivered (delivered, stop),
                       a reconnect's pause. Its writers notify_all. The Sender calls pick/acquire/
                       make_seals with it held (sender.py).
  _publishing (RLock)  the window of one publish between begin() and its hand-off (commit, or the
                       PendingPublish with its thread started) against close(): close cannot drop
                       the staging under a copy; publish_async sets _pending under it.
  trainer-confined     _pending (read by wait_pending, which only the trainer's thread calls),
                       last_publish_s, run_id, lineage, manifest_fields (set before publishing),
                       copier (its copies run on the caller's thread or a publish_async's copy
                       thread, one at a time: begin() waits for the pending one first).
  fixed at __init__    chunk_bytes, publish_dtype, staging_prefix, transport, key, signer,
                       timeouts, reconnect_s, the callbacks, _thread.
Reads of `version` in begin() (no lock) are safe: only the trainer's threads write it, one at a
time (begin waits for the pending publish).
"""
from __future__ import annotations

import dataclasses
import mmap
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from laminar.weights import handshake, seal, wire
from laminar.weights.kwlog import kw_logger
from laminar.weights.manifest import CHUNK_BYTES_DEFAULT, build_manifest, same_layout, with_lineage, with_version
from laminar.weights.part_sender import PartSender, split_ranges
from laminar.weights.pending import PendingPublish
from laminar.weights.pull import copy_kind, torch_dtype
from laminar.weights.sender import Sender
from laminar.weights.staging import StagingCopier, alloc_shared_staging, alloc_staging
from laminar.weights.store import VersionBuffer
from laminar.weights.transport import LinkError, get_transport

if TYPE_CHECKING:
    import torch

    from laminar.protocol import Manifest

log = kw_logger("laminar.weights.publisher")


def publish_layout(specs, publish_dtype: str | None, chunk_bytes: int) -> Manifest:
    """The staging layout (a manifest without version or checksums) of tensors given as (name,
    torch dtype, shape, is floating point): floating-point ones in `publish_dtype` (None: their
    own). Every rank of a sharded publish computes it from the global shapes."""
    cast = torch_dtype(publish_dtype) if publish_dtype else None
    return build_manifest([(k, str(cast if cast is not None and fp else dt).removeprefix("torch."), tuple(shape))
                           for k, dt, shape, fp in specs], 0, chunk_bytes)


class WeightPublisher:
    """The trainer's end of the weight chain: owns the two staging slots and their layout, the
    newest committed version, and the link thread that streams it to the master relay (Sender, or
    PartSender for one host's part) and records what was delivered or refused. The guards table
    is in the module docstring."""

    close_wait_s = 30.0  # close(): how long a pending publish_async may still take
    def __init__(self, chunk_bytes: int = CHUNK_BYTES_DEFAULT, transport: str = "tcp", key: bytes = b"",
                 on_link_down: Callable[[str], None] = lambda peer: None,
                 connect_timeout_s: float = 3.0, ack_timeout_s: float = 30.0,
                 publish_dtype: str | None = None, staging_prefix: str | None = None, part: bool = False,
                 reconnect_s: float | None = None, signer: seal.Signer | None = None,
                 on_refused: Callable[[str], None] = lambda why: None, heartbeat_s: float = 1.0,
                 idle_timeout_s: float = 10.0):
        self.chunk_bytes = chunk_bytes
        self.signer = signer  # the trainer's signing key (None: unsigned seals, auth off)
        self.on_refused = on_refused
        self.refused = ""  # why the master refused the last version it refused ("" none)
        self.heartbeat_s, self.idle_timeout_s = heartbeat_s, idle_timeout_s
        self.part = part  # one host's part of a version (PartSender), not the whole of it
        # after a failed link, try the same target again this often (None: wait for set_target)
        self.reconnect_s = reconnect_s
        # floating-point tensors are cast to this dtype on their own device before the copy
        # (None or "same": published as they are); the manifest names each tensor's dtype
        self.publish_dtype = None if publish_dtype in (None, "", "same") else str(publish_dtype)
        torch_dtype(self.publish_dtype) if self.publish_dtype else None  # unknown names fail here
        self.copier = StagingCopier()  # the copies, their CUDA streams and the slots' registrations
        # staging_prefix: slots are files "<prefix>-g<generation>-s<slot>" (e.g. under /dev/shm)
        # that the other ranks of this host map and write their shards into (sharded publish);
        # None: private anonymous memory, written by this process alone
        self.staging_prefix = staging_prefix
        self._generation = 0
        self.transport = get_transport(transport) if isinstance(transport, str) else transport
        self.key, self.on_link_down = key, on_link_down
        self.connect_timeout_s, self.ack_timeout_s = connect_timeout_s, ack_timeout_s
        self.cond = threading.Condition()
        self.stopped = False
        self.layout = None
        self.slots: list[mmap.mmap] = []
        self.newest: VersionBuffer | None = None
        self.busy_slot: int | None = None
        self.delivered = -1
        self.version = -1
        # Every version published carries this lineage (set before the first publish; the trainer
        # takes it from advance_lineage): relays replace any other lineage's weights with it.
        self.run_id, self.lineage = "", 0
        # what every version says it holds beyond its tensors (a LoRA adapter's kind, config and
        # base identity: Manifest's kind, adapter_config, base_id); {}: full weights
        self.manifest_fields: dict = {}
        self.target: tuple[str, str] | None = None
        self._target_seq = 0
        self.last_publish_s = 0.0
        self._sender: Sender | None = None
        self._pending: PendingPublish | None = None  # the last publish_async's
        self._publishing = threading.RLock()  # publish/publish_async against close
        self._thread = threading.Thread(target=self._link_loop, name="weight-publisher", daemon=True)
        self._thread.start()

    # -- trainer API -------------------------------------------------------------------------
    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int | None = None) -> int:
        """Copy `state_dict` (cast to publish_dtype) into a free staging slot and hand it to the
        sender as `version` (default: the next number); returns the version."""
        t0 = time.perf_counter()
        with self._publishing:
            version, slot, layout, jobs, cuda = self._jobs(state_dict, version)
            self.copier.copy(jobs, self.slots[slot], key=slot)
            self.commit(slot, layout, version)
        self.last_publish_s = time.perf_counter() - t0
        return version

    def publish_async(self, state_dict: Mapping[str, torch.Tensor], version: int | None = None) -> PendingPublish:
        """publish() without waiting for GPU copies: a thread of its own queues them on the
        copier's streams (after the work queued on the current streams by now), waits until they
        have landed and commits the version. Nothing may overwrite the source tensors before
        `pending.guard()` (the trainer calls it before its next optimizer step; it blocks no CPU),
        so the copy overlaps the next forward and backward. A state dict with no GPU tensor is
        copied at once, as by publish(). The next publish (and close) first waits for this one
        and raises its error."""
        t0 = time.perf_counter()
        with self._publishing:  # close() cannot drop the staging between begin() and the hand-off
            version, slot, layout, jobs, cuda = self._jobs(state_dict, version)
            pending = PendingPublish(version)

            def commit() -> None:
                self.commit(slot, layout, version)
            if not cuda:
                pending.run(lambda: self.copier.copy(jobs, self.slots[slot], key=slot), commit)
            else:  # the copies start from the weights as of now, queued by a thread of their own
                try:
                    after = self.copier.mark({t.device for t, _, _ in jobs if copy_kind(t) == "cuda"})
                    issue = lambda: self.copier.copy(jobs, self.slots[slot], key=slot, wait=False,  # noqa: E731
                                                     after=after)
                    threading.Thread(target=pending.run, args=(issue, commit), name="weight-publish-copy",
                                     daemon=True).start()
                except BaseException as e:
                    pending.fail(e)  # nothing was queued: no waiter may hang on it
                    raise
            self._pending = pending
        self.last_publish_s = time.perf_counter() - t0
        return pending

    def wait_pending(self, timeout: float | None = None) -> None:
        """Wait for the last publish_async's copies and commit; raises what its copy or commit
        raised (once), or TimeoutError (the publish stays pending)."""
        pending = self._pending
        if pending is None:
            return
        pending.guard(timeout)
        try:
            pending.wait(timeout)
        finally:
            if pending.done.is_set():  # finished, well or not: reported once
                self._pending = None

    def prepare(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Allocate (and, for GPU tensors, page-lock) the staging of `state_dict`'s layout now,
        e.g. when the trainer starts, so that the first publish costs what any later one does."""
        self.wait_pending()  # a new layout frees the slots: none may still be written
        items, layout = self._layout_of_state(state_dict)
        with self.cond:
            if self.layout is None or not same_layout(self.layout, layout):
                self._reset_layout(layout)
        if any(copy_kind(t) == "cuda" for _, t in items):
            self.pin_slots()

    def _layout_of_state(self, state_dict) -> tuple[list, Manifest]:
        items = list(state_dict.items())
        return items, self.layout_of((k, t.dtype, t.shape, t.is_floating_point()) for k, t in items)

    def _jobs(self, state_dict, version):
        """Begin a publish of state_dict: (version, slot, layout, copy jobs, any GPU source)."""
        items, layout = self._layout_of_state(state_dict)
        version, slot = self.begin(layout, version)
        jobs = [(t, torch_dtype(dt), off) for (_, t), dt, off in zip(items, layout.dtypes, layout.offsets, strict=True)]
        cuda = any(copy_kind(t) == "cuda" for t, _, _ in jobs)
        if cuda:
            self.pin_slots()  # both at once: no later publish pays for a registration
        return version, slot, layout, jobs, cuda

    def layout_of(self, specs) -> Manifest:
        """The layout of tensors given as (name, torch dtype, shape, is floating point)."""
        layout = publish_layout(specs, self.publish_dtype, self.chunk_bytes)
        return dataclasses.replace(layout, **self.manifest_fields) if self.manifest_fields else layout

    def begin(self, layout: Manifest, version: int | None = None) -> tuple[int, int]:
        """(version, slot): a staging slot nobody reads, for `layout` (new slots when the layout
        changed). Write it (self.slots[slot], or the file slot_path(slot) from another process),
        then commit(); a begun slot that is never committed is simply reused. A publish_async
        still in flight is waited for first (its slot is not free until it is committed)."""
        self.wait_pending()
        version = self.version + 1 if version is None else version
        if version <= self.version:
            raise ValueError(f"version {version} is not newer than the last published {self.version}")
        with self.cond:
            if self.stopped:
                raise RuntimeError("the publisher is closed")
            if self.layout is None or not same_layout(self.layout, layout):
                self._reset_layout(layout)
            return version, self._free_slot()

    def commit(self, slot: int, layout: Manifest, version: int, ranges=None) -> None:
        """The slot holds all of `version` (with `part`: the byte ranges `ranges`, (offset,
        length) pairs, of it): it becomes the newest, and the sender's next."""
        if self.part != (ranges is not None):
            raise ValueError("a part publisher commits byte ranges, a whole one commits none")
        vb = VersionBuffer(with_lineage(with_version(layout, version), self.run_id, self.lineage),
                           self.slots[slot], slot=slot)
        vb.mark_all([0] * vb.n)  # digests: computed by the sender as each chunk goes out
        if ranges is not None:
            vb.ranges = split_ranges(ranges, layout.chunk_bytes)
        with self.cond:
            if version <= self.version:
                raise ValueError(f"version {version} is not newer than the last published {self.version}")
            self.newest, self.version = vb, version
            self.cond.notify_all()

    def slot_path(self, slot: int) -> str | None:
        """The file of a shared staging slot (staging_prefix set), for the other ranks to map."""
        return f"{self.staging_prefix}-g{self._generation}-s{slot}" if self.staging_prefix else None

    def unlink_staging(self) -> None:
        """Remove the names of the shared staging files once every writer has mapped them: the
        mappings keep the memory, and nothing is left in /dev/shm if the trainer is killed."""
        for i in range(len(self.slots)):
            path = self.slot_path(i)
            if path is not None:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass

    def pin_slots(self) -> None:
        """Page-lock both staging slots for CUDA (once per layout; see staging.py)."""
        for i, buf in enumerate(self.slots):
            self.copier.pin(i, buf)

    @property
    def _pinned(self) -> dict:  # slot -> address registered with CUDA
        return {k: ptr for k, (_, ptr) in self.copier.pinned.items()}

    @property
    def _streams(self) -> dict:
        return self.copier.streams

    def _reset_layout(self, layout) -> None:
        if self.busy_slot is not None:
            raise RuntimeError("model layout changed while a version is being sent")
        self._drop_slots()
        self.layout = layout
        if self.staging_prefix:
            self._generation += 1
            self.slots = [alloc_shared_staging(self.slot_path(i), layout.total_bytes) for i in range(2)]
        else:
            self.slots = [alloc_staging(layout.total_bytes), alloc_staging(layout.total_bytes)]
        self.newest = None

    def _drop_slots(self) -> None:
        """Unregister and unmap the staging slots (and unlink shared ones still named)."""
        self.copier.unpin()
        if self.newest is not None:
            self.newest.view.release()
            self.newest = None
        self.unlink_staging()
        for buf in self.slots:
            try:
                buf.close()
            except BufferError:
                pass
        self.slots, self.layout = [], None

    def _free_slot(self) -> int:
        """A slot the sender is not reading (caller holds cond); see the module docstring."""
        if self.busy_slot is None:
            return 1 - self.newest.slot if self.newest is not None else 0
        slot = 1 - self.busy_slot
        if self.newest is not None and self.newest.slot == slot:  # pending, not started: replace
            self.newest = None
        return slot

    def wait_delivered(self, version: int, timeout: float) -> bool:
        """Block until the master holds `version` (True), at most `timeout`; close() ends the
        wait at once (False unless it was delivered)."""
        with self.cond:
            self.cond.wait_for(lambda: self.delivered >= version or self.stopped, timeout)
            return self.delivered >= version

    def set_target(self, address: str, relay_id: str = "") -> None:
        """Send to this master relay from now on (re-setting the same one reconnects)."""
        with self.cond:
            new = (address, relay_id) if address else None
            if new == self.target and self._sender is not None:
                return  # already streaming there (ChainState is republished periodically)
            self.target = new
            self._target_seq += 1
            sender = self._sender
            self.cond.notify_all()
        if sender is not None:
            sender.stop()

    def become_part(self) -> None:
        """From now on publish one host's part (sharded_publish.py found the ranks on several
        hosts): the link to the master is made again, as a part upstream."""
        with self.cond:
            if self.part:
                return
            self.part = True
            self._target_seq += 1  # the link loop reconnects to the same target
            sender = self._sender
            self.cond.notify_all()
        if sender is not None:
            sender.stop()

    def close(self) -> None:
        leak = False
        with self._publishing:  # no publish is between begin() and its hand-off now
            try:
                self.wait_pending(timeout=self.close_wait_s)  # the last publish_async's copies land, committed
            except TimeoutError as e:  # still copying: its staging must outlive it (leaked, not freed)
                leak = True
                log.warning("publish_pending_timeout", error=repr(e))
            except BaseException as e:  # noqa: BLE001 -- closing anyway; say why that version is missing
                log.warning("publish_pending_failed", error=repr(e))
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
            sender = self._sender
        if sender is not None:
            sender.stop()
        self._thread.join(timeout=10.0)
        if leak:
            return
        with self.cond:  # release the staging memory now rather than at garbage collection
            self._drop_slots()

    # -- Source API for the Sender -----------------------------------------------------------
    def pick(self, delivered: tuple | int) -> VersionBuffer | None:
        vb = self.newest  # versions of one publisher only grow: anything else is new
        if vb is None or vb.ident == delivered:
            return None
        return vb

    def acquire(self, vb: VersionBuffer) -> None:
        self.busy_slot = vb.slot  # (caller holds cond)

    def release(self, vb: VersionBuffer) -> None:
        with self.cond:
            if self.busy_slot == vb.slot:
                self.busy_slot = None

    def _delivered(self, version: int) -> None:
        with self.cond:
            self.delivered = max(self.delivered, version)
            self.refused = ""
            self.cond.notify_all()

    def _refused(self, version: int, why: str) -> None:
        log.error("publish_refused", version=version, lineage=self.lineage, why=why)
        with self.cond:
            self.refused = why
            self.cond.notify_all()
        self.on_refused(why)

    def _declined(self, version: int, why: str) -> None:
        """The relay declined the version for another reason than a newer lineage (a relay gives
        the trainer's own link no such answer: only a hostile or broken one does). Logged, not fatal."""
        log.error("publish_declined", version=version, lineage=self.lineage, why=why)

    def make_seals(self, vb: VersionBuffer) -> list[bytes]:
        """The seals of a whole version (Sender source API; caller holds cond): one seal over
        every chunk's digest, signed, made once (the sender hashed the chunks it sent; a resumed
        link hashes the ones it skipped here)."""
        return seal.seal_whole(vb, self.signer)

    def make_part_seal(self, vb: VersionBuffer, pieces) -> bytes:
        """This host's seal of its part: its ranges and their digests (PartSender source API)."""
        return seal.make_seal(self.signer, wire.manifest_digest(vb.manifest), pieces)

    # -- background link -----------------------------------------------------------------------
    def _link_loop(self) -> None:
        seen = 0
        while True:
            with self.cond:
                self.cond.wait_for(lambda seen=seen: self.stopped or (self.target and self._target_seq != seen))
                if self.stopped:
                    return
                (address, relay_id), seen = self.target, self._target_seq
            failure = None
            try:
                self._stream(address, relay_id, seen)
            except LinkError as exc:
                failure = exc
            finally:
                with self.cond:
                    self._sender, self.busy_slot = None, None
            if failure is not None:
                log.warning("master_link_down", target=address, relay=relay_id, error=str(failure))
                self.on_link_down(relay_id or address)
                if self.reconnect_s:
                    with self.cond:
                        self.cond.wait_for(lambda seen=seen: self.stopped or self._target_seq != seen, self.reconnect_s)
                        if self._target_seq == seen:
                            seen = -1  # the same target again

    def _stream(self, address: str, relay_id: str, seq: int) -> None:
        purpose = handshake.PURPOSE_PART if self.part else handshake.PURPOSE_PUBLISH
        ch = handshake.connect(self.transport, address, self.key, self.connect_timeout_s, purpose=purpose,
                               signer=self.signer)
        ch.set_idle_timeout(self.idle_timeout_s)
        cls = PartSender if self.part else Sender
        sender = cls(self, ch, name=f"publisher->{relay_id or address}", ack_timeout_s=self.ack_timeout_s,
                     on_delivered=self._delivered, on_refused=self._refused, heartbeat_s=self.heartbeat_s,
                     verifier=self.signer.public if self.signer is not None else None, on_declined=self._declined)
        with self.cond:
            self._sender = sender
            stale = self.stopped or self._target_seq != seq  # retargeted while connecting
        if stale:
            sender.stop()
        sender.run()
