"""Local pull: a rollout reads its host relay's newest complete version from shared memory.

    weights = LocalWeights("/dev/shm/laminar-run-relay-h0")
    with weights.latest() as pulled:          # None until the relay has a version
        for name, tensor in pulled.tensors():  # read-only views into shared memory, no copy
            ...load into the engine (vLLM reload_weights / a host-to-device copy)...
    version = weights.pull_into(state_dict)   # or: copy the newest version into tensors you own

Consistency (laminar/weights/store.py): the relay writes a version into the slot that is not
current, under an exclusive flock, and names it in `current` only when complete. A pull takes a
shared flock on the slot `current` names, then checks `current` still names that very inode: from
then on the relay will not write that file (it receives into a fresh file instead), so the views
stay a complete, verified version until `close()`. Views used after `close()` are unprotected.

Authenticity: a LocalWeights given the trainer's public signing key (`verify_key=`, raw 32
bytes, or the environment variable LAMINAR_WEIGHTS_VERIFY_KEY, hex, which the rollout role sets
for its engine's worker processes) checks a version's seals (laminar/weights/seal.py: signed by
the trainer, listing every piece of the buffer and its BLAKE3 digest) against its bytes before
`latest()` or `version()` hand it out, and raises WeightsRefused when a signature fails, a byte
differs or the manifest has no seal: bytes changed in shared memory, a manifest that no relay
verified, or weights from anyone but the trainer are never loaded. BLAKE3 runs at several GB/s
per core, so this costs a fraction of a second per GB pulled (docs/security.md has the rate).

Speed: mappings are cached per slot file and reused while the relay reuses the file, so a pull
costs no page-table set-up (MAP_POPULATE is paid once per slot, not per version) and reading is
plain memory access: `pull_into` is one memcpy per tensor from the page cache into the
destination. For GPU destinations the slot mapping is registered with CUDA (page-locked) once per
slot file, so each tensor is one asynchronous host-to-device copy at pinned speed; all of them are
waited for before the version's lock is dropped.
"""
from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from laminar.protocol import Manifest
from laminar.weights import seal
from laminar.weights.manifest import ident, manifest_from_bytes, verify
from laminar.weights.store import read_pointer, retained_versions
from laminar.weights.wire import manifest_digest

if TYPE_CHECKING:  # torch is imported where it is used: relays and the manager never need it
    import torch

# A reader that loses a race with the relay (the pointer moved on, the slot it named is being
# written) reads the pointer again at once, then after pauses growing from _FIRST_PAUSE_S to
# _MAX_PAUSE_S, for at most _HOLD_TIMEOUT_S: a relay fills a slot in milliseconds to seconds, and a
# tight loop of a fixed count gave up under a fast stream of versions on busy cores.
_HOLD_TIMEOUT_S = 30.0
_FIRST_PAUSE_S = 0.0005
_MAX_PAUSE_S = 0.05
_CUDA_HOST_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly: the rollout maps slots read-only


def torch_dtype(name: str):
    """The torch dtype named `name` ("bfloat16", "torch.float16"...); ValueError if there is none."""
    import torch  # late: torch; configs validate without it
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def copy_kind(t) -> str:
    """How a tensor is copied to or from a host buffer: "memcpy" (contiguous on the CPU: one
    plain memcpy), "cuda" (on a GPU: asynchronous, from/to page-locked memory), "torch" (anything
    else, e.g. strided: Tensor.copy_)."""
    kind = t.device.type
    if kind == "cuda":
        return "cuda"
    return "memcpy" if kind == "cpu" and t.is_contiguous() else "torch"


def cuda_host_register(buf, read_only: bool = False) -> int | None:
    """Page-lock `buf` (an mmap) for CUDA and return its address, or None when there is no CUDA
    or the driver refuses (the copies then still work, at pageable speed)."""
    import torch  # late: torch; configs validate without it
    if not torch.cuda.is_available() or len(buf) == 0:
        return None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        ptr = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    rt = torch.cuda.cudart()
    err = rt.cudaHostRegister(ptr, len(buf), _CUDA_HOST_REGISTER_READ_ONLY if read_only else 0)
    if int(getattr(err, "value", err)) == 0:
        return ptr
    _clear_cuda_error()
    return None


