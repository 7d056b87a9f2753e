"""Staging memory of a publish, and the copies of tensors (or dim-0 shards of them) into it.

    buf = alloc_staging(n)                       # private anonymous memory: one process writes it
    buf = alloc_shared_staging(path, n)          # a /dev/shm file: every rank of the host maps it
    buf = map_shared_staging(path, n)            # ... and opens it by name (same user only)
    copier = StagingCopier()
    copier.copy([(tensor, dtype, byte_offset), ...], buf, key=slot)

A copy job is a source tensor, the dtype it is published in and the byte offset in the staging
where its first element goes: a whole tensor at its manifest offset, or a dim-0 shard (FSDP2)
at `offset + first_row * row_bytes` (the rows of a tensor are contiguous byte ranges of it, so
the shards of several ranks tile the tensor's extent exactly).

How a job is copied:
- CPU source already in its published dtype and contiguous: one plain memcpy (GIL released).
  torch's 2-thread copy_ was 2-3x slower than one memcpy whenever another process held a core.
  Jobs whose sources lie end to end in memory exactly as their places lie in the staging (a
  trainer's parameters kept in one buffer in the published layout: roles/trainer/flat_params.py)
  are one memcpy for the whole run: glibc copies a large block with non-temporal stores, a
  tensor-sized one through the cache, which cost ~1.7x more per byte on this project's machine.
- CPU source to cast or strided: `Tensor.copy_` into a view of the staging (the cast is written
  straight into it, no temporary), on this thread alone: torch's intra-op threads stalled a
  publish ~100x on a core another process held.
- GPU source: cast on its own device (half the bytes cross the bus for a bf16 publish of fp32
  weights), then an asynchronous copy into the staging on a stream of the copier's own that
  first waits for the current stream (the optimizer step's writes). The staging is page-locked
  (`cudaHostRegister`, once per buffer) so the copy is a DMA at the link's speed; a refused
  registration falls back to pageable copies (correct, ~4x slower). Every stream is synchronized
  before `copy` returns: the caller may hand the bytes on at once. With `wait=False` it returns at
  once instead, with an `InFlight` for the copies still running: `guard()` orders the current
  stream's later work (an optimizer step that writes the sources) after them without blocking the
  CPU, `wait()` blocks until the bytes have landed (the publisher's overlapped publish).
"""
from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterable

from laminar.weights.pull import copy_kind, cuda_host_register, cuda_host_unregister


def _prefault(buf: mmap.mmap) -> mmap.mmap:
    """Touch every page of a new buffer now (a huge page per 2 MiB when granted), so that no
    publish pays page faults. Only for memory nobody else writes yet: it writes zeros."""
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # shmem huge pages may be off for files: fine
            pass
    view = memoryview(buf)
    for off in range(0, len(buf), 1 << 21):
        view[off] = 0
    view.release()
    return buf


def alloc_staging(size: int) -> mmap.mmap:
    """Private anonymous memory, on huge pages where the kernel allows (fewer TLB misses in the
    copy), touched once now so that no publish pays page faults."""
    return _prefault(mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))


