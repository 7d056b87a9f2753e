"""A sweep (`bench/scale.py`) ended by SIGTERM (a `timeout`, a kill) stops its children and leaves
nothing in /dev/shm: before, its children ran on, orphaned, each for up to its own timeout (minutes
of both cores and gigabytes of memory), and left their weight folders behind when they were killed.
A child killed outright (SIGKILL: the OOM killer, an overrun) cannot clean up; its parent removes its
folder for it."""
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


def sweep(modes: str, jobs: int, out: Path) -> subprocess.Popen:
    """bench/scale.py at 7B/16 in its own process group (as a shell job or a systemd unit runs it)."""
    return subprocess.Popen([sys.executable, "bench/scale.py", "--model", "7B", "--gpus", "16", "--modes", modes,
                             "--jobs", str(jobs), "--out", str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_for_clusters(parent: subprocess.Popen, n: int, before: set[str]) -> list[int]:
    """The sweep's children once `n` of them have made their weight folders."""
    kids: list[int] = []
    end = time.monotonic() + 150
    while time.monotonic() < end and not (len(kids) >= n and len(shm("laminar-sim-") - before) >= n):
        kids = children(parent.pid)
        time.sleep(0.2)  # polling /proc and /dev/shm for the children's start
    assert len(kids) >= n and len(shm("laminar-sim-") - before) >= n, "the children never started their clusters"
    return kids


@pytest.mark.parametrize("group", [False, True], ids=["parent", "process-group"])
def test_sigterm_stops_the_children_and_cleans_shared_memory(tmp_path, group):
    # process-group: every process gets SIGTERM at once (a shell's kill of the job, systemd's stop), and
    # each child a second one from its parent's stop, which must not break off the first one's cleanup
    before_sim, before_scale = shm("laminar-sim-"), shm("laminar-scale-")
    parent = sweep("laminar,sync" if group else "laminar", 2 if group else 1, tmp_path / "out.json")
    kids: list[int] = []
    try:
        kids = wait_for_clusters(parent, 2 if group else 1, before_sim)
        if group:
            os.killpg(parent.pid, signal.SIGTERM)
        else:
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


def test_a_child_killed_outright_leaves_no_weights_behind(tmp_path):
    before_sim, before_scale = shm("laminar-sim-"), shm("laminar-scale-")
    parent = sweep("laminar", 1, tmp_path / "out.json")
    kids: list[int] = []
    try:
        kids = wait_for_clusters(parent, 1, before_sim)
        for k in kids:
            os.kill(k, signal.SIGKILL)  # as the OOM killer does: no finally block runs
        out, _ = parent.communicate(timeout=60)
        assert "FAILED" in out and "exit -9" in out, out[-2000:]  # reported as a failed run, not lost silently
        assert not shm("laminar-sim-") - before_sim, out[-2000:]
        assert not shm("laminar-scale-") - before_scale
    finally:
        if parent.poll() is None:
            parent.kill()
