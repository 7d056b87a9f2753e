"""roles/trainer/memory.py trim_heap: freed heap pages go back to the kernel, so a CPU trainer's
resident set does not keep what earlier steps' differently shaped tensors left behind."""
from __future__ import annotations

import subprocess
import sys

import pytest
from laminar.roles.trainer import memory

CHILD = r"""
import json, sys
from laminar.roles.trainer.memory import rss_bytes, trim_heap
blocks = [b"\x01" * 60_000 for _ in range(4000)]     # ~240 MB of heap blocks (below the mmap threshold)
keep = blocks[::50]                                  # every 50th stays: the heap cannot shrink from its top
del blocks
before = rss_bytes()
freed = trim_heap()
after = rss_bytes()
print(json.dumps({"before": before, "after": after, "freed": freed, "kept": len(keep)}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim and /proc")
def test_trim_heap_returns_fragmented_free_pages_to_the_kernel():
    import json
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120,
                         env={"MALLOC_ARENA_MAX": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    if r["freed"] is None:
        pytest.skip("no glibc malloc_trim here")
    # 4000 x 60 kB were freed but 80 kept scattered through the heap: without the trim they stay resident
    assert r["before"] - r["after"] > 150e6, r
    assert r["freed"] == r["before"] - r["after"] or abs(r["freed"] - (r["before"] - r["after"])) < 16e6, r


def test_trim_heap_without_glibc_says_none(monkeypatch):
    monkeypatch.setattr(memory, "_malloc_trim", None)
    assert memory.trim_heap() is None