def alloc_shared_staging(path: str | os.PathLike, size: int) -> mmap.mmap:
    """A new file of `size` zero bytes (mode 0600, refused if the name exists), mapped shared and
    pre-faulted: the staging that several processes of one host (the ranks of a trainer) write.
    The creator may unlink it once everyone mapped it; the mappings keep the memory."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, max(size, 1))
        buf = mmap.mmap(fd, max(size, 1), flags=mmap.MAP_SHARED)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return _prefault(buf)


def map_shared_staging(path: str | os.PathLike, size: int) -> mmap.mmap:
    """Map a staging file another process of this host made; PermissionError when another user
    owns it (whoever writes it decides the weights), ValueError when its size is not `size`."""
    fd = os.open(path, os.O_RDWR)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise PermissionError(f"{path}: owned by uid {st.st_uid}, not by this process's uid {os.geteuid()}")
        if st.st_size != max(size, 1):
            raise ValueError(f"{path}: {st.st_size} bytes, expected {max(size, 1)}")
        # populated, not touched: the other ranks may already be writing their shards into it
        buf = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
    return buf


def _record(streams: dict) -> dict:
    """{device: a CUDA event recorded now on that device's stream in `streams`}."""
    import torch  # late: torch; configs validate without it
    events = {}
    for dev, stream in streams.items():
        events[dev] = torch.cuda.Event()
        events[dev].record(stream)
    return events


class InFlight:
    """GPU copies into staging that may still be running (StagingCopier.copy with wait=False)."""

    def __init__(self, events: dict):
        self.events = events  # CUDA device -> event recorded on its copy stream after the copies

    def guard(self) -> None:
        """Make each device's current stream wait for the copies (no CPU wait): call it before
        anything overwrites the source tensors, i.e. before the next optimizer step."""
        import torch  # late: torch; configs validate without it
        for dev, ev in self.events.items():
            torch.cuda.current_stream(dev).wait_event(ev)

    def wait(self) -> None:
        """Block until every byte has landed in the staging."""
        for ev in self.events.values():
            ev.synchronize()


def memcpy_runs(jobs) -> list[tuple[int, int, int]]:
    """The plain-memcpy jobs (a contiguous CPU source in its published dtype) as (source address,
    staging offset, bytes) runs: consecutive jobs, by staging offset, whose sources continue each
    other in memory exactly where their places continue each other in the staging (no gap on
    either side) are one run."""
    runs: list[list[int]] = []
    for t, dt, off in sorted(jobs, key=lambda j: j[2]):
        if t.dtype != dt or copy_kind(t) != "memcpy":
            continue
        src, n = t.data_ptr(), t.numel() * t.element_size()
        last = runs[-1] if runs else None
        if last is not None and last[0] + last[2] == src and last[1] + last[2] == off:
            last[2] += n
        else:
            runs.append([src, off, n])
    return [(a, b, c) for a, b, c in runs]


class StagingCopier:
    """Copies jobs into staging buffers; owns the CUDA registrations of those buffers (keyed by
    the caller's name for the buffer, e.g. its slot) and the copy streams."""

    def __init__(self):
        self.pinned: dict = {}    # key -> (buffer, address registered with CUDA)
        self.refused: set = set()  # keys whose registration the driver refused (pageable copies)
        self.streams: dict = {}   # CUDA device -> the stream the copies run on

    def pin(self, key, buf) -> bool:
        """Page-lock `buf` for CUDA once (re-registered if `key` now names another buffer)."""
        held = self.pinned.get(key)
        if held is not None and held[0] is buf:
            return True
        if held is not None:
            self.unpin(key)
        if key in self.refused:
            return False
        ptr = cuda_host_register(buf)
        if ptr is None:
            self.refused.add(key)
            return False
        self.pinned[key] = (buf, ptr)
        return True

    def unpin(self, key=None) -> None:
        """Unregister one buffer (or all, key None) before it is unmapped."""
        for k in [key] if key is not None else list(self.pinned):
            held = self.pinned.pop(k, None)
            if held is not None:
                cuda_host_unregister(held[1])
        if key is None:
            self.refused.clear()
        else:
            self.refused.discard(key)

    def copy(self, jobs: Iterable[tuple], buf, key=None, wait: bool = True, after: dict | None = None
             ) -> InFlight | None:
        """Copy every (source tensor, published dtype, byte offset) job into `buf`; returns when
        all bytes have landed. `key` names `buf` for its CUDA registration (GPU sources only).
        wait=False: GPU copies are only queued (CPU sources are still copied at once) and the
        InFlight that tracks them is returned (None when nothing is left in flight). `after`:
        {device: event} the copies wait for instead of the current streams (mark())."""
        import torch  # late: torch; configs validate without it
        flat = torch.frombuffer(buf, dtype=torch.uint8)
        jobs = [(t.detach(), dt, off) for t, dt, off in jobs if t.numel()]
        devices = {t.device for t, _, _ in jobs if copy_kind(t) == "cuda"}
        if devices:
            return self._copy_cuda(jobs, flat, self.pin(key, buf), devices, wait, after)
        self._copy_host(jobs, flat)
        return None

    @staticmethod
    def mark(devices) -> dict:
        """{device: event recorded now on the calling thread's current stream}: the point after
        which copies issued later (from another thread: copy(..., after=...)) read the sources.
        Work on other streams is not covered: the writes must be on that stream (the trainer's
        threads all run on the default stream)."""
        import torch  # late: torch; configs validate without it
        return _record({dev: torch.cuda.current_stream(dev) for dev in devices})

    @staticmethod
    def _copy_host(jobs, flat) -> None:
        import torch  # late: torch; configs validate without it
        base, threads = flat.data_ptr(), torch.get_num_threads()
        try:
            for src, off, n in memcpy_runs(jobs):
                ctypes.memmove(base + off, src, n)
            for t, dt, off in jobs:
                if t.dtype == dt and copy_kind(t) == "memcpy":
                    continue  # copied above
                if threads != 1 and torch.get_num_threads() != 1:
                    torch.set_num_threads(1)
                n = t.numel() * dt.itemsize
                flat[off:off + n].view(dt).view(t.shape).copy_(t)
        finally:
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)

    def _copy_cuda(self, jobs, flat, pinned: bool, devices, wait: bool = True, after: dict | None = None
                   ) -> InFlight | None:
        import torch  # late: torch; configs validate without it
        streams = {}
        for dev in devices:
            s = self.streams.get(dev)
            if s is None:
                s = self.streams[dev] = torch.cuda.Stream(dev)
            if after is not None and dev in after:
                s.wait_event(after[dev])
            else:
                s.wait_stream(torch.cuda.current_stream(dev))  # the optimizer step's writes come first
            streams[dev] = s
        host = []
        try:
            for t, dt, off in jobs:
                if copy_kind(t) != "cuda":
                    host.append((t, dt, off))
                    continue
                n = t.numel() * dt.itemsize
                dst = flat[off:off + n].view(dt).view(t.shape)
                with torch.cuda.stream(streams[t.device]):
                    src = t.to(dt) if t.dtype != dt else t  # the cast runs on the GPU, before the copy
                    dst.copy_(src, non_blocking=pinned)  # (a cast's memory belongs to this stream)
                if not wait:
                    t.record_stream(streams[t.device])  # its memory is not reused before the copy ran
        except BaseException:
            for s in streams.values():  # what was queued lands before anyone may free the staging
                s.synchronize()
            raise
        StagingCopier._copy_host(host, flat)
        if not wait and pinned:  # (pageable copies are synchronous anyway)
            return InFlight(_record(streams))
        for s in streams.values():
            s.synchronize()
        return None
