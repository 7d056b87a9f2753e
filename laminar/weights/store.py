"""Versions in memory: `VersionBuffer` (one version being filled or complete) and `ShmStore` (a
relay's double buffer in /dev/shm, shared with the rollouts of its host).

Layout of a store folder: `slot0.bin`, `slot1.bin` (the two buffers) and `current` (the pointer:
which slot, which inode, and the manifest with every checksum). Files are reused across versions,
so neither the relay (writing) nor a rollout (reading through a cached mapping, pull.py) pays for
page faults or page-table set-up per version; that is what lets a local pull run near memcpy speed.

Visibility and safety contract (what a local reader relies on):
- a version is received into the slot that is not current, under an exclusive flock(2); it is
  named by `current` only after every chunk arrived and verified: commit writes
  `current.tmp` and renames it over `current` (atomic), then drops the exclusive lock;
- the current slot is never written; a reader takes a shared flock on the slot it reads and
  checks that `current` still names that inode, so it only ever sees a complete version;
- when the slot to receive into is still held by a reader (or by this relay's own forwarder
  streaming an older version), the relay does not wait: it unlinks that file and receives into a
  fresh one under the same name. The holder keeps its inode, intact, until it lets go;
- chunks that arrive for a chunk already held are drained to scratch memory by the receiver, so a
  corrupt duplicate cannot overwrite verified bytes.

Retained versions (`retain` > 0): when a version is replaced, its slot file gets a second name,
`v<version>.bin` (a hard link: no copy), with its manifest in `v<version>.manifest`; a slot file
with such a name is never written again (the next version goes into a fresh file), and only the
newest `retain` are kept. A rollout can load one (pull.py `LocalWeights.version`) to resume work
of an old version that no live rollout holds any more (the manager's orphan_policy `retained`).

Permissions: the folder is private to the user the relay runs as (0700, files 0600; a folder
another user owns is refused at open, nothing in it touched): whoever can write there decides
what weights the rollouts of the host load.

Threading: one condition (`cond`) guards all state; receivers mark chunks and forwarders wait on it
for the next chunk, so forwarding chunk i overlaps receiving chunk i+1.
"""
from __future__ import annotations

import dataclasses
import fcntl
import mmap
import os
import stat
import threading
import time
from pathlib import Path

import msgpack

from laminar.protocol import Manifest
from laminar.weights.manifest import (
    chunk_count,
    chunk_range,
    ident,
    manifest_from_bytes,
    manifest_to_bytes,
    same_layout,
    same_lineage,
    supersedes,
    verify,
    with_version,
)

CURRENT = "current"


class VersionBuffer:
    """A flat buffer for one version plus which chunks of it are present and verified."""

    def __init__(self, manifest: Manifest, buf, path: Path | None = None, slot: int = -1, ino: int = -1):
        self.manifest = manifest
        self.version = manifest.version
        self.n = chunk_count(manifest)
        self.buf = buf                      # mmap (relay: a slot file; publisher: anonymous)
        self.view = memoryview(buf)[: manifest.total_bytes]
        self.path, self.slot, self.ino = path, slot, ino  # its slot file and that file's inode
        self.fd: int | None = None          # the slot file, exclusively locked while filling
        self.checksums: list[int] = list(manifest.checksums) if manifest.checksums else [0] * self.n
        # each chunk's content digest (wire.content_digest), checked on arrival and forwarded
        self.digests: list[bytes] = [b""] * self.n
        self.seals: list[bytes] = list(manifest.seals)  # what vouches for its bytes (seal.py)
        self.sealed = False                 # the seals verified against every byte: it may be visible
        self.have = bytearray(self.n)
        self.count = 0
        self.prefix = 0                     # chunks [0, prefix) are all present
        self.abandoned = False              # superseded before completion: stop waiting on it
        self.readers = 0                    # forwarders streaming from it
        self.progress_at = time.monotonic()  # when it was begun or last gained a chunk (stall check)

    @property
    def complete(self) -> bool:
        return self.count == self.n

    @property
    def ident(self) -> tuple[str, int, int]:
        return ident(self.manifest)

    def chunk(self, i: int) -> memoryview:
        s, n = chunk_range(self.manifest, i)
        return self.view[s:s + n]

    def mark(self, i: int, digest: int, content: bytes = b"") -> None:
        """Record chunk i as present with its xxh3 `digest` and its verified content digest
        (caller holds the condition)."""
        if self.have[i]:
            return
        self.have[i] = 1
        self.checksums[i] = digest
        self.digests[i] = content
        self.count += 1
        self.progress_at = time.monotonic()
        while self.prefix < self.n and self.have[self.prefix]:
            self.prefix += 1

    def mark_all(self, checksums: list[int]) -> None:
        self.checksums = list(checksums)
        self.have = bytearray(b"\1" * self.n)
        self.count = self.prefix = self.n

    def known_digests(self) -> dict:
        """(offset, length) -> content digest of every chunk whose digest is known (seal.check)."""
        return {chunk_range(self.manifest, i): d for i, d in enumerate(self.digests) if d}

    def full_manifest(self) -> Manifest:
        m = with_version(self.manifest, self.version, self.checksums)
        return dataclasses.replace(m, macs=[], seals=list(self.seals))