def _clear_cuda_error() -> None:
    """A refused registration leaves the error in CUDA's per-thread state, where torch's next
    kernel-launch check would report it: take it out (torch loads the runtime globally)."""
    try:
        ctypes.CDLL(None).cudaGetLastError()
    except (AttributeError, OSError):
        pass


def cuda_host_unregister(ptr: int | None) -> None:
    if ptr is not None:
        import torch  # late: torch; configs validate without it
        torch.cuda.cudart().cudaHostUnregister(ptr)


class WeightsRefused(ValueError):
    """A version whose chunks or manifest fail their MACs: it is not handed out."""


def seal_refusal(held: PulledVersion, verifier: seal.Verifier | None) -> str:
    """Why the seals of a held version do not vouch for its bytes ("" = they do). Without a
    verifier the seals' digests are still checked (a changed byte is caught), not their signature."""
    m = held.manifest
    try:
        bad = seal.check(m, m.seals, held.buf, verifier, manifest_digest(m))
        return f"chunks {bad[:8]} are not the bytes the trainer sealed" if bad else ""
    except seal.SealError as exc:
        return str(exc)


class PulledVersion:
    """One complete version, held (shared lock) until close()."""

    def __init__(self, manifest: Manifest, buf: mmap.mmap, fd: int):
        self.manifest, self.buf, self._fd = manifest, buf, fd
        self.version = manifest.version

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        import torch  # late: torch; configs validate without it
        m = self.manifest
        with warnings.catch_warnings():  # read-only on purpose: torch warns about that
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            for name, dt, shape, off, n in zip(m.names, m.dtypes, m.shapes, m.offsets, m.nbytes, strict=False):
                dtype = getattr(torch, dt)
                if n == 0:
                    yield name, torch.empty(shape, dtype=dtype)
                    continue
                yield name, torch.frombuffer(self.buf, dtype=dtype, count=n // dtype.itemsize, offset=off).view(shape)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors())

    def verify(self) -> list[int]:
        """Indices of chunks whose checksum differs from the manifest (empty: intact)."""
        return verify(self.manifest, self.buf)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # drops the shared lock; the relay may now reuse the slot
            self._fd = None

    def __enter__(self) -> PulledVersion:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LocalWeights:
    def __init__(self, shm_dir: str | os.PathLike, verify_key: bytes | None = None):
        """`verify_key`: the trainer's public signing key (raw 32 bytes) to check seals with;
        None takes LAMINAR_WEIGHTS_VERIFY_KEY (hex) from the environment (no check when it is
        unset); b"" never checks."""
        self.dir = Path(shm_dir)
        if verify_key is None:
            env = os.environ.get(seal.VERIFY_KEY_ENV, "")
            verify_key = bytes.fromhex(env) if env else b""
        self._verifier = seal.Verifier(verify_key) if verify_key else None
        self._maps: dict[int, tuple[int, int, mmap.mmap]] = {}  # slot -> (inode, size, mapping)
        self._pinned: dict[int, tuple[mmap.mmap, int]] = {}  # slot -> (mapping, address registered with CUDA)

    def _pointer(self):
        """read_pointer, from a folder of this process's user only (another user could plant
        weights there): PermissionError otherwise."""
        try:
            uid = os.stat(self.dir).st_uid
        except FileNotFoundError:
            return None
        if uid != os.geteuid():
            raise PermissionError(f"{self.dir}: owned by uid {uid}, not by this process's uid {os.geteuid()}: "
                                  f"weights are only loaded from a relay folder of the same user")
        return read_pointer(self.dir)

    def manifest(self) -> Manifest | None:
        ptr = self._pointer()
        return None if ptr is None else ptr[2]

    def current_version(self) -> int:
        m = self.manifest()
        return -1 if m is None else m.version

    def _mapping(self, slot: int, fd: int, ino: int, size: int) -> mmap.mmap:
        cached = self._maps.get(slot)
        if cached and cached[0] == ino and cached[1] == size:
            return cached[2]
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        # mmap keeps a dup of the descriptor it is given, and a dup shares the flock: map
        # through a separate open of the same inode, or the cached mapping would hold the lock
        own = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
        try:
            buf = mmap.mmap(own, size, flags=flags, prot=mmap.PROT_READ)
        finally:
            os.close(own)
        old = self._pinned.pop(slot, None)
        if old is not None:
            cuda_host_unregister(old[1])
        self._maps[slot] = (ino, size, buf)  # the previous mapping goes when its views do
        return buf

    def pin(self, pulled: PulledVersion) -> bool:
        """Page-lock the held version's slot mapping for CUDA, once per slot file (a retained
        file is not): its tensors() then copy to a GPU at pinned speed, e.g. in vLLM's
        reload_weights. Keep this LocalWeights for the next pulls (mappings are cached on it).
        False without CUDA or when the driver refuses (copies then run at pageable speed)."""
        for slot, (_, _, buf) in self._maps.items():
            if buf is pulled.buf:
                held = self._pinned.get(slot)
                if held is None or held[0] is not buf:
                    ptr = cuda_host_register(buf, read_only=True)
                    if ptr is None:
                        return False
                    self._pinned[slot] = (buf, ptr)
                return True
        return False

    def close(self) -> None:
        """Unregister pinned mappings (the mappings themselves go with their views)."""
        for _, ptr in self._pinned.values():
            cuda_host_unregister(ptr)
        self._pinned.clear()

    def latest(self, min_version: int = -1) -> PulledVersion | None:
        """Hold the newest complete version (None if none, or none newer than min_version)."""
        deadline, pause, tries = time.monotonic() + _HOLD_TIMEOUT_S, _FIRST_PAUSE_S, 0
        while True:
            if tries > 1:  # the second try is at once: one lost race is the common case
                if time.monotonic() >= deadline:
                    break
                time.sleep(pause)
                pause = min(2 * pause, _MAX_PAUSE_S)
            tries += 1
            ptr = self._pointer()
            if ptr is None or ptr[2].version <= min_version:
                return None
            slot, ino, m = ptr
            try:
                fd = os.open(self.dir / f"slot{slot}.bin", os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                st = os.fstat(fd)
                if st.st_ino == ino and read_pointer(self.dir) == ptr:
                    if st.st_size < m.total_bytes:  # a cached mapping past the end would SIGBUS
                        raise WeightsRefused(f"{self.dir}/slot{slot}.bin: v{m.version} holds {st.st_size} bytes, "
                                             f"its manifest needs {m.total_bytes} (the file was cut short)")
                    held = PulledVersion(m, self._mapping(slot, fd, ino, m.total_bytes), fd)
                    fd = None
                    self._authenticate(held, f"{self.dir}/slot{slot}.bin")
                    return held
            except BlockingIOError:
                pass  # the relay is writing that slot: `current` has moved on, read it again
            except WeightsRefused:
                if fd is not None:  # None once the version holds it (a MAC refusal closed it)
                    os.close(fd)
                raise
            if fd is not None:
                os.close(fd)
        raise RuntimeError(f"{self.dir}: could not get hold of a version in {tries} tries over "
                           f"{_HOLD_TIMEOUT_S:g} s (the relay kept replacing or writing the slot its pointer named)")

    def _authenticate(self, held: PulledVersion, where: str) -> None:
        """With a key: the version's seals against its bytes, or WeightsRefused (the version is
        let go first)."""
        if self._verifier is None:
            return
        why = seal_refusal(held, self._verifier)
        if why:
            held.close()
            raise WeightsRefused(f"{where}: v{held.version} refused: {why} (changed in shared memory, or not "
                                 f"published by this cluster's trainer)")

    def retained(self) -> list[int]:
        """Older versions the relay keeps besides its newest (store.py, retained versions)."""
        return retained_versions(self.dir)

    def named(self, version: int) -> Manifest | None:
        """The manifest of the version numbered `version` here, the newest or a retained one (None:
        neither). Its (run_id, lineage, version) names the weights: the same number on another
        lineage is other weights, and after a trainer resumes, the relay retains the new lineage's
        versions under the numbers the discarded one used (store.py)."""
        m = self.manifest()
        if m is not None and m.version == version:
            return m
        try:
            return manifest_from_bytes((self.dir / f"v{version}.manifest").read_bytes())
        except (FileNotFoundError, ValueError):
            return None

    def has(self, version: int | tuple[str, int, int]) -> bool:
        """Whether the relay holds these weights: a number (any run and lineage), or an ident
        (run_id, lineage, version), which a version of another run or lineage does not match."""
        if isinstance(version, (tuple, list)):
            m = self.named(version[2])
            return m is not None and ident(m) == tuple(version)
        return version == self.current_version() or (self.dir / f"v{version}.manifest").exists()

    def version(self, version: int | tuple[str, int, int], verify_chunks: bool = True) -> PulledVersion | None:
        """Hold exactly `version`: the newest one, or a retained one (None if the relay has neither).
        Given an ident (run_id, lineage, version), a version of that number but another run or
        lineage is not handed out either (None): what is held is checked, not what was looked up.
        A retained file is never written again, so no lock is needed; its checksums are verified
        (it may come from a previous run of the relay) unless `verify_chunks` is False."""
        want = tuple(version) if isinstance(version, (tuple, list)) else None
        number = want[2] if want else version
        held = self._version(number, verify_chunks)
        if held is not None and want is not None and ident(held.manifest) != want:
            held.close()
            return None
        return held

    def _version(self, version: int, verify_chunks: bool) -> PulledVersion | None:
        pulled = self.latest(version - 1)
        if pulled is not None and pulled.version == version:
            return pulled
        if pulled is not None:
            pulled.close()
        try:
            m = manifest_from_bytes((self.dir / f"v{version}.manifest").read_bytes())
            fd = os.open(self.dir / f"v{version}.bin", os.O_RDONLY)
        except (FileNotFoundError, ValueError):
            return None
        try:
            buf = mmap.mmap(fd, m.total_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except (OSError, ValueError):
            os.close(fd)
            return None
        held = PulledVersion(m, buf, fd)
        self._authenticate(held, f"{self.dir}/v{version}.bin")
        if verify_chunks and held.verify():
            held.close()
            raise ValueError(f"{self.dir}/v{version}.bin: checksum mismatch")
        return held

    def pull_into(self, dst: dict, min_version: int = -1) -> int:
        """Copy the newest complete version into `dst` (same names, dtypes, shapes; any device);
        returns its version, or -1 if none is newer than `min_version` (dst untouched)."""
        pulled = self.latest(min_version)
        if pulled is None:
            return -1
        with pulled:
            pairs = []
            for name, t in pulled.tensors():
                d = dst[name]
                if d.dtype != t.dtype or d.shape != t.shape:
                    raise ValueError(f"{name}: destination is {d.dtype}{list(d.shape)}, "
                                     f"version has {t.dtype}{list(t.shape)}")
                pairs.append((d, t))
            cuda = {d.device for d, _ in pairs if copy_kind(d) == "cuda"}
            pinned = bool(cuda) and self.pin(pulled)
            for d, t in pairs:
                kind = copy_kind(d)
                if kind == "memcpy" and t.numel():
                    ctypes.memmove(d.data_ptr(), t.data_ptr(), t.numel() * t.element_size())
                elif kind == "cuda":
                    d.copy_(t, non_blocking=pinned)  # from page-locked memory: asynchronous DMA
                else:
                    d.copy_(t)  # a strided destination
            if cuda:
                import torch  # late: torch; configs validate without it
                for dev in cuda:  # the slot may be rewritten once the lock is dropped
                    torch.cuda.current_stream(dev).synchronize()
            return pulled.version
