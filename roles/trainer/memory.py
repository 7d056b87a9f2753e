"""Peak memory of one stretch of a trainer rank's work (a load, a forward, a step), in bytes above its start.

    with PeakMemory(device) as peak:
        ...
    peak.peak_bytes, peak.kind      # e.g. 1_234_567_890, "cuda_allocated" or "rss"
    PeakMemory(device, base=b)      # the peak above `b` bytes (taken earlier) instead of above the start

On a GPU it is the caching allocator's own count: `torch.cuda.max_memory_allocated` after
`reset_peak_memory_stats`, minus what was allocated at the start (tensors only: the allocator's
cached but unused blocks, the CUDA context and NCCL's buffers are not in it).

On the CPU it is the process's resident set: Linux keeps its high-water mark (VmHWM in
/proc/self/status) and resets it to the current RSS when "5" is written to /proc/self/clear_refs,
so the peak of a stretch is VmHWM at its end minus VmRSS at its start. That counts every page the
process touched: tensors, the allocator's slack (glibc returns large blocks at once when
MALLOC_MMAP_THRESHOLD_ is set; otherwise freed memory may stay resident), and file pages mapped
and read (a memory-mapped safetensors slice counts while it is mapped). Where clear_refs cannot be
written the peak is `ru_maxrss` (the process's lifetime peak) minus the start (kind "maxrss"), an
upper bound. The stretches must not nest (the reset is process-wide).

`trim_heap()` gives the C allocator's free pages back to the kernel (glibc's `malloc_trim(0)`, which
also releases free pages inside each arena, not only at its top). A CPU trainer allocates and
frees each step's activations in shapes that change with every batch; glibc keeps the freed
blocks below its (adaptive) mmap threshold in its arenas, so without a trim the resident set
grows from version to version although no tensor outlives its step.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import resource

STATUS = "/proc/self/status"
CLEAR_REFS = "/proc/self/clear_refs"


def _status_kib(field: str) -> int:
    with open(STATUS) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _load_malloc_trim():
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim this way
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


_malloc_trim = _load_malloc_trim()


def trim_heap() -> int | None:
    """Release the allocator's free pages (module docstring); the bytes the resident set fell by, None
    where the C library has no malloc_trim."""
    if _malloc_trim is None:
        return None
    before = rss_bytes()
    _malloc_trim(0)
    return max(0, before - rss_bytes())


def rss_bytes() -> int:
    """This process's resident set now."""
    return _status_kib("VmRSS") * 1024


def reset_rss_peak() -> bool:
    """Reset this process's RSS high-water mark to its RSS now (False where the kernel refuses)."""
    try:
        with open(CLEAR_REFS, "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_peak_bytes() -> int:
    return _status_kib("VmHWM") * 1024


def memory_now(device=None) -> int:
    """What PeakMemory counts, now: the allocator's bytes on a GPU, the resident set on the CPU."""
    if device is not None and getattr(device, "type", str(device)) == "cuda":
        import torch  # late: torch; configs validate without it
        return torch.cuda.memory_allocated(device)
    return rss_bytes()


class PeakMemory:
    """Context manager: the peak memory of its body above the memory at its start (module docstring)."""

    def __init__(self, device=None, base: int | None = None):
        self.cuda = device is not None and getattr(device, "type", str(device)) == "cuda"
        self.device = device
        self.base = base
        self.peak_bytes = 0
        self.start = 0
        self.kind = ""

    def __enter__(self) -> PeakMemory:
        if self.cuda:
            import torch  # late: torch; configs validate without it
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start, self.kind = torch.cuda.memory_allocated(self.device), "cuda_allocated"
        else:
            self.kind = "rss" if reset_rss_peak() else "maxrss"
            self.start = rss_bytes()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            import torch  # late: torch; configs validate without it
            torch.cuda.synchronize(self.device)
            top = torch.cuda.max_memory_allocated(self.device)
        elif self.kind == "rss":
            top = rss_peak_bytes()
        else:
            top = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.peak_bytes = max(0, top - (self.start if self.base is None else self.base))
