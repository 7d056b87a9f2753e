"""A sweep (`bench/scale.py`) ended by SIGTERM (a `timeout`, a kill) stops its children and leaves
nothing in /dev/shm: before, its children ran on, orphaned, each for up to its own timeout (minutes
of both cores and gigabytes of memory), and left their weight folders behind when they were killed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")

pytestmark = pytest.mark.timeout(180)


def children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (from /proc: no pgrep needed)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def shm(prefix: str) -> set[str]:
    return {p.name for p in SHM.iterdir() if p.name.startswith(prefix)}


def test_sigterm_stops_the_children_and_cleans_shared_memory():
    before_sim, before_scale = shm("laminar-sim-"), shm("laminar-scale-")
    parent = subprocess.Popen([sys.executable, "bench/scale.py", "--model", "7B", "--gpus", "16", "--modes", "laminar",
                               "--jobs", "1"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    kids: list[int] = []
    try:
        end = time.monotonic() + 120
        while time.monotonic() < end and not (kids and shm("laminar-sim-") - before_sim):
            kids = children(parent.pid)
            time.sleep(0.2)
        assert kids and shm("laminar-sim-") - before_sim, "the child never started its cluster"
        parent.send_signal(signal.SIGTERM)
        parent.wait(60)
        end = time.monotonic() + 30
        while time.monotonic() < end and any(os.path.exists(f"/proc/{k}") for k in kids):
            time.sleep(0.2)
        assert not [k for k in kids if os.path.exists(f"/proc/{k}")], "a child outlived the sweep"
        assert not shm("laminar-sim-") - before_sim and not shm("laminar-scale-") - before_scale
    finally:
        if parent.poll() is None:
            parent.kill()
        for k in kids:  # orphans too (reparented once their parent is gone)
            if os.path.exists(f"/proc/{k}"):
                os.kill(k, signal.SIGKILL)
