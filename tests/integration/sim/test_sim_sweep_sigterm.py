"""A sweep (`bench/scale.py`) ended by SIGTERM (a `timeout`, a kill) stops its children and leaves
nothing in /dev/shm: before, its children ran on, orphaned, each for up to its own timeout (minutes
of both cores and gigabytes of memory), and left their weight folders behind when they were killed.
A child killed outright (SIGKILL: the OOM killer, an overrun) cannot clean up; its parent removes its
folder for it. The checks look at this sweep's own folders only (named on its children's command
lines): another sweep running on the machine makes folders of the same kinds, which failed the
earlier check of "no new laminar-sim-* folder" while one ran beside it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import ROOT

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


def spec_of(pid: int) -> dict | None:
    """The run spec a sweep child was started with (the JSON after --child on its command line)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return None
    return json.loads(argv[argv.index("--child") + 1]) if "--child" in argv else None


def sweep(modes: str, jobs: int, out: Path) -> subprocess.Popen:
    """bench/scale.py at 7B/16 in its own process group (as a shell job or a systemd unit runs it)."""
    return subprocess.Popen([sys.executable, "bench/scale.py", "--model", "7B", "--gpus", "16", "--modes", modes,
                             "--jobs", str(jobs), "--pace-cache", "none",  # never the repository's cache
                             "--out", str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_for_clusters(parent: subprocess.Popen, n: int) -> tuple[list[int], set[Path]]:
    """The sweep's children once `n` of them have made their weight folders, and the shared-memory
    folders that are this sweep's own: its work folder and its children's weights roots (named on
    their command lines; other sweeps on the machine make folders of the same kind)."""
    kids: list[int] = []
    ours: set[Path] = set()
    end = time.monotonic() + 150
    while time.monotonic() < end:
        kids = children(parent.pid)
        specs = [sp for sp in map(spec_of, kids) if sp]
        ours = {Path(sp["weights_root"]) for sp in specs} | {Path(sp["root"]) for sp in specs}
        if len(specs) >= n and sum(Path(sp["weights_root"]).exists() for sp in specs) >= n:
            return kids, ours
        time.sleep(0.2)  # polling /proc and /dev/shm for the children's start
    raise AssertionError("the children never started their clusters")


@pytest.mark.parametrize("group", [False, True], ids=["parent", "process-group"])
def test_sigterm_stops_the_children_and_cleans_shared_memory(tmp_path, group):
    # process-group: every process gets SIGTERM at once (a shell's kill of the job, systemd's stop), and
    # each child a second one from its parent's stop, which must not break off the first one's cleanup
    parent = sweep("laminar,sync" if group else "laminar", 2 if group else 1, tmp_path / "out.json")
    kids: list[int] = []
    try:
        kids, ours = wait_for_clusters(parent, 2 if group else 1)
        if group:
            os.killpg(parent.pid, signal.SIGTERM)
        else:
            parent.send_signal(signal.SIGTERM)
        parent.wait(60)
        end = time.monotonic() + 30
        while time.monotonic() < end and any(os.path.exists(f"/proc/{k}") for k in kids):
            time.sleep(0.2)
        assert not [k for k in kids if os.path.exists(f"/proc/{k}")], "a child outlived the sweep"
        assert not [p for p in ours if p.exists()]
    finally:
        if parent.poll() is None:
            parent.kill()
        for k in kids:  # orphans too (reparented once their parent is gone)
            if os.path.exists(f"/proc/{k}"):
                os.kill(k, signal.SIGKILL)


def test_a_child_killed_outright_leaves_no_weights_behind(tmp_path):
    parent = sweep("laminar", 1, tmp_path / "out.json")
    kids: list[int] = []
    try:
        kids, ours = wait_for_clusters(parent, 1)
        for k in kids:
            os.kill(k, signal.SIGKILL)  # as the OOM killer does: no finally block runs
        out, _ = parent.communicate(timeout=60)
        assert "FAILED" in out and "exit -9" in out, out[-2000:]  # reported as a failed run, not lost silently
        assert not [p for p in ours if p.exists()], out[-2000:]
    finally:
        if parent.poll() is None:
            parent.kill()