def retained_versions(directory: Path) -> list[int]:
    """The retained versions in a relay folder (those with a `v<version>.manifest`), oldest first."""
    out = []
    for p in Path(directory).glob("v*.manifest"):
        try:
            out.append(int(p.name[1:-len(".manifest")]))
        except ValueError:
            continue
    return sorted(out)


def read_pointer(directory: Path) -> tuple[int, int, Manifest] | None:
    """(slot, inode, manifest) named by `current`, or None (raises ValueError if corrupt)."""
    try:
        raw = (directory / CURRENT).read_bytes()
    except FileNotFoundError:
        return None
    try:
        d = msgpack.unpackb(raw)
        slot, ino, m = int(d["slot"]), int(d["ino"]), manifest_from_bytes(d["manifest"])
    except (ValueError, KeyError, TypeError, msgpack.ExtraData) as exc:
        raise ValueError(f"{directory / CURRENT}: bad pointer: {exc}") from None
    if slot not in (0, 1) or len(m.checksums) != chunk_count(m):
        raise ValueError(f"{directory / CURRENT}: bad pointer")
    return slot, ino, m


def _write_private(path: Path, data: bytes) -> None:
    """Replace `path` atomically with `data`, in a 0600 file (a temporary one renamed over it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    os.replace(tmp, path)


class ShmStore:
    """A relay's versions: `current` (newest complete, visible) and `incoming` (being received)."""

    preempt = True  # forwarders switch to a newer version as soon as it starts arriving

    def __init__(self, directory: str | os.PathLike, retain: int = 0):
        self.dir = Path(directory)
        self.retain = max(0, int(retain))
        self.cond = threading.Condition()
        self.current: VersionBuffer | None = None
        self.incoming: VersionBuffer | None = None
        self.previous: VersionBuffer | None = None  # the version `current` replaced
        self.left: VersionBuffer | None = None      # a verified version a previous process left,
        # kept out of sight until an offer shows it is of the lineage being served (`begin`)
        self.stopped = False
        self.maps: dict[int, tuple[int, int, mmap.mmap]] = {}  # slot -> (inode, size, mapping)
        self.fresh_files = 0  # times a slot was held by a reader and replaced by a new file

    def slot_path(self, slot: int) -> Path:
        return self.dir / f"slot{slot}.bin"

    def open(self) -> None:
        """Create the folder. A verified version a previous process left is not served: its
        pointer is removed at once (no rollout loads it) and it is kept aside (`left`) until the
        first offer says whether it belongs to the lineage being served now (`begin`): a relay
        restarted mid-run resumes on it, a new run or a new trainer lineage never sees it."""
        self._own_folder()
        keep: set[str] = set()
        try:
            ptr = read_pointer(self.dir)
            if ptr is not None:
                slot, ino, m = ptr
                buf = self._map(slot, m.total_bytes, create=False)
                if self.maps[slot][0] == ino and not verify(m, buf) and m.seals:
                    vb = VersionBuffer(m, buf, self.slot_path(slot), slot, ino)
                    vb.mark_all(m.checksums)
                    vb.sealed = True  # its seals verified before it became current; rollouts check them again
                    self.left, keep = vb, {self.slot_path(slot).name}
        except (OSError, ValueError):
            self.maps.clear()
        if self.retain and self.left is not None:  # the left version's lineage: decided with it
            keep |= {p.name for p in self.dir.glob("v*.bin")} | {p.name for p in self.dir.glob("v*.manifest")}
        for p in self.dir.iterdir():
            if p.name not in keep:
                p.unlink(missing_ok=True)
        self._prune()

    def _own_folder(self) -> None:
        """Create the folder 0700, or refuse one that is not a folder of this process's user."""
        self.dir.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.dir.mkdir(mode=0o700)
        except FileExistsError:
            pass
        st = os.lstat(self.dir)
        if not stat.S_ISDIR(st.st_mode):
            raise PermissionError(f"{self.dir}: not a folder (a link or a file is never used as a relay folder)")
        if st.st_uid != os.geteuid():
            raise PermissionError(f"{self.dir}: owned by uid {st.st_uid}, but this relay runs as uid {os.geteuid()}; "
                                  f"a relay only uses a folder of its own user (remove it, or set another shm_dir)")
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.chmod(self.dir, 0o700)

    def _settle_left(self, m: Manifest) -> None:
        """The first offer decides the left version (caller holds `cond`): of the same run and
        lineage it becomes current again (visible), of any other it is forgotten."""
        left, self.left = self.left, None
        if left is None:
            return
        if same_lineage(left.manifest, m):
            self._write_pointer(left)
            self.current = left
            self.cond.notify_all()
        else:
            left.view.release()  # its file is reused (or replaced) like any non-current slot
            self._prune(keep=0)

    def _map(self, slot: int, size: int, create: bool, fresh: bool = False) -> mmap.mmap:
        """The slot's mapping (reused when the same inode already has the right size)."""
        path = self.slot_path(slot)
        if fresh:
            path.unlink(missing_ok=True)
        fd = os.open(path, (os.O_RDWR | os.O_CREAT) if create else os.O_RDWR, 0o600)
        try:
            st = os.fstat(fd)
            if stat.S_IMODE(st.st_mode) != 0o600:
                os.fchmod(fd, 0o600)
            cached = self.maps.get(slot)
            if cached and cached[0] == st.st_ino and cached[1] == size:
                return cached[2]
            populate = getattr(mmap, "MAP_POPULATE", 0)
            if st.st_size != size:
                if not create:
                    raise ValueError(f"{path}: {st.st_size} bytes, manifest says {size}")
                os.ftruncate(fd, size)
                # A new file has no pages yet: populating would allocate and zero all of them
                # before the first chunk is accepted, and in a chain those delays add up hop by
                # hop (each relay answers its OFFER late). Let chunks fault pages in as they land.
                populate = 0
            buf = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            self.maps[slot] = (st.st_ino, size, buf)
            return buf
        finally:
            os.close(fd)

    # -- called by receivers / forwarders (threads) ---------------------------------------
    def newest(self) -> VersionBuffer | None:
        return self.incoming or self.current

    def pick(self, delivered: tuple | int) -> VersionBuffer | None:
        """Source API for a forwarder: the newest version, unless it is the one it delivered
        last (`delivered`: that version's ident). The store only ever moves forward (`begin`)."""
        vb = self.newest()
        return vb if vb is not None and vb.ident != delivered else None

    @staticmethod
    def open_file(vb: VersionBuffer) -> int | None:
        """Source API (optional): a read-only descriptor of the file `vb`'s bytes lie in (its slot
        file), so a forwarder sends chunks straight from it (Conn.send_file); None when `vb` has
        no file or its path now names another file. The caller closes it."""
        if vb.path is None or vb.ino < 0:
            return None
        try:
            fd = os.open(vb.path, os.O_RDONLY)
        except OSError:
            return None
        st = os.fstat(fd)
        if st.st_ino != vb.ino or st.st_size < vb.manifest.total_bytes:
            os.close(fd)
            return None
        return fd

    def acquire(self, vb: VersionBuffer) -> None:
        vb.readers += 1

    def release(self, vb: VersionBuffer) -> None:
        with self.cond:
            vb.readers = max(0, vb.readers - 1)

    def begin(self, m: Manifest, older: str = "take") -> tuple[str, VersionBuffer | None]:
        """What to do with an offer of version m (the caller holds `cond`):

        - ("refuse", current): m is of this run but an older lineage than the one held as
          current: never taken, never answered 'have it' (docs/weights.md);
        - ("have", current): the current version is m or supersedes it ('have it' means held as
          current: complete, sealed and visible, nothing less);
        - ("take", buffer): receive m into `buffer`, the incoming version (a resumed one keeps
          every verified chunk);
        - ("busy", incoming): m is older than the incoming version and `older` is "busy" (part
          upstreams: offer again later); with "take" (one upstream) the incoming version is
          abandoned and m taken instead. A version that is merely announced never makes an older
          offer look delivered, so an inflated OFFER pins nothing.
        A new lineage supersedes whatever is held, even under a lower number (manifest.supersedes)."""
        self._settle_left(m)
        cur, inc = self.current, self.incoming
        if cur is not None and m.run_id == cur.manifest.run_id and m.lineage < cur.manifest.lineage:
            return "refuse", cur
        if cur is not None and not supersedes(m, cur.manifest):
            return "have", cur
        if inc is not None and inc.ident == ident(m) and same_layout(inc.manifest, m):
            inc.progress_at = time.monotonic()  # a new stream of it starts (a repaired link)
            return "take", inc  # resume after a repair: keep every verified chunk
        if inc is not None and not supersedes(m, inc.manifest) and older == "busy":
            return "busy", inc
        if inc is not None:
            self._abandon(inc)
        slot = 1 - cur.slot if cur is not None else 0
        # our own forwarder may still stream the version that slot holds: never write under it
        busy = any(vb is not None and vb.slot == slot and vb.readers for vb in (inc, self.previous))
        busy = busy or self._linked(slot)  # a retained version lives in that file: never overwrite it
        # seals and digests come with the chunks, never from the offer: only verified ones are kept
        vb = self._claim(slot, dataclasses.replace(with_version(m, m.version), macs=[], seals=[]), fresh=busy)
        self.incoming = vb
        self.cond.notify_all()
        return "take", vb

    def expire(self, stall_s: float) -> VersionBuffer | None:
        """Abandon the incoming version if nothing of it arrived for `stall_s` (its upstream went
        away mid-stream and nobody offers it again); returns it, or None (caller holds `cond`)."""
        inc = self.incoming
        if inc is None or time.monotonic() - inc.progress_at < stall_s:
            return None
        self._abandon(inc)
        self.cond.notify_all()
        return inc

    def abandon(self, vb: VersionBuffer) -> None:
        """Drop the incoming version `vb` (its seals failed): nothing of it is kept (caller holds `cond`)."""
        if vb is self.incoming:
            self._abandon(vb)
            self.cond.notify_all()

    def _claim(self, slot: int, m: Manifest, fresh: bool) -> VersionBuffer:
        """Map `slot` for writing under an exclusive lock; a slot a reader holds is replaced."""
        path = self.slot_path(slot)
        for attempt in range(2):
            buf = self._map(slot, m.total_bytes, create=True, fresh=fresh or attempt > 0)
            fd = os.open(path, os.O_RDWR)
            if os.fstat(fd).st_ino != self.maps[slot][0]:
                os.close(fd)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a rollout still reads the old version there
                os.close(fd)
                self.fresh_files += 1
                continue
            vb = VersionBuffer(m, buf, path, slot, self.maps[slot][0])
            vb.fd = fd
            return vb
        raise OSError(f"{path}: could not claim a slot file")

    def _abandon(self, vb: VersionBuffer) -> None:
        vb.abandoned = True
        self._unlock(vb)
        self.incoming = None

    @staticmethod
    def _unlock(vb: VersionBuffer) -> None:
        if vb.fd is not None:
            os.close(vb.fd)  # closing the descriptor drops its flock
            vb.fd = None

    def commit(self, vb: VersionBuffer) -> None:
        """Make a complete version whose seals verified visible (caller holds `cond`)."""
        assert vb.complete and vb.sealed and vb is self.incoming
        self._write_pointer(vb)
        self._unlock(vb)
        if self.current is not None and not same_lineage(self.current.manifest, vb.manifest):
            self._prune(keep=0)  # retained versions name weights of the lineage just left
        elif self.retain and self.current is not None:
            self._keep(self.current)
        self.previous, self.current, self.incoming = self.current, vb, None
        self.cond.notify_all()

    def _write_pointer(self, vb: VersionBuffer) -> None:
        _write_private(self.dir / CURRENT, msgpack.packb({"slot": vb.slot, "ino": self.maps[vb.slot][0],
                                                          "manifest": manifest_to_bytes(vb.full_manifest())}))

    # -- retained versions ---------------------------------------------------------------------------
    def _linked(self, slot: int) -> bool:
        try:
            return os.stat(self.slot_path(slot)).st_nlink > 1
        except FileNotFoundError:
            return False

    def _keep(self, vb: VersionBuffer) -> None:
        """Give the replaced version's file a second name (its bytes stay where they are)."""
        name = self.dir / f"v{vb.version}.bin"
        try:
            if os.stat(vb.path).st_ino != self.maps.get(vb.slot, (None,))[0]:
                return  # its file was replaced meanwhile: nothing to keep under that name
            name.unlink(missing_ok=True)
            os.link(vb.path, name)
            _write_private(self.dir / f"v{vb.version}.manifest", manifest_to_bytes(vb.full_manifest()))
        except OSError:  # retention is best effort: the relay goes on without it
            name.unlink(missing_ok=True)
            return
        self._prune()

    def retained(self) -> list[int]:
        """Versions kept besides `current`, oldest first."""
        return retained_versions(self.dir)

    def _prune(self, keep: int | None = None) -> None:
        vs = self.retained()
        keep = self.retain if keep is None else keep
        for v in vs[:max(0, len(vs) - keep)]:
            (self.dir / f"v{v}.manifest").unlink(missing_ok=True)  # the manifest first: readers look for it
            (self.dir / f"v{v}.bin").unlink(missing_ok=True)

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            if self.incoming is not None:
                self._unlock(self.incoming)
            self.cond.notify_all()

    def close(self) -> None:
        """Unmap everything (after every thread using this store has stopped)."""
        with self.cond:
            for vb in (self.current, self.incoming, self.previous, self.left):
                if vb is not None:
                    self._unlock(vb)
                    vb.view.release()
            self.current = self.incoming = self.previous = self.left = None
            for _, _, buf in self.maps.values():
                try:
                    buf.close()
                except BufferError:  # a view still exported somewhere: the GC unmaps it later
                    pass
            self.maps.clear()

    def remove_files(self) -> None:
        """Delete the folder and its contents (a relay role at stop unless keep_shm; tests, benchmarks)."""
        if self.dir.exists():
            for p in self.dir.iterdir():
                p.unlink(missing_ok=True)
            self.dir.rmdir()
